"""Common record types shared by every dataset loader and task.

Loaders never raise on a bad input line: they yield a `DeadLetter` instead, so a
Beam pipeline can route it to a side output with the file and line number while
the good `Example`s carry on.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import unicodedata
from typing import Any, Optional, Union


@dataclasses.dataclass(frozen=True)
class Example:
  """One evaluation problem, whatever dataset it came from.

  Attributes:
    id: stable identifier, e.g. ``gsm8k/test/17`` or ``HumanEval/0``; reruns
      over the same input give the same ids so results can be joined.
    dataset: dataset name (``gsm8k``, ``gsm_synthetic``, ``humaneval``, ...).
    question: the problem text shown to the model; for code tasks this is the
      code prompt (also reachable as `prompt`).
    reference: normalized gold answer (a number string for GSM-style data, the
      canonical solution for HumanEval).
    metadata: dataset-specific extras (level, entry_point, test, solution, ...).
  """
  id: str
  dataset: str
  question: str
  reference: str
  metadata: dict[str, Any] = dataclasses.field(default_factory=dict)

  @property
  def prompt(self) -> str:
    """Alias of `question`; reads better for code-completion tasks."""
    return self.question

  def to_dict(self) -> dict[str, Any]:
    """JSON-ready dict, for text sinks and for crossing process boundaries."""
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "Example":
    return cls(id=d["id"], dataset=d["dataset"], question=d["question"],
               reference=d["reference"], metadata=dict(d.get("metadata") or {}))


@dataclasses.dataclass(frozen=True)
class DeadLetter:
  """An input line that could not become an `Example`, and why.

  Attributes:
    source: the file path / URL the line came from.
    line_number: 1-based line number in `source` (0 when not line-based).
    reason: short human-readable cause, e.g. ``invalid JSON: ...``.
    raw: the offending line as read (decoded leniently), for inspection.
  """
  source: str
  line_number: int
  reason: str
  raw: str

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Duplicate:
  """An input line holding the same JSON object as an earlier line: skipped, so each
  example runs once (the first line keeps it, and its line-based id).

  Attributes:
    source: the file path / URL.
    line_number: 1-based line number of this (skipped) copy.
    first_line_number: the line that was kept.
    first_source: the file of that line, when a pattern names several ("": this one).
  """
  source: str
  line_number: int
  first_line_number: int
  first_source: str = ""


LoadResult = Union[Example, DeadLetter, Duplicate]


class RecordError(ValueError):
  """Raised by per-record parsers; loaders turn it into a `DeadLetter`."""


class DatasetError(ValueError):
  """The dataset as a whole cannot be used (missing, unreadable, no examples): the run
  stops before any work, with this one-line message."""


class DatasetChangedError(DatasetError):
  """A dataset file changed while a job read it: the job ran (its log is kept); rerun."""


def text_bytes(text: str) -> bytes:
  """UTF-8 for hashing that never raises: a lone surrogate (which UTF-8 cannot encode)
  gets its own 3 bytes, which no valid text has, so distinct strings stay distinct."""
  return text.encode("utf-8", "surrogatepass")


def examples_sha256(examples) -> str:
  """What the examples ask and expect (question and reference, in order; `Example`s or
  their dicts), hashed: one dataset wherever its file lies and whatever it is named (a Hub
  dataset's files are all `test-00000-of-00001.parquet`)."""
  h = hashlib.sha256()
  for ex in examples:
    ex = ex.to_dict() if isinstance(ex, Example) else ex
    for text in (ex["question"], ex["reference"]):
      data = text_bytes(str(text))
      h.update(len(data).to_bytes(8, "little") + data)  # (lengths: no two splits alike)
  return h.hexdigest()


def lone_surrogate(value: Any, field: str = "") -> Optional[tuple[str, str]]:
  """(field path, character) of the first lone surrogate in a decoded JSON value, else None.

  A JSON escape such as "\\ud800" decodes to a lone surrogate: valid JSON, but not text
  (it cannot be encoded, hashed as UTF-8, tokenized or written back); keys are checked too.
  """
  if isinstance(value, str):
    try:
      value.encode("utf-8")
    except UnicodeEncodeError as e:
      return field, value[e.start]
    return None
  if isinstance(value, dict):
    for k, v in value.items():
      sub = f"{field}.{k}" if field else str(k)
      found = lone_surrogate(k, field) or lone_surrogate(v, sub)  # a bad key: the object's path
      if found:
        return found
  elif isinstance(value, list):
    for i, v in enumerate(value):
      found = lone_surrogate(v, f"{field}[{i}]")
      if found:
        return found
  return None


def content_id(dataset: str, *parts: str, length: int = 16) -> str:
  """Content-hash id for records without a natural key (stable across files)."""
  h = hashlib.sha256()
  for p in parts:
    h.update(text_bytes(p))
    h.update(b"\x00")
  return f"{dataset}/{h.hexdigest()[:length]}"


# The lm-evaluation-harness GSM8K metric strips these (in this order) from both
# prediction and reference before an exact string comparison.
_IGNORE_PATTERNS = (re.compile(","), re.compile(r"\$"),
                    re.compile(r"(?s).*#### "), re.compile(r"\.$"))
# ASCII digits only: answers are read from the model's text as such (lm-evaluation-harness'
# patterns too), so a reference in other digits ("５", "٣") could never be matched.
_NUMBER_RE = re.compile(r"-?([0-9]+(\.[0-9]*)?|\.[0-9]+)")


def normalize_answer(text: str) -> str:
  """Normalize an answer string the way lm-evaluation-harness does for GSM8K.

  Removes commas and ``$``, anything up to a ``#### `` marker and one trailing
  period, so ``"$1,234."`` and ``"#### 1234"`` both become ``"1234"``. Kept as a
  pure string transform (no float parsing) so scores match the harness.
  """
  s = text.strip()
  for pat in _IGNORE_PATTERNS:
    s = pat.sub("", s)
  return s.strip()


def text_answer_key(text: Optional[str]) -> Optional[str]:
  """What a free-text answer (custom task, answer_format=text) is matched and voted by:
  the GSM8K normalization (commas, ``$``, one trailing period), in Unicode's composed form
  (NFC: "café" typed two ways is one answer), case-folded (str.casefold: "STRASSE" is
  "straße", as lower() did not); None when nothing is left, so an empty reply is never an
  answer."""
  key = unicodedata.normalize("NFC", normalize_answer(text)).casefold() if text is not None else ""
  return key or None


def is_number(text: str) -> bool:
  """True for a plain decimal number such as ``-12``, ``3.5`` or ``7.``."""
  return _NUMBER_RE.fullmatch(text) is not None


_FINAL_ANSWER_RE = re.compile(r"####\s*(.*?)\s*$", re.DOTALL)


def split_gsm8k_answer(answer: str) -> tuple[str, str]:
  """Split a GSM8K answer into (worked solution, normalized final number).

  Raises `RecordError` when there is no ``#### N`` with a numeric N, which is
  what makes a line a dead letter.
  """
  idx = answer.rfind("####")
  if idx < 0:
    raise RecordError("answer has no '#### N' final-answer marker")
  m = _FINAL_ANSWER_RE.match(answer, idx)
  final = normalize_answer(m.group(1)) if m else ""
  if not is_number(final):
    raise RecordError(f"final answer after '####' is not a number: {m.group(1)!r}")
  return answer[:idx].rstrip(), final


