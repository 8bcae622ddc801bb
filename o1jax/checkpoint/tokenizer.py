"""Tokenizer + chat template, built from GGUF metadata or an HF `tokenizer.json`.

The heavy lifting is done by the `tokenizers` library; this module only
assembles a byte-level BPE from llama.cpp's metadata (vocab, merges, token
types, pre-tokenizer name), or a SentencePiece-style BPE (llama.cpp's "llama"
tokenizer model, e.g. Gemma 3) from its vocabulary and scores, and renders the
checkpoint's Jinja chat template.
"""

from __future__ import annotations

import contextvars
import datetime
import functools
import json
import logging
import operator
import os
import pathlib
import re
import time
from typing import Iterable, Sequence

import jinja2.compiler
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import numpy as np
import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers

from o1jax.checkpoint.errors import CheckpointError, read_json_object
from o1jax.checkpoint.gguf_loader import GGUF_END_OF_GENERATION_KEYS

log = logging.getLogger(__name__)
LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # (text that is not valid Unicode)

# llama.cpp token types (gguf TokenType): 3 = CONTROL (special: skipped when decoding
# without specials), 4 = USER_DEFINED (a model's added tokens, e.g. Qwen's <think> and
# <tool_call>: matched whole in raw text, decoded as text, as llama.cpp prints them and
# transformers keeps its added tokens that are not special).
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4

# Pre-tokenizers by llama.cpp's `tokenizer.ggml.pre` name. "smollm" (like the
# StarCoder family) splits every digit on its own, then applies GPT-2's regex.
_DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact", "codeshell", "command-r")
_GPT2_PRE = ("gpt2", "gpt-2")
# llama.cpp's default byte-level pre-tokenizer ("default", or no tokenizer.ggml.pre: files
# converted before the key existed): each regex splits the pieces the one before left,
# punctuation runs first, then GPT-2's regex, then digit runs, cut into threes.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_DEFAULT_PRE = ("default", None)
_DEFAULT_SPLITS = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]")

# Tokens llama.cpp ends generation on by their text, whatever the metadata's eos/eot ids
# say (a Gemma 3 GGUF names <eos>, and its chat turns end with <end_of_turn>).
END_OF_GENERATION_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
    "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>", "<|return|>", "<|call|>"))


def gguf_end_of_generation_ids(meta: dict) -> list[int]:
  """The ids a GGUF's model stops on, as llama.cpp reads them: the metadata's eos, eot and
  eom ids, and every token whose text is one of END_OF_GENERATION_TEXTS. The eos id
  first: it is the tokenizer's `eos_token` (a template's {{ eos_token }}, the saved config)."""
  ids = [int(meta[k]) for k in GGUF_END_OF_GENERATION_KEYS if meta.get(k) is not None]
  tokens = meta.get("tokenizer.ggml.tokens") or ()
  by_text = [i for i, t in enumerate(tokens) if t in END_OF_GENERATION_TEXTS]
  return list(dict.fromkeys(ids[:1] + sorted(set(ids[1:]) | set(by_text))))

# ChatML, used when a checkpoint has no template of its own.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")


# Split regexes of llama.cpp's pre-tokenizers that differ from GPT-2's (as in the models'
# own tokenizer.json): Llama 3 keeps runs of up to 3 digits, Qwen2 (also Qwen3 and the
# DeepSeek-R1 Qwen distills) splits every digit; both take case-insensitive contractions
# and split newlines from other whitespace.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Tekken (Mistral Nemo, Small 3, Magistral, Ministral) and o200k (gpt-4o: Phi-4) split
# words at case changes (an upper-case run, then lower-case letters), "/" may trail
# punctuation; tekken takes single digits and no contractions, o200k up to three digits
# and case-insensitive contractions glued to the word. As the models' tokenizer.json
# writes them (llama.cpp approximates the Unicode case classes with a-z / A-Z).
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"


def _case_split(contraction: str, digits: str) -> str:
  lead = r"[^\r\n\p{L}\p{N}]?"
  return (f"{lead}{_UPPER}*{_LOWER}+{contraction}|{lead}{_UPPER}+{_LOWER}*{contraction}"
          f"|{digits}" r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


# Pre-tokenizers whose BPE takes a pre-token that is itself in the vocabulary as one token
# before applying any merge (llama.cpp's ignore_merges; their tokenizer.json sets it too),
# and which start with BOS unless the GGUF says otherwise (llama.cpp's add_bos default).
_IGNORE_MERGES_PRE = ("llama3", "llama-bpe", "tekken")


def _adds_bos_by_default(meta: dict) -> bool:
  """llama.cpp's default where a GGUF has no tokenizer.ggml.add_bos_token: SentencePiece
  vocabularies and the llama3 / tekken byte-level ones start with BOS, others do not."""
  return (meta.get("tokenizer.ggml.model") == "llama"
          or meta.get("tokenizer.ggml.pre") in _IGNORE_MERGES_PRE)


_REGEX_PRE = {"llama3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
              "dbrx": _LLAMA3_SPLIT,
              "qwen2": _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}"),
              "deepseek-r1-qwen": _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}"),
              "tekken": _case_split("", r"\p{N}"),
              "gpt-4o": _case_split(_CONTRACTION, r"\p{N}{1,3}")}


def _byte_level_pre(pre_name: str | None, path) -> pre_tokenizers.PreTokenizer:
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  if pre_name in _DIGIT_SPLIT_PRE:
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
  if pre_name in _GPT2_PRE:
    return byte_level
  if pre_name in _DEFAULT_PRE:
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(tokenizers.Regex(r), behavior="isolated") for r in _DEFAULT_SPLITS]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  if pre_name in _REGEX_PRE:
    split = pre_tokenizers.Split(tokenizers.Regex(_REGEX_PRE[pre_name]), behavior="isolated")
    return pre_tokenizers.Sequence(
        [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  supported = _DIGIT_SPLIT_PRE + _GPT2_PRE + _DEFAULT_PRE[:1] + tuple(_REGEX_PRE)
  raise CheckpointError(f"{path}: tokenizer pre-tokenizer {pre_name!r} is not supported "
                        f"(supported: {', '.join(supported)})")


class _GenerationBlock(jinja2.ext.Extension):
  """`{% generation %}...{% endgeneration %}` (transformers marks the assistant's tokens
  with it for training): renders its body."""
  tags = {"generation"}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

  def _body(self, caller):
    return caller()


_MAX_TOJSON_INDENT = 64  # characters: a template's indent multiplies with its nesting


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  # transformers' filter: Jinja's own escapes <, >, &, ' (as \u003c ...) and sorts keys,
  # so a tool call's JSON would read differently to the model than it was trained on.
  width = indent if isinstance(indent, int) and not isinstance(indent, bool) else len(str(indent or ""))
  if width > _MAX_TOJSON_INDENT:
    raise ValueError(f"tojson indent of {width} characters: at most {_MAX_TOJSON_INDENT}")
  return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
  return datetime.datetime.now().strftime(fmt)


# Characters or items one operation of a chat template may make (a prompt is far smaller),
# and the bits of an integer power.
_MAX_TEMPLATE_VALUE = 1 << 24
_MAX_POWER_BITS = 1 << 16
_MAX_SLICES = 1 << 16  # lists the slice filter makes (a template splits a list in a few)
_FORMAT_SPEC = re.compile(r"%(?:\((?P<key>[^)]*)\))?[-#0 +]*(?P<width>\*|\d*)"
                          r"(?:\.(?P<precision>\*|\d*))?[hlL]?(?P<conversion>.?)", re.S)


# Steps one render may take (loop turns, calls, operators, comparisons, filters): a
# Qwen 3-style template takes 13 a message (SmolLM2's 6), so 1 Mi is 80,000 messages; two
# nested loops of 100,000 turns writing nothing (10**10 turns, hours) stop after 0.2 s, a
# macro calling itself twice per level after ~4 s.
_MAX_TEMPLATE_TURNS = 1 << 20
_turns_left: contextvars.ContextVar[list | None] = contextvars.ContextVar("_turns_left",
                                                                        default=None)


# A turn per this many characters or items an operation reads or makes (a loop of 1 Mi
# turns each copying 16 Mi characters took hours): 1 Mi turns are ~4 G characters at most.
_TURN_CHARS = 4096


# What the turns do not see (`'y' in s` over 16 Mi characters is one turn) the clock does,
# at every turn: no real template comes near it (they take milliseconds).
_MAX_TEMPLATE_SECONDS = 10.0


# What one step may read: the budget is checked before a step runs, not during it (a step
# charged most of the budget would run for minutes in C).
_MAX_STEP_SIZE = 4 * _MAX_TEMPLATE_VALUE


def _take_turn(size: int = 0) -> None:
  left = _turns_left.get()
  if left is not None:
    if size > _MAX_STEP_SIZE:
      raise jinja2.sandbox.SecurityError(f"a step reading more than {_MAX_STEP_SIZE:,} "
                                         f"characters or items")
    left[0] -= 1 + size // _TURN_CHARS
    if left[0] < 0:
      raise jinja2.sandbox.SecurityError(f"more than {_MAX_TEMPLATE_TURNS:,} steps (loop "
                                         f"turns, calls, operators, filters)")
    if time.monotonic() > left[1]:
      raise jinja2.sandbox.SecurityError(f"rendering took more than {_MAX_TEMPLATE_SECONDS:g} s")


def _counted_turns(iterable):
  """A `{% for %}`'s iterable, one turn taken per item."""
  for item in iterable:
    _take_turn()
    yield item


def _too_big(what: str):
  raise jinja2.sandbox.SecurityError(f"{what} would make more than {_MAX_TEMPLATE_VALUE:,} "
                                     f"characters")


def _check_format(spec, args) -> None:
  """`spec % args` (or spec|format(*args)) within bounds: no width or precision past the
  cap, given in the spec or, for a '*', by the argument at its place ("%%" takes none)."""
  if not isinstance(spec, str):
    return
  values = list(args) if isinstance(args, (tuple, list)) else [args]
  place = 0  # the next positional argument
  for m in _FORMAT_SPEC.finditer(spec):
    if m.group("conversion") == "%" and m.group(0) == "%%":
      continue
    for field in (m.group("width"), m.group("precision")):
      if field == "*":
        value = values[place] if place < len(values) else None
        place += 1
        if isinstance(value, int) and abs(value) > _MAX_TEMPLATE_VALUE:
          _too_big(f"a '*' width of {value}")
      elif field and (len(field) > 9 or int(field) > _MAX_TEMPLATE_VALUE):
        _too_big(f"the width {field}")
    place += m.group("key") is None


_TEXT = (str, bytes, bytearray)  # ('x'.encode() * 10**9 was a GB: bytes are text here)


def _size(value) -> int:
  return len(value) if isinstance(value, (*_TEXT, list, tuple, dict)) else 0


def _checked_concat(parts) -> str:
  """The `~` operator's join (Jinja's str_join), bounded."""
  texts = [str(part) for part in parts]
  size = sum(map(len, texts))
  _take_turn(size)
  if size > _MAX_TEMPLATE_VALUE:
    _too_big("a concatenation")
  return "".join(texts)


_SCALARS = (int, float, bool, type(None))


def _deep_size(value, limit: int = _MAX_TEMPLATE_VALUE) -> int:
  """Characters and items of `value`, those of the strings and containers it holds too (a
  list holding a list of 3 M items 3,000 times is 9 G: comparing it is that much work),
  counted up to `limit` + 1."""
  if isinstance(value, _TEXT):
    return min(len(value), limit + 1)
  if isinstance(value, _SCALARS):
    return 0
  # Templates cannot change a list or dict (the immutable sandbox): a render remembers
  # each container's size, so the charge of the next step that reads it is O(1).
  left = _turns_left.get()
  known = left[2] if left is not None else {}
  if id(value) in known:
    return min(known[id(value)][1], limit + 1)
  total, stack = 0, [value]
  while stack and total <= limit:
    x = stack.pop()
    if isinstance(x, _TEXT):
      total += len(x)
    elif isinstance(x, (list, tuple, set, frozenset)):
      total += len(x)
      stack.extend(e for e in x if not isinstance(e, _SCALARS))  # (numbers: no more)
    elif isinstance(x, dict):
      total += len(x)
      stack.extend(x.keys())
      stack.extend(x.values())
  if not stack and left is not None:  # (exact: counted to the end; the value is kept so
    known[id(value)] = (value, total)  # its id stays its own during the render)
  return min(total, limit + 1)


def _check_binop(operator: str, left, right) -> None:
  sized = lambda x: isinstance(x, (*_TEXT, list, tuple))
  whole = lambda x: isinstance(x, int) and not isinstance(x, bool)
  if operator == "*":
    if whole(left) and whole(right) and (
        left.bit_length() + right.bit_length() > _MAX_POWER_BITS):
      # (a namespace value squared 60 times: seconds a step, past the time limit)
      raise jinja2.sandbox.SecurityError(f"a product of more than {_MAX_POWER_BITS:,} bits")
    for seq, times in ((left, right), (right, left)):
      if sized(seq) and whole(times) and times > 0 and (
          _deep_size(seq, _MAX_TEMPLATE_VALUE // times) * times > _MAX_TEMPLATE_VALUE):
        _too_big("a repetition")
  elif operator == "+":
    if sized(left) and sized(right) and (
        _deep_size(left) + _deep_size(right) > _MAX_TEMPLATE_VALUE):
      _too_big("a concatenation")
  elif operator == "**":
    if whole(left) and whole(right) and abs(left) > 1 and (
        right * abs(left).bit_length() > _MAX_POWER_BITS):
      raise jinja2.sandbox.SecurityError(f"a power of more than {_MAX_POWER_BITS:,} bits")
  elif operator == "%":
    _check_format(left, right)


_COMPARE = {"eq": operator.eq, "ne": operator.ne, "gt": operator.gt, "gteq": operator.ge,
            "lt": operator.lt, "lteq": operator.le, "in": lambda a, b: a in b,
            "notin": lambda a, b: a not in b}


def _compare_work(op: str, left, right) -> int:
  """Items a comparison may read: `in` a list compares the needle with every item."""
  if op in ("in", "notin"):
    if isinstance(right, str):
      return len(right) + _deep_size(left)
    if isinstance(right, (list, tuple)):
      return len(right) * (1 + _deep_size(left, _MAX_STEP_SIZE // max(1, len(right))))
    return 1 + _deep_size(left)  # (a dict or set hashes the needle)
  return _deep_size(right, _deep_size(left))


def _checked_compare(left, op: str, right):
  """`left op right`, its work taken from the render's steps first (`y in [z] * 3000`
  compared lists of 3 M items 3,000 times, one step)."""
  _take_turn(_compare_work(op, left, right))
  return _COMPARE[op](left, right)


def _replace_size(text: str, old: str, new: str) -> int:
  """The length of `text.replace(old, new)` ("" is found between every character)."""
  times = text.count(old) if old else len(text) + 1
  return len(text) + times * (len(new) - len(old))


def _format_size(text: str, args, kwargs) -> int:
  """An upper bound of `text.format(*args, **kwargs)`'s length: each field at most the
  widest value or width (a width or precision in a spec, or from an argument: `{:{}}`;
  `'{0}' * 2000` repeats a value 2,000 times). Escaped braces are text."""
  import string
  try:
    fields = [(spec or "") for _, field, spec, _ in string.Formatter().parse(text)
              if field is not None]
  except ValueError:  # (format raises the same)
    return 0
  values = [*args, *kwargs.values()]
  if args and isinstance(args[0], dict):  # (format_map)
    values += list(args[0].values())
  widest = max((24 if isinstance(v, (int, float)) else _deep_size(v) for v in values), default=0)
  for spec in fields:
    for n in re.findall(r"\d+", spec):
      widest = max(widest, int(n) if len(n) <= 9 else _MAX_TEMPLATE_VALUE + 1)
    if "{" in spec:  # a width from an argument
      widest = max([widest] + [v for v in values if isinstance(v, int) and not isinstance(v, bool)])
  return len(text) + len(fields) * widest


def _check_str_method(method, args, kwargs) -> None:
  """What a str method called in a template would make, bounded before it runs:
  `'x'.ljust(4e8)`, `('\\t' * 16e6).expandtabs(64)` (1 G characters), `.replace`,
  `'{:>400000000}'.format(1)`."""
  method = getattr(method, "__wrapped__", method)  # (the sandbox wraps str.format)
  text = getattr(method, "__self__", None)
  name = getattr(method, "__name__", "")
  if isinstance(text, (list, tuple)) and name in ("count", "index") and args:
    # (compares every item with the argument: 30,000 lists of 1 M items, 20 s, one step)
    _take_turn(len(text) * (1 + _deep_size(args[0], _MAX_STEP_SIZE // max(1, len(text)))))
    return
  if not isinstance(text, _TEXT):
    return
  arg = lambda i, key, default: args[i] if len(args) > i else kwargs.get(key, default)
  size = 0
  if name in ("ljust", "rjust", "center", "zfill"):
    size = arg(0, "width", 0)
  elif name == "expandtabs":
    tab = arg(0, "tabsize", 8)
    tabs = text.count("\t" if isinstance(text, str) else b"\t")
    size = len(text) + tabs * tab if isinstance(tab, int) else 0
  elif (name == "replace" and len(args) >= 2 and isinstance(args[0], _TEXT)
        and isinstance(args[1], _TEXT) and isinstance(args[0], str) == isinstance(text, str)):
    size = _replace_size(text, args[0], args[1])
  elif name == "join" and args and isinstance(args[0], (list, tuple)):
    size = _deep_size(args[0]) + len(text) * len(args[0])
  elif name == "translate" and args:
    # (each character may become its mapped text: 1e6 x 300 made 300 M characters; a
    # list or tuple is a table too, indexed by code point)
    table = args[0]
    values = (table.values() if isinstance(table, dict) else table
              if isinstance(table, (list, tuple, *_TEXT)) else None)
    if values is None:
      raise jinja2.sandbox.SecurityError(f"str.translate with a {type(table).__name__} table")
    longest = max((len(v) for v in values if isinstance(v, _TEXT)), default=1)
    size = len(text) * max(longest, 1)
  elif name in ("format", "format_map"):
    size = _format_size(text, args, kwargs)
  if isinstance(size, int) and not isinstance(size, bool) and size > _MAX_TEMPLATE_VALUE:
    _too_big(f"str.{name}")


# Jinja's comparison tests, as the operators `_checked_compare` weighs.
_TEST_OPS = {"eq": "eq", "equalto": "eq", "==": "eq", "ne": "ne", "!=": "ne", "lt": "lt",
             "lessthan": "lt", "<": "lt", "le": "lteq", "<=": "lteq", "gt": "gt",
             "greaterthan": "gt", ">": "gt", "ge": "gteq", ">=": "gteq", "in": "in"}


def _counted_test(name: str, func):
  """A test whose work is a step of the render (`y is in(L)`, `select('eq', y)` compared
  big lists in one step, as `in` did)."""
  from jinja2.utils import _PassArg
  lead = 1 if _PassArg.from_obj(func) is not None else 0  # (the environment or context)
  op = _TEST_OPS.get(name)

  @functools.wraps(func)  # (keeps how Jinja passes its first argument)
  def run(*args, **kwargs):
    rest = args[lead:]
    _take_turn(_compare_work(op, rest[0], rest[1]) if op and len(rest) > 1 else 0)
    return func(*args, **kwargs)
  return run


def _render_time_filter(name: str, func):
  """`func` taking the render context (so Jinja never calls it while compiling), with the
  width arguments of center/indent/format bounded."""
  from jinja2.utils import _PassArg  # (how Jinja tells a filter's first argument)
  kind = _PassArg.from_obj(func)

  @jinja2.pass_context
  def run(context, value, *args, **kwargs):
    _take_turn(_size(value))
    if name in ("center", "indent"):
      width = args[0] if args else kwargs.get("width", 0)
      if isinstance(width, int) and width > _MAX_TEMPLATE_VALUE:
        _too_big(f"{name}({width})")
      # (indent writes its width on every line: 1,000 lines x 1e6 made 1 G characters)
      lines = str(value).count("\n") + 1 if name == "indent" else 1
      per_line = width if isinstance(width, int) else len(str(width))
      if name == "indent" and lines * max(per_line, 0) > _MAX_TEMPLATE_VALUE:
        _too_big(f"indent({width}) of {lines} lines")
    elif name == "wordwrap":
      width = args[0] if args else kwargs.get("width", 79)
      wrap = args[2] if len(args) > 2 else kwargs.get("wrapstring") or "\n"
      pieces = len(str(value)) // max(width, 1) + 1 if isinstance(width, int) else 1
      if len(str(value)) + pieces * len(str(wrap)) > _MAX_TEMPLATE_VALUE:
        _too_big("a wordwrap")
    elif name == "slice":  # (as many lists as asked for: 2e7 empty ones, 14 s and 1.5 GB)
      count = args[0] if args else kwargs.get("slices", 0)
      if isinstance(count, int) and count > _MAX_SLICES:
        raise jinja2.sandbox.SecurityError(f"slice({count}) would make more than "
                                           f"{_MAX_SLICES:,} lists")
    elif name == "batch":  # (the last batch is filled to linecount: 1e8 items in one step)
      count = args[0] if args else kwargs.get("linecount", 0)
      if isinstance(count, int) and count > _MAX_TEMPLATE_VALUE:
        _too_big(f"batch({count})")
    elif name == "sum":  # (lists added one by one: quadratic, unbounded)
      start = args[1] if len(args) > 1 else kwargs.get("start", 0)
      if isinstance(start, (str, list, tuple)):
        value = list(value)
        if _deep_size(start) + sum(_deep_size(v) for v in value) > _MAX_TEMPLATE_VALUE:
          _too_big("a sum")
    elif name == "format":
      _check_format(value, args)
    elif name == "join" and not kwargs.get("attribute") and not isinstance(value, str):
      glue = len(str(args[0] if args else kwargs.get("d", "")))
      items, size = [], 0
      for item in value:  # (a generator too, counted as it is read: join reads it whole)
        size += len(str(item)) + glue
        if size > _MAX_TEMPLATE_VALUE:
          _too_big("a join")
        items.append(item)
      value = items
    elif name == "replace" and isinstance(value, str) and len(args) >= 2:
      if _replace_size(value, str(args[0]), str(args[1])) > _MAX_TEMPLATE_VALUE:
        _too_big("a replace")
    lead = ((context,) if kind is _PassArg.context else
            (context.eval_ctx,) if kind is _PassArg.eval_context else
            (context.environment,) if kind is _PassArg.environment else ())
    return func(*lead, value, *args, **kwargs)
  return run


class _BoundedCodeGenerator(jinja2.compiler.CodeGenerator):
  """Jinja's code generator with `~` joined by `_checked_concat` (and never folded), loops
  and comparisons counted as steps of the render."""

  _recursive_loop = False  # (inside a recursive loop's header: `write`)

  def visit_For(self, node, frame):
    """The loop's iterable read through `environment.counted_turns` (a turn an item), a
    recursive loop's inner ones (`loop(x)`) too."""
    counted = jinja2.nodes.EnvironmentAttribute("counted_turns", lineno=node.iter.lineno)
    if not (isinstance(node.iter, jinja2.nodes.Call) and node.iter.node == counted):
      node.iter = jinja2.nodes.Call(counted, [node.iter], [], None, None,
                                    lineno=node.iter.lineno)
    outer, self._recursive_loop = self._recursive_loop, node.recursive
    try:
      super().visit_For(node, frame)
    finally:
      self._recursive_loop = outer

  def write(self, x: str) -> None:
    # Jinja writes a recursive loop's iterable as this one word (`visit_For`).
    if x == "reciter" and self._recursive_loop:
      x = "environment.counted_turns(reciter)"
    super().write(x)

  def visit_Compare(self, node, frame):
    """Each comparison through `environment.checked_compare`; a chain `a < b < c` as
    `cmp(a, b) and cmp(b, c)` with b evaluated once (a walrus temporary), so a false one
    stops it as Python's does (`1 > 2 < raise_exception(...)` raises nothing)."""
    self.write("(")
    left = None
    for i, operand in enumerate(node.ops):
      if i:
        self.write(" and ")
      self.write("environment.checked_compare(")
      if left is None:
        self.visit(node.expr, frame)
      else:
        self.write(left)
      self.write(f", {operand.op!r}, ")
      if i == len(node.ops) - 1:
        self.visit(operand.expr, frame)
      else:
        left = self.temporary_identifier()
        self.write(f"({left} := ")
        self.visit(operand.expr, frame)
        self.write(")")
      self.write(")")
    self.write(")")

  def visit_Concat(self, node, frame):
    self.write("environment.checked_concat((")
    for arg in node.nodes:
      self.visit(arg, frame)
      self.write(", ")
    self.write("))")


class _BoundedTemplate(jinja2.Template):
  """A template whose rendered text stops at the cap (a loop's output grows piece by piece)."""

  def render(self, *args, **kwargs) -> str:
    context = self.new_context(dict(*args, **kwargs))
    pieces, size = [], 0
    turns = _turns_left.set([_MAX_TEMPLATE_TURNS, time.monotonic() + _MAX_TEMPLATE_SECONDS,
                             {}])
    try:
      for piece in self.root_render_func(context):
        size += len(piece)
        if size > _MAX_TEMPLATE_VALUE:
          _too_big("the rendered text")
        pieces.append(piece)
    except Exception:
      self.environment.handle_exception()
    finally:
      _turns_left.reset(turns)
    return "".join(pieces)


class _ChatTemplateEnvironment(jinja2.sandbox.ImmutableSandboxedEnvironment):
  """Jinja evaluates constant expressions while it compiles: `{{ 'x' * 10**9 }}` (17 bytes
  of a checkpoint's metadata) took 3 GB when the checkpoint was checked, and
  `'x'|center(300000000)` 300 MB. Operators are intercepted (Jinja folds none of those)
  and checked when they run, `~` too; filters run at render only, what center, indent,
  format, join and replace make bounded (str methods' ljust, center, zfill, expandtabs,
  replace, format too); the rendered text is bounded, and so is one render's work: loop
  turns, calls, operators, comparisons and filters, each a step and one more per 4096
  characters or items it reads (`_MAX_TEMPLATE_TURNS`: a loop nested in a loop of 100,000
  turns each, writing nothing, ran for hours)."""
  intercepted_binops = frozenset({"*", "**", "+", "%"})
  code_generator_class = _BoundedCodeGenerator
  template_class = _BoundedTemplate

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.checked_concat = _checked_concat
    self.counted_turns = _counted_turns
    self.checked_compare = _checked_compare

  def call(__self, __context, __obj, *args, **kwargs):  # pylint: disable=no-self-argument
    # (a macro calling itself twice: 2**depth calls; a str method reads its str)
    _take_turn(_size(getattr(__obj, "__self__", None)) + sum(map(_size, args)))
    if (getattr(__obj, "__name__", "") == "join" and isinstance(getattr(__obj, "__self__", None),
                                                                 _TEXT)
        and args and not isinstance(args[0], (list, tuple))):
      # A generator joined (`'x' * 10000).join(range(10**5)|map('string'))`) was sized only
      # once made (1 G characters): read here, counted as it is read.
      glue, items, size = len(__obj.__self__), [], 0
      for item in args[0]:
        size += _size(item) + glue
        if size > _MAX_TEMPLATE_VALUE:
          _too_big("a join")
        items.append(item)
      args = (items, *args[1:])
    _check_str_method(__obj, args, kwargs)
    return super().call(__context, __obj, *args, **kwargs)

  def call_binop(self, context, operator, left, right):
    _check_binop(operator, left, right)
    out = super().call_binop(context, operator, left, right)
    _take_turn(_size(left) + _size(right) + _size(out))
    return out


def compile_chat_template(text: str) -> jinja2.Template:
  """A chat template compiled as transformers renders templates: a sandbox, loop controls
  ({% break %}), `{% generation %}`, its `tojson` filter, and the globals templates call:
  raise_exception() on input they refuse, strftime_now() for today's date (Llama 3.2 and
  Mistral Small 3 templates put it in the system turn: the prompt then holds the date it
  was rendered on, as with transformers). Nothing of it runs while compiling, and what it
  makes is bounded (`_ChatTemplateEnvironment`). One that does not parse raises ValueError
  with its line."""
  env = _ChatTemplateEnvironment(
      trim_blocks=True, lstrip_blocks=True,
      extensions=["jinja2.ext.loopcontrols", _GenerationBlock])
  env.filters["tojson"] = _tojson
  env.filters = {name: _render_time_filter(name, f) for name, f in env.filters.items()}
  env.tests = {name: _counted_test(name, f) for name, f in env.tests.items()}
  env.globals["raise_exception"] = _raise_template_error
  env.globals["strftime_now"] = _strftime_now
  # (lipsum(150000, ...) wrote 66 M characters in one step; no chat template calls it)
  del env.globals["lipsum"]
  try:
    return env.from_string(text)
  except jinja2.TemplateError as e:
    line = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
    raise ValueError(f"chat template cannot be parsed{line}: {e.message or type(e).__name__}"
                     ) from None
  except (RecursionError, MemoryError) as e:  # (a template nested past the parser's stack)
    raise ValueError(f"chat template cannot be compiled: {type(e).__name__}") from None


def _text_of_parts(parts: list, message: int) -> str:
  """The text of a content given as parts; a part that is not text is named."""
  texts = []
  for j, part in enumerate(parts):
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and not isinstance(part.get("text"), str):
      raise ValueError(f"chat message {message}'s content part {j} has no 'text' string: "
                       f"{repr(part)[:60]}")
    if kind != "text":
      what = f"of type {kind!r}" if kind is not None else repr(part)[:60]
      raise ValueError(f"chat message {message}'s content part {j} is {what}: the model reads "
                       f"text parts ({{'type': 'text', 'text': ...}}) only")
    texts.append(part["text"])
  return "".join(texts)


class Tokenizer:
  """Text <-> token ids, special tokens, and the chat template."""

  def __init__(self, backend: tokenizers.Tokenizer, *, bos_id: int | None, eos_ids: Sequence[int],
               add_bos: bool = False, chat_template: str | None = None):
    self.backend = backend
    self.bos_id = bos_id
    self.eos_ids = tuple(int(i) for i in eos_ids)
    self.add_bos = add_bos
    self.has_chat_template = bool(chat_template)
    self.chat_template = chat_template or CHATML_TEMPLATE
    self._template = compile_chat_template(self.chat_template)  # at load, not the first prompt
    self._byte_values, self._byte_ids = _byte_fallback_tokens(backend)
    self._special_ids = frozenset(  # (read by decode where byte tokens are respelled)
        i for i, t in backend.get_added_tokens_decoder().items() if t.special
    ) if self._byte_values is not None else frozenset()

  @property
  def vocab_size(self) -> int:
    return self.backend.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
    """Token ids; special tokens written in `text` (e.g. <|im_start|>) are parsed as such.

    A lone surrogate (text that is not valid Unicode, e.g. from a JSON "\\ud800" escape),
    which the tokenizers library refuses, is read as U+FFFD, the replacement character."""
    try:
      ids = self.backend.encode(text, add_special_tokens=False).ids
    except (TypeError, UnicodeError):
      well_formed = LONE_SURROGATE.sub("\ufffd", text)
      if well_formed == text:
        raise
      ids = self.backend.encode(well_formed, add_special_tokens=False).ids
    if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
      ids = [self.bos_id] + ids
    return ids

  def encode_chat(self, messages: Sequence[dict], *, add_generation_prompt: bool = True,
                  **template_kwargs) -> list[int]:
    """The token ids of the rendered chat (`apply_chat_template`). A template that writes
    the BOS token itself (`{{ bos_token }}`: Llama 3, Gemma, Mistral) gets that one BOS,
    not a second one for `add_bos` (transformers tokenizes a rendered chat without adding
    special tokens; llama.cpp warns of a doubled BOS); one that writes none gets the
    checkpoint's `add_bos`."""
    ids = self.encode(self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                               **template_kwargs), add_bos=False)
    if self.add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
      ids = [self.bos_id] + ids
    return ids

  def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
    """Text of `ids`. Bytes that are no UTF-8 read as U+FFFD, one per maximal invalid
    part (as Python's errors="replace" and byte-level BPE decoders read them), also where
    a SentencePiece vocabulary spells them with byte tokens (<0xF0>): the tokenizers
    library's ByteFallback reads a whole run of byte tokens with one invalid byte as
    U+FFFD per byte, so a character already read became U+FFFD when the next byte came
    (streamed text differed from the final text; a window saw text the whole had not).
    An id past the vocabulary reads as no text, as the library reads it; a negative one
    (or one past 32 bits) is a ValueError naming it."""
    ids = list(ids)
    try:
      if self._byte_values is not None and ids:
        if skip_special:  # (first: a special token between two bytes splits no run)
          ids = [i for i in ids if i not in self._special_ids]
        ids = self._respelled(ids)
      return self.backend.decode(ids, skip_special_tokens=skip_special)
    except OverflowError:
      bad = next(i for i in ids if not 0 <= i < 2**32)  # (the library's ids are u32)
      raise ValueError(f"{bad} is not a token id (ids are 0..{self.vocab_size - 1})") from None


  def _respelled(self, ids: list[int]) -> list[int]:
    """`ids` with each run of byte tokens that is not UTF-8 spelled as the UTF-8 bytes
    of its errors="replace" reading (U+FFFD is EF BF BD): the library then reads it so."""
    arr = np.asarray(ids, np.int64)
    inside = (arr >= 0) & (arr < len(self._byte_values))
    values = np.where(inside, self._byte_values[np.where(inside, arr, 0)], -1)
    is_byte = (values >= 0).astype(np.int8)
    if not is_byte.any():
      return ids
    # (by runs, not by token: decode reads a whole sequence at every token it streams)
    edges = np.flatnonzero(np.diff(np.concatenate(([0], is_byte, [0]))))
    out, kept = [], 0
    for start, end in zip(edges[0::2].tolist(), edges[1::2].tolist()):
      run = values[start:end].astype(np.uint8).tobytes()
      try:
        run.decode("utf-8")
      except UnicodeDecodeError:
        out += ids[kept:start]
        out += [self._byte_ids[b] for b in run.decode("utf-8", "replace").encode("utf-8")]
        kept = end
    return out + ids[kept:] if out else ids

  def token_to_id(self, token: str) -> int | None:
    return self.backend.token_to_id(token)

  @functools.cached_property
  def drops_text_start(self) -> bool:
    """Whether decoding drops a space a text starts with (SentencePiece's Strip, a
    Metaspace decoder that prepends one: Llama-2 style vocabularies): a piece "▁x" reads
    "x" alone and " x" after a letter."""
    space = self.backend.token_to_id("\u2581")
    if space is None:
      space = next((i for t, i in self.backend.get_vocab().items() if t.startswith("\u2581")),
                   None)
    letter = next((i for t in ("a", "e", "x", "n", "t", "<0x61>")
                   if (i := self.backend.token_to_id(t)) is not None), None)
    if space is None or letter is None:
      return False
    alone, after = self.decode([space]), self.decode([letter, space])
    return after[len(self.decode([letter])):] != alone

  def continuation(self, ids: Iterable[int], before: int | None, *,
                   skip_special: bool = False) -> str:
    """The text `ids` add to a text whose last token is `before` (a prompt's last), as
    decoding the whole and taking its start off reads it: a decoder that drops a text's
    first space (`drops_text_start`) drops it at the text's real start only (a code
    completion's first line lost a space of its indentation; after a special token
    skipped from the text the space stays dropped, as SentencePiece prefixes one there)."""
    ids = list(ids)
    if before is None or not self.drops_text_start:
      return self.decode(ids, skip_special=skip_special)
    head = self.decode([before], skip_special=skip_special)
    whole = self.decode([before] + ids, skip_special=skip_special)
    # (not a prefix: a character the two share, read as U+FFFD in the head alone)
    return whole[len(head):] if whole.startswith(head) else self.decode(ids,
                                                                       skip_special=skip_special)

  def chat_unavailable(self) -> str | None:
    """Why chat messages cannot be rendered, or None: a checkpoint without a chat template
    whose vocabulary lacks the ChatML fallback's tokens (a base model such as Gemma 3 270M:
    ChatML would be plain text to it)."""
    if not self.has_chat_template and self.token_to_id("<|im_start|>") is None:
      return ("this checkpoint has no chat template, and the ChatML fallback's <|im_start|> "
              "is not in its vocabulary")
    return None

  def apply_chat_template(self, messages: Sequence[dict], *, add_generation_prompt: bool = True,
                          **template_kwargs) -> str:
    """Renders chat messages ([{"role", "content"}]) with the checkpoint's template;
    `template_kwargs` are more variables for it, as transformers passes them
    (`enable_thinking=False` for Qwen3's: an empty thinking span, so the model answers
    without thinking).

    A content given as a list of parts (the OpenAI style, [{"type": "text", "text": ...}])
    is its text parts joined: the models here read text only, and most templates
    concatenate the content (a list failed inside jinja with a TypeError)."""
    messages = list(messages)
    for i, m in enumerate(messages):
      if not isinstance(m, dict) or "role" not in m or "content" not in m:
        raise ValueError(f"chat message {i} must be a dict with 'role' and 'content', got {m!r}")
      # (a template concatenates them: an int failed inside jinja with a TypeError)
      if not isinstance(m["role"], str):
        raise ValueError(f"chat message {i}'s role must be a str, got {m['role']!r}")
      if isinstance(m["content"], list):
        messages[i] = {**m, "content": _text_of_parts(m["content"], i)}
      elif not isinstance(m["content"], str):
        raise ValueError(f"chat message {i}'s content must be a str, got {m['content']!r}")
    why = self.chat_unavailable()
    if why is not None:
      raise ValueError(f"{why}: give the prompt as plain text")
    taken = sorted(set(template_kwargs) & {"bos_token", "eos_token"})
    if taken:
      raise ValueError(f"chat template variable(s) {taken} are set by apply_chat_template itself")
    bos = self.backend.id_to_token(self.bos_id) if self.bos_id is not None else ""
    eos = self.backend.id_to_token(self.eos_ids[0]) if self.eos_ids else ""
    try:
      # (tools and documents: None, as transformers passes them when there are none)
      return self._template.render(**{"tools": None, "documents": None, **template_kwargs},
                                   messages=list(messages),
                                   add_generation_prompt=add_generation_prompt,
                                   bos_token=bos, eos_token=eos)
    except _TemplateRefusal:
      raise
    except jinja2.TemplateError as e:  # e.g. a variable or filter this renderer does not provide
      raise ValueError(f"chat template failed to render these messages: {type(e).__name__}: "
                       f"{e.message or e}") from None
    except (TypeError, ValueError, ArithmeticError, RecursionError, MemoryError) as e:
      # a filter or global given what it cannot take (tojson of an undefined, 1 // 0, ...)
      raise ValueError(f"chat template failed to render these messages: {type(e).__name__}: "
                       f"{e}") from None

  def save(self, directory: str | os.PathLike) -> None:
    """Writes HF-style tokenizer.json + tokenizer_config.json."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    self.backend.save(str(directory / "tokenizer.json"))
    cfg = {
        "bos_token": self.backend.id_to_token(self.bos_id) if self.bos_id is not None else None,
        "eos_token": self.backend.id_to_token(self.eos_ids[0]) if self.eos_ids else None,
        "o1jax_eos_token_ids": list(self.eos_ids),
        "add_bos_token": self.add_bos,
        "chat_template": self.chat_template if self.has_chat_template else None,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))

  @classmethod
  def load(cls, directory: str | os.PathLike) -> "Tokenizer":
    """Reads tokenizer.json (+ tokenizer_config.json, + chat_template.jinja) from an
    HF-style directory, as transformers reads them: the chat template from
    chat_template.jinja where there is one (transformers >= 4.47 saves it there, not in
    tokenizer_config.json), and without an `add_bos_token` key a BOS where tokenizer.json's
    post-processor adds one (Llama 3's TemplateProcessing)."""
    directory = pathlib.Path(directory)
    tok_file = directory / "tokenizer.json"
    if not tok_file.is_file():
      raise CheckpointError(f"{directory}: tokenizer.json is missing")
    try:
      backend = tokenizers.Tokenizer.from_file(str(tok_file))
    except Exception as e:
      raise CheckpointError(f"{tok_file}: cannot be parsed ({e})") from e
    cfg = {}
    cfg_file = directory / "tokenizer_config.json"
    if os.path.lexists(cfg_file):  # (one that is no file is named, not passed over)
      cfg = read_json_object(cfg_file)

    def bad(key, expected):
      return CheckpointError(f"{cfg_file}: {key}={cfg[key]!r} is not {expected}")

    def tok_id(key):
      entry = cfg.get(key)
      if isinstance(entry, dict):  # an AddedToken: {"content": ...}
        entry = entry.get("content")
      if entry is not None and not isinstance(entry, str):
        raise bad(key, "a token (a string, or an object with a string content)")
      if entry is None:
        return None
      found = backend.token_to_id(entry)
      if found is None:  # (was dropped: prompts went without their BOS, no eos stopped)
        raise CheckpointError(f"{cfg_file}: {key}={entry!r} is not a token of "
                              f"{directory / 'tokenizer.json'}")
      return found

    eos_ids = cfg.get("o1jax_eos_token_ids")
    n = backend.get_vocab_size(with_added_tokens=True)
    if eos_ids is None:
      eos = tok_id("eos_token")
      eos_ids = [] if eos is None else [eos]
    elif not isinstance(eos_ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n for i in eos_ids):
      raise bad("o1jax_eos_token_ids", f"a list of token ids (0..{n - 1})")
    template = cfg.get("chat_template")
    if isinstance(template, list):  # HF allows a list of named templates
      if not all(isinstance(t, dict) and isinstance(t.get("template"), str) for t in template):
        raise bad("chat_template", "a string or a list of {name, template} objects")
      named = {t.get("name"): t["template"] for t in template}
      if "default" not in named:  # (as transformers refuses it: ChatML was used silently)
        raise CheckpointError(f"{cfg_file}: chat_template lists templates named "
                              f"{sorted(map(str, named))} and none 'default': which one a chat "
                              f"uses is not said")
      template = named["default"]
    if template is not None and not isinstance(template, str):
      raise bad("chat_template", "a string or a list of {name, template} objects")
    template_file = cfg_file  # where the template came from, for its errors
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
      template_file = jinja_file
      try:
        template = jinja_file.read_text(encoding="utf-8")
      except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{jinja_file}: cannot be read ({e})") from None
    bos_id = tok_id("bos_token")  # outside the try: its error names its key already
    if "add_bos_token" in cfg:
      add_bos = bool(cfg["add_bos_token"])
    else:  # what transformers' tokenizer(text) does: the post-processor's special tokens
      add_bos = bos_id is not None and backend.encode("", add_special_tokens=True).ids[:1] == [bos_id]
    try:
      return cls(backend, bos_id=bos_id, eos_ids=eos_ids, add_bos=add_bos,
                 chat_template=template)
    except ValueError as e:  # the chat template does not parse
      raise CheckpointError(f"{template_file}: {e}") from None

  @classmethod
  def from_gguf_metadata(cls, meta: dict, path="GGUF") -> "Tokenizer":
    """Builds the tokenizer from `tokenizer.ggml.*` metadata: gpt2-style byte-level BPE,
    or llama.cpp's "llama" SentencePiece BPE (`_spm_backend`)."""
    model = meta.get("tokenizer.ggml.model")
    if model == "llama":
      backend = _spm_backend(meta, path)
    elif model == "gpt2":
      tokens = list(meta["tokenizer.ggml.tokens"])
      merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
      bad = next((i for i, m in enumerate(merges) if len(m) != 2), None)
      if bad is not None:  # else the tokenizers library's multi-line TypeError
        raise CheckpointError(f"{path}: tokenizer.ggml.merges[{bad}] {merges[bad][0]!r} is not two "
                              f"tokens separated by a space")
      types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
      vocab = {t: i for i, t in enumerate(tokens)}
      _warn_missing_byte_symbols(vocab, path)
      for i, (a, b) in enumerate(merges):  # (else the library's bare Exception, no file named)
        unknown = next((t for t in (a, b, a + b) if t not in vocab), None)
        if unknown is not None:
          raise CheckpointError(f"{path}: tokenizer.ggml.merges[{i}] {a + ' ' + b!r} needs the "
                                f"token {unknown!r}, which tokenizer.ggml.tokens does not hold")
      backend = tokenizers.Tokenizer(models.BPE(
          vocab=vocab, merges=merges, fuse_unk=False,
          ignore_merges=meta.get("tokenizer.ggml.pre") in _IGNORE_MERGES_PRE))
      backend.pre_tokenizer = _byte_level_pre(meta.get("tokenizer.ggml.pre"), path)
      backend.decoder = decoders.ByteLevel()
      _add_tokens(backend, tokens, types)
    else:
      raise CheckpointError(f"{path}: tokenizer model {model!r} is not supported "
                            f"(supported: gpt2 BPE, llama SentencePiece)")
    eos_ids = gguf_end_of_generation_ids(meta)
    bos = meta.get("tokenizer.ggml.bos_token_id")
    try:
      return cls(backend, bos_id=None if bos is None else int(bos), eos_ids=eos_ids,
                 add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", _adds_bos_by_default(meta))),
                 chat_template=meta.get("tokenizer.chat_template"))
    except ValueError as e:  # the chat template does not parse
      raise CheckpointError(f"{path}: {e}") from None


def _byte_symbols() -> dict[str, int]:
  """GPT-2's byte-level alphabet: the character that stands for each byte in a vocabulary
  (printable Latin-1 bytes as themselves, the other 68 as U+0100 on)."""
  kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
  others = [b for b in range(256) if b not in kept]
  return {**{chr(b): b for b in kept}, **{chr(256 + i): b for i, b in enumerate(others)}}


# Bytes of ordinary text: tab, newlines, printable ASCII, and UTF-8 up to plane 3 (real
# vocabularies leave out control bytes, 0xC0/0xC1, 0xF1 on: SmolLM2's lacks 21 such).
_TEXT_BYTES = frozenset([0x09, 0x0A, 0x0D, *range(0x20, 0x7F), *range(0x80, 0xC0),
                         *range(0xC2, 0xF1)])


def _warn_missing_byte_symbols(vocab, path) -> None:
  """A byte-level vocabulary without a token for a byte of ordinary text drops that byte
  from every text it encodes, without a word (llama.cpp does the same): said at load."""
  missing = sorted(b for c, b in _byte_symbols().items() if c not in vocab and b in _TEXT_BYTES)
  if missing:
    shown = ", ".join(f"0x{b:02x}" + (f" {chr(b)!r}" if 0x20 < b < 0x7F else "") for b in missing[:8])
    log.warning("%s: tokenizer.ggml.tokens has no token for %d byte%s of ordinary text (%s%s): "
                "text holding them is encoded without them", path, len(missing),
                "s" * (len(missing) != 1), shown, ", ..." if len(missing) > 8 else "")


def _spm_merges(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int]):
  """BPE merges that reproduce llama.cpp's SentencePiece tokenizer (llm_tokenizer_spm).

  It merges, again and again, the adjacent pair of symbols whose concatenation is the
  vocabulary piece with the highest score. As merges: every split (left, right) of a
  normal piece into two pieces, ranked by the piece's score, highest first. Ties are
  pieces of equal score, which Gemma 3's vocabulary does not have (its 255,474 normal
  pieces have distinct scores)."""
  vocab = {t: i for i, t in enumerate(tokens)}
  merges = []
  for i, piece in enumerate(tokens):
    if int(types[i]) != 1 or len(piece) < 2:
      continue
    for k in range(1, len(piece)):
      left, right = piece[:k], piece[k:]
      if left in vocab and right in vocab:
        merges.append((-float(scores[i]), vocab[left], vocab[right], left, right))
  merges.sort()
  return [(left, right) for *_, left, right in merges]


def _spm_backend(meta: dict, path) -> tokenizers.Tokenizer:
  """llama.cpp's "llama" (SentencePiece BPE) tokenizer as a `tokenizers` BPE.

  1. spaces become U+2581 (▁), with one prepended when `add_space_prefix` (llama.cpp's
     default; Gemma 3 turns it off): the normalizer runs on each piece of text between
     special tokens, as llama.cpp prefixes each fragment after a special token;
  2. score-ranked merges (`_spm_merges`) over the characters;
  3. characters with no piece become their UTF-8 bytes' <0xXX> tokens (byte fallback).
  Control and unknown tokens (types 3, 2) are special; user-defined ones (type 4: Gemma's runs of
  newlines, tabs, spaces, HTML tags) are matched in raw text but decoded as text."""
  tokens = list(meta["tokenizer.ggml.tokens"])
  scores = meta.get("tokenizer.ggml.scores")
  if scores is None:
    raise CheckpointError(f"{path}: a 'llama' tokenizer needs tokenizer.ggml.scores")
  types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
  unk = meta.get("tokenizer.ggml.unknown_token_id")
  vocab = {t: i for i, t in reversed(list(enumerate(tokens)))}  # first id of a duplicate
  bpe = models.BPE(vocab=vocab, merges=_spm_merges(tokens, scores, types), byte_fallback=True,
                   unk_token=None if unk is None else tokens[int(unk)], fuse_unk=True)
  backend = tokenizers.Tokenizer(bpe)
  steps = [normalizers.Replace(" ", "\u2581")]
  decode = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
  if meta.get("tokenizer.ggml.add_space_prefix", True):
    steps.insert(0, normalizers.Prepend(" "))
    # The prefix's space leaves a text's start when decoded, as in transformers (its Llama
    # converter's Strip) and llama.cpp's detokenizer: every text read " " + text.
    decode.append(decoders.Strip(" ", 1, 0))
  backend.normalizer = normalizers.Sequence(steps)
  backend.decoder = decoders.Sequence(decode)
  _add_tokens(backend, tokens, types)
  return backend


def _byte_fallback_tokens(backend) -> tuple:
  """(byte value of each token id or -1, {byte value: its token id}) for a tokenizer whose
  decoder reads byte tokens (<0xF0>) with ByteFallback and whose vocabulary has those of
  U+FFFD's UTF-8 (EF BF BD: a respelled run's valid characters are bytes the run had);
  (None, None) otherwise (byte-level BPE, a tokenizer without byte tokens)."""
  decoder = backend.decoder
  if decoder is None or b'"ByteFallback"' not in decoder.__getstate__():
    return None, None
  ids = {b: i for b in range(256) if (i := backend.token_to_id(f"<0x{b:02X}>")) is not None}
  if not all(b in ids for b in "\ufffd".encode("utf-8")):
    return None, None
  values = np.full(max(ids.values()) + 1, -1, np.int16)
  values[list(ids.values())] = list(ids)
  return values, ids


def _add_tokens(backend, tokens, types) -> None:
  """A GGUF vocabulary's control and unknown (<unk>) tokens as special tokens, its
  user-defined ones as added tokens that decode as text (all matched whole in raw text, as
  llama.cpp's special-token cache holds all three kinds). An end-of-generation text is a
  control token whatever its type says (as llama.cpp overrides it)."""
  control = lambda i, kind: (int(kind) in (_CONTROL, _UNKNOWN)
                             or tokens[i] in END_OF_GENERATION_TEXTS)
  backend.add_special_tokens([tokenizers.AddedToken(tokens[i], special=True, normalized=False)
                              for i, kind in enumerate(types) if control(i, kind)])
  backend.add_tokens([tokenizers.AddedToken(tokens[i], special=False, normalized=False)
                      for i, kind in enumerate(types)
                      if int(kind) == _USER_DEFINED and not control(i, kind)])


class _TemplateRefusal(ValueError):
  """What a template's raise_exception() raises: its own message, passed on as is."""


def _raise_template_error(message):
  raise _TemplateRefusal(f"chat template: {message}")


def continuation_text(tokenizer, ids: Iterable[int], before: int | None, *,
                      skip_special: bool = False) -> str:
  """`Tokenizer.continuation` for any tokenizer (one with only `decode` decodes `ids`)."""
  if hasattr(tokenizer, "continuation"):
    return tokenizer.continuation(ids, before, skip_special=skip_special)
  return tokenizer.decode(list(ids), skip_special=skip_special)


def token_texts(tokenizer, *, skip_special: bool = False) -> list[str]:
  """Every token's text as it reads inside a text, between two other tokens.

  A token decoded alone can read differently: decoders that drop the space a text starts
  with (SentencePiece's Strip, Metaspace with prepend_scheme "first", used by Llama-2
  style tokenizer.json files) drop it from every token decoded alone, so "5" "▁5" would
  read "55" where the text says "5 5"; word-suffix decoders (BPEDecoder "</w>") drop the
  space a text ends with. Each token is decoded between two copies of an anchor (the first
  token whose text alone is one ASCII letter or digit and reads twice as twice that
  letter: it adds no space of its own) and the anchors' text is taken off; a token whose
  text does not sit between them (bytes of an unfinished character) keeps its text alone.
  `tokenizer`: anything with `vocab_size` and `decode(ids, skip_special=...)`."""
  n = tokenizer.vocab_size
  decode = lambda ids: tokenizer.decode(ids, skip_special=skip_special)
  alone = [decode([i]) for i in range(n)]
  anchor = next((i for i, t in enumerate(alone) if len(t) == 1 and t.isascii() and t.isalnum()
                 and decode([i, i]) == t + t), None)
  if anchor is None:
    return alone
  a = alone[anchor]
  out = []
  for i, text in enumerate(alone):
    between = decode([anchor, i, anchor])
    ok = len(between) >= 2 and between.startswith(a) and between.endswith(a)
    out.append(between[1:-1] if ok else text)
  return out
