"""The answer key that votes: `extract_number` against an independent reference, and
the loop's automaton (host tables, jitted `_read_key`, the whole loop) against it.

The rule (answers.py): the first number after the last prefix (the text after it read
on its own), else the last number; a number is an optional "-" / U+2212, an optional
"$", then digits and commas from a digit with an optional ".digits", or a bare
".digits" unless that "." follows a digit or a "."; its key is its value as a plain
decimal (no leading zeros but one before ".", no trailing fraction zeros, no "-0").
The reference below reads the value with `decimal.Decimal` and writes it with
Decimal's own formatting."""

import decimal
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from o1jax.controller import LoopSettings, ReasoningLoop, ReasoningRequest, answers
from o1jax.controller import state as S
from o1jax.controller.answers import extract_number, normalize_number
from o1jax.controller.testing import MockDecodeModel
from tests.o1jax.controller.conftest import MockWorld

# -- the reference --------------------------------------------------------------------

_REF = re.compile(r"""
    (?P<minus>[-\u2212])? \$?
    (?: (?P<whole>[0-9][0-9,]*) (?: \. (?P<frac>[0-9]+) )?   # 1,200 / 1,200.5
      | (?<![0-9.]) \. (?P<bare>[0-9]+) )                     # .5 (not after a digit or ".")
    """, re.VERBOSE)


def _value(m: re.Match) -> decimal.Decimal:
  whole = (m["whole"] or "0").replace(",", "")
  frac = m["frac"] or m["bare"] or "0"
  v = decimal.Decimal(f"{whole}.{frac}")
  return v.copy_negate() if m["minus"] else v  # (unary minus would round to 28 digits)


def _plain(v: decimal.Decimal) -> str:
  """A value as a plain decimal: Decimal's fixed-point text of its shortest form."""
  if v == 0:
    return "0"
  ctx = decimal.Context(prec=len(v.as_tuple().digits) + 1)
  return format(v.normalize(ctx), "f")


def reference_value(text: str, prefix: str):
  """(value, found after the prefix?) or (None, False)."""
  cut = text.rfind(prefix)
  if cut >= 0:
    m = _REF.search(text[cut + len(prefix):])
    if m:
      return _value(m), True
  last = None
  for m in _REF.finditer(text):
    last = m
  return (None, False) if last is None else (_value(last), False)


def reference(text: str, prefix: str = "The answer is"):
  v, _ = reference_value(text, prefix)
  return None if v is None else _plain(v)


CANONICAL = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]*[1-9])?")


# -- the host key -----------------------------------------------------------------------

CASES = [  # (text after "The answer is" unless it holds one, key)
    (" $1,200.00.", "1200"), (" 1200", "1200"), (" 1200.0", "1200"), (" 01200", "1200"),
    (" .5", "0.5"), (" 0.5", "0.5"), (" 0.50", "0.5"), (" 00.500", "0.5"),
    (" -0", "0"), (" 0", "0"), (" -0.00", "0"), (" \u22120.0", "0"), (" -.0", "0"), (" 000", "0"),
    (" \u22125", "-5"), (" -5", "-5"), (" 5", "5"), (" $-5", "-5"), (" -$5", "-5"),
    (" \u2212$5", "-5"), (" $\u22125", "-5"), (" -$$5", "5"), (" --5", "-5"),
    (" 007", "7"), (" -007", "-7"), (" -0.05", "-0.05"), (" -.5", "-0.5"), (" -$.5", "-0.5"),
    (" 1,2,3", "123"), (" 1.2.3", "1.2"), (" 5.", "5"), (" ..5", "5"), (" ...5", "5"),
    (" 5..5", "5"), (" step.5", "0.5"), ("x.5", "0.5"), (" 5,", "5"), (" 5,.5", "5.5"),
    (" 1e5", "1"), (" 10", "10"), (" 100.001", "100.001"), (" -10.10", "-10.1"),
    (".5", "0.5"),  # read on its own: the prefix's last letter is not before the "."
    # The prefix several times: the last one counts; none after it: the last number.
    (" 3. The answer is 4", "4"), (" 3. The answer is", "3"), (" 3. The answer is x", "3"),
    (" no digits", None), ("", None),
]


@pytest.mark.parametrize("after, key", CASES)
def test_extract_number_by_hand(after, key):
  text = "Work: 2 + 2 = 9. The answer is" + after
  want = key if key is not None or "The answer is" in after else "9"
  assert extract_number(text) == want == reference(text)


def test_without_a_prefix_the_last_number_counts():
  assert extract_number("a 1.2.3") == reference("a 1.2.3") == "3"
  assert extract_number("cost .50 then 0007 apples") == "7"
  assert extract_number("x\u22120.0") == "0" and extract_number("5 and \u22125") == "-5"
  assert extract_number("The answer is 5", "") == "5"  # no prefix: the last number
  assert extract_number("nothing") is None


def test_huge_numbers_are_exact():
  big = "9" * 5000
  assert extract_number(f"The answer is -00{big}.{big}000") == f"-{big}.{big}"
  assert extract_number(f"The answer is 0.{'0' * 3000}1") == "0." + "0" * 3000 + "1"
  assert extract_number(f"The answer is {'0' * 3000}") == "0"
  assert reference(f"The answer is -00{big}.{big}000") == f"-{big}.{big}"


def test_normalize_number():
  for raw, key in [("-0", "0"), ("\u22120.00", "0"), (".5", "0.5"), ("0.50", "0.5"),
                   ("$1,200.00", "1200"), ("-$007.10", "-7.1"), ("1.", "1"), ("", "0")]:
    assert normalize_number(raw) == key, raw


ALPHABET = list("0123456789" * 3) + list(".....,,,---$$ ") + ["\u2212", "\u2212", " ", "a", "x"]
PREFIX = "ANS"


def random_texts(seed: int, n: int):
  """Random strings over ALPHABET, some holding the prefix (a few times)."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    parts = [ALPHABET[i] for i in rng.integers(0, len(ALPHABET), rng.integers(0, 16))]
    for _ in range(rng.choice(3, p=[0.3, 0.5, 0.2])):
      parts.insert(int(rng.integers(0, len(parts) + 1)), PREFIX)
    out.append("".join(parts))
  return out


TEXTS = random_texts(0, 4000)


def test_extract_number_equals_the_reference_on_random_strings():
  changed = 0
  for text in TEXTS:
    got, want = extract_number(text, PREFIX), reference(text, PREFIX)
    assert got == want, text
    if got is not None:
      assert CANONICAL.fullmatch(got) and got != "-0", (text, got)
      assert decimal.Decimal(got) == reference_value(text, PREFIX)[0], text
      changed += 1
  assert changed > 3000  # most strings hold a number


# -- the automaton on the host ------------------------------------------------------------

def _after_prefix(text: str) -> str:
  at = text.rfind(PREFIX)
  return text[at + len(PREFIX):] if at >= 0 else text


def test_automaton_gives_the_host_key_on_random_strings():
  for text in TEXTS + [after for after, _ in CASES]:
    body = _after_prefix(text)
    state, codes = answers.key_of_classes(answers.char_classes(body))
    _, after = reference_value(PREFIX + body, PREFIX)
    # Known exactly when there is a number after the prefix (else the host falls back).
    assert (state >= S.KEY_INT) == after, body
    if after:
      assert answers.key_text(codes) == extract_number(PREFIX + body, PREFIX), body
      assert answers.text_key(answers.key_text(codes)) == codes, body


def test_key_codes():
  assert answers.text_key("-1.5") == [answers.MINUS, 1, answers.DOT, 5]
  assert answers.text_key("0") == [] and answers.key_text([]) == "0"
  assert answers.text_key("0.5") == [answers.DOT, 5] == answers.text_key("0.50")
  assert answers.text_key("-0.5") == [answers.MINUS, answers.DOT, 5] == answers.text_key("\u2212.5")
  assert answers.text_key("-0") == [] and answers.text_key("007") == [7]
  assert answers.key_text([answers.MINUS, answers.DOT, 0, 5]) == "-0.05"
  for bad in ("1e5", "", "x", "5 ", "."):
    assert answers.text_key(bad) is None, bad
  assert answers.char_classes("x\u0663") is None  # a non-ASCII digit: not readable
  assert answers.char_classes("\ufffd") is None  # a token holding part of a character
  assert answers.char_classes("\u2212") == [answers.MINUS]
  # Every transition stays in the table; a number's states are never left for a search.
  assert answers.KEY_NEXT.min() >= 0 and answers.KEY_NEXT.max() < answers.N_STATES
  number = answers.KEY_NEXT[S.KEY_INT:]
  assert number.min() >= S.KEY_INT


# -- the automaton on device --------------------------------------------------------------

def _split(text: str, rng) -> list[str]:
  out, i = [], 0
  while i < len(text):
    if text.startswith(PREFIX, i):
      out.append(PREFIX)
      i += len(PREFIX)
      continue
    n = int(rng.integers(1, 4))
    j = text.find(PREFIX, i)
    n = min(n, (j if j >= 0 else len(text)) - i)
    out.append(text[i:i + n])
    i += n
  return out


def test_jitted_read_key_gives_the_host_key():
  """`ReasoningLoop._read_key` over random texts cut into tokens of 1-3 characters;
  the prefix is a token that restarts the key (it is in the answer's text too)."""
  rng = np.random.default_rng(1)
  texts = [PREFIX + t for t in TEXTS[:256]]
  tokens = [_split(t, rng) for t in texts]
  vocab = sorted({tok for toks in tokens for tok in toks})
  ids = {tok: i for i, tok in enumerate(vocab)}
  c, b, a = 3, len(texts), 48
  classes = np.full((len(vocab), c), -1, np.int32)
  for tok, i in ids.items():
    seq = answers.char_classes(tok)
    classes[i, :len(seq)] = seq
  steps = max(map(len, tokens))
  toks = np.zeros((steps, b), np.int32)
  feed = np.zeros((steps, b), bool)
  for r, row in enumerate(tokens):
    toks[:len(row), r] = [ids[t] for t in row]
    feed[:len(row), r] = True
  restart = feed & (toks == ids[PREFIX])
  loop = ReasoningLoop(MockDecodeModel(np.zeros((4, 4))), vote=True)
  k = types.SimpleNamespace(key_classes=jnp.asarray(classes),
                            key_overflow=jnp.zeros(len(vocab), bool))
  names = ("key_state", "key", "key_len", "key_commit", "key_unknown")

  @jax.jit
  def run(toks, feed, restart):
    def step(s, x):
      out = loop._read_key(k, types.SimpleNamespace(**dict(zip(names, s))), *x)
      return tuple(out), None
    s0 = (jnp.zeros(b, jnp.int32), jnp.zeros((b, a), jnp.int32), jnp.zeros(b, jnp.int32),
          jnp.zeros(b, jnp.int32), jnp.zeros(b, bool))
    return jax.lax.scan(step, s0, (toks, feed, restart))[0]

  state, key, _, commit, unknown = jax.device_get(run(toks, feed, restart))
  known = 0
  for r, text in enumerate(texts):
    _, after = reference_value(text, PREFIX)
    assert not unknown[r]
    assert (state[r] >= S.KEY_INT) == after, text
    if after:
      assert answers.key_text(key[r, :commit[r]]) == extract_number(text, PREFIX), text
      known += 1
  assert known > 150


# -- the whole loop -----------------------------------------------------------------------

# After the prefix every token is as likely as any other (end of sequence included), so
# the answers are random strings of these pieces, the prefix now and then among them.
PIECES = [" ", "0", "5", "00", ".", ",", "-", "\u2212", "$", "x", ".5", "-0", "7", ".0", "1,"]
WORLD_VOCAB = ["", "<s>", "</s>", "Q", "The answer is", " Wait", "\n\n"] + PIECES


def test_the_loop_key_is_the_extracted_answer():
  world = MockWorld([("Q", "The answer is", 30.0)], vocab=WORLD_VOCAB)
  ctl = world.controller()
  st = LoopSettings(temperature=1.0, answer_vote=True, max_thinking_tokens=4,
                    max_answer_tokens=8)
  traces = ctl.generate([ReasoningRequest(prompt="Q", request_id=0, seed=3)], st, 64).traces[0]
  keys = []
  for t in traces:
    _, after = reference_value(t.text, "The answer is")
    assert t.answer == reference(t.text), t.text
    assert t.answer_key == (t.answer if after else None), t.text
    keys.append(t.answer_key)
  # The draws reach the forms this file is about (else the test tests little).
  assert sum(k is not None for k in keys) >= 40
  assert "0" in keys and any(k and k.startswith("-") for k in keys)
  assert any(k and k.startswith("0.") for k in keys)


def test_the_loop_key_reads_spaces_a_token_loses_when_decoded_alone():
  """Llama-2 style decoders drop a token's leading space when it is decoded alone:
  "5" then "▁6" reads "5 6" (key 5), not "56"."""
  from tests.o1jax.checkpoint.test_token_texts import PIECES, spm_tokenizer
  from o1jax.controller import Controller

  chain = ["\u2581Q", "\u2581The", "\u2581answer", "\u2581is", "\u25815", "\u25816", "</s>"]
  table = np.zeros((len(PIECES), len(PIECES)), np.float32)
  for a, b in zip(chain, chain[1:]):
    table[PIECES.index(a), PIECES.index(b)] = 30.0
  for decoder in ("strip", "metaspace"):
    ctl = Controller(MockDecodeModel(table), spm_tokenizer(decoder))
    st = LoopSettings(temperature=0.0, answer_vote=True, max_thinking_tokens=4,
                      max_answer_tokens=8)
    trace = ctl.generate([ReasoningRequest(prompt="Q", request_id=0)], st, 1).traces[0][0]
    assert trace.text.endswith("The answer is 5 6"), trace.text
    assert trace.answer == "5" and trace.answer_key == "5", decoder
