"""GSM8K task: prompts (zero-shot chat, 8-shot chain of thought) and scoring.

Scoring follows the lm-evaluation-harness GSM8K conventions so numbers are
comparable with published ones: a *strict* extraction (``#### N`` or ``The
answer is N.``), a *flexible* one (the last number-like span), the harness's
string normalization (commas, ``$``, one trailing period) and exact match. The
custom task's ``answer_format=number`` reads answers the same way but compares
them by numeric value (`value_key`, `values_match`; ``score_gsm8k(by_value=True)``).

The few-shot exemplars below are original to this project (written in the
standard "Q: ... A: ... The answer is N." layout). The few-shot prefix is a
module constant so it is byte-identical for every problem, which lets the
engine share its KV cache across requests.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

from pipelines.datasets.records import normalize_answer
from pipelines.tasks.text import ChatMessage, truncate_at_stop


@dataclasses.dataclass(frozen=True)
class Exemplar:
  """A worked example: question, reasoning (without the final sentence), answer."""
  question: str
  reasoning: str
  answer: str

  @property
  def solution(self) -> str:
    return f"{self.reasoning} The answer is {self.answer}."


FEWSHOT_EXEMPLARS: tuple[Exemplar, ...] = (
    Exemplar(
        "A library shelf holds 48 books. A teacher borrows 15 of them and later "
        "returns 6. How many books are on the shelf now?",
        "The shelf starts with 48 books. After 15 are borrowed, 48 - 15 = 33 books "
        "are left. When 6 come back, there are 33 + 6 = 39 books.",
        "39"),
    Exemplar(
        "Marco buys 4 packs of markers with 12 markers in each pack. He gives 10 "
        "markers to his sister. How many markers does he keep?",
        "Marco buys 4 * 12 = 48 markers. After giving away 10, he keeps 48 - 10 = 38 "
        "markers.",
        "38"),
    Exemplar(
        "A bakery sells muffins for $3 each. It sold 25 muffins on Saturday and 31 "
        "on Sunday. How many dollars did it make from muffins over the weekend?",
        "Over the weekend it sold 25 + 31 = 56 muffins. At $3 each, that is "
        "56 * 3 = 168 dollars.",
        "168"),
    Exemplar(
        "Priya plants 6 rows of tulips with 8 tulips in each row. Rabbits eat 5 of "
        "the tulips. How many tulips are left?",
        "Priya plants 6 * 8 = 48 tulips. After the rabbits eat 5, there are "
        "48 - 5 = 43 tulips left.",
        "43"),
    Exemplar(
        "A train trip lasts 2 hours and 45 minutes. How many minutes long is the trip?",
        "Each hour has 60 minutes, so 2 hours is 2 * 60 = 120 minutes. Adding the 45 "
        "minutes gives 120 + 45 = 165 minutes.",
        "165"),
    Exemplar(
        "Leo has $50. He buys a book for $18 and two notebooks that cost $4 each. "
        "How many dollars does he have left?",
        "The notebooks cost 2 * 4 = 8 dollars. Altogether he spends 18 + 8 = 26 "
        "dollars. He has 50 - 26 = 24 dollars left.",
        "24"),
    Exemplar(
        "A school has 240 students. 25% of them walk to school and the rest ride "
        "the bus. How many students ride the bus?",
        "25% of 240 is 240 * 25 / 100 = 60 students who walk. The other "
        "240 - 60 = 180 students ride the bus.",
        "180"),
    Exemplar(
        "Nadia's book has 210 pages and she has already read 70 of them. She reads "
        "14 pages every day. How many more days will it take her to finish?",
        "She still has 210 - 70 = 140 pages to read. At 14 pages a day, that takes "
        "140 / 14 = 10 days.",
        "10"),
)

ZERO_SHOT_SYSTEM = (
    "You are a careful math tutor. Solve the problem step by step. End your reply "
    "with a final sentence of the form \"The answer is N.\" where N is a number.")
FEWSHOT_SYSTEM = (
    "Answer each grade-school math question. Reason step by step and end with "
    "\"The answer is N.\"")

# Where a plain-text few-shot completion should stop (the next "Q:" starts a new
# problem); chat turns end on the model's own end-of-turn token.
COMPLETION_STOP_SEQUENCES: tuple[str, ...] = ("Q:", "</s>", "<|im_end|>")


def _q(question: str) -> str:
  return question.strip()


def zero_shot_messages(question: str,
                       system: Optional[str] = ZERO_SHOT_SYSTEM) -> list[ChatMessage]:
  """Zero-shot chat: optional system instruction, then the problem as the user turn."""
  msgs: list[ChatMessage] = []
  if system:
    msgs.append({"role": "system", "content": system})
  msgs.append({"role": "user", "content": _q(question)})
  return msgs


def _fewshot_chat_prefix(system: Optional[str]) -> list[ChatMessage]:
  msgs: list[ChatMessage] = []
  if system:
    msgs.append({"role": "system", "content": system})
  for ex in FEWSHOT_EXEMPLARS:
    msgs.append({"role": "user", "content": ex.question})
    msgs.append({"role": "assistant", "content": ex.solution})
  return msgs


def fewshot_messages(question: str,
                     system: Optional[str] = FEWSHOT_SYSTEM) -> list[ChatMessage]:
  """8-shot chain of thought as a multi-turn chat (exemplars as prior turns).

  The first 16 (+1 system) messages are identical for every question, so the
  rendered chat prefix is too.
  """
  return _fewshot_chat_prefix(system) + [{"role": "user", "content": _q(question)}]


FEWSHOT_PREFIX: str = "".join(
    f"Q: {ex.question}\nA: {ex.solution}\n\n" for ex in FEWSHOT_EXEMPLARS)


def fewshot_prompt(question: str) -> str:
  """8-shot chain of thought as a plain completion prompt.

  Always `FEWSHOT_PREFIX` followed by ``Q: <question>\\nA:``; generate after it
  and stop at `COMPLETION_STOP_SEQUENCES`.
  """
  return f"{FEWSHOT_PREFIX}Q: {_q(question)}\nA:"


# --------------------------------------------------------------------------
# Answer extraction (lm-evaluation-harness patterns, verbatim regexes).

STRICT_HASH_RE = re.compile(r"#### (\-?[0-9\.\,]+)")
STRICT_ANSWER_IS_RE = re.compile(r"The answer is (\-?[0-9\.\,]+).")
STRICT_PATTERNS = (STRICT_HASH_RE, STRICT_ANSWER_IS_RE)
FLEXIBLE_RE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")


def _group(match) -> Optional[str]:
  # With several groups, findall gives tuples; take the first non-empty group.
  if isinstance(match, tuple):
    match = next((m for m in match if m), None)
  return match.strip() if match else None


def extract_strict(text: str) -> Optional[str]:
  """First ``#### N``; failing that, first ``The answer is N.``; else None: the harness's
  `gsm8k` strict filter, then its `gsm8k-cot` one (each harness task reads one of them;
  docs/pipelines.md, "GSM8K scoring").

  Kept byte-for-byte with the harness regexes, including their quirks: the
  pattern is case-sensitive, and its trailing ``.`` matches any character, so
  "The answer is 42" at the very end of a text (or before a newline) yields "4"
  and "The answer is 12. Then" yields "12." (normalized to "12" when scoring).
  The same quirk can cut a longer number to a shorter one that is right: "The
  answer is 123" at the end, or "The answer is 3/4.", is strict-correct for a
  reference of 12, or 3 (as in the harness; the flexible match sees "123", "4").
  """
  for pat in STRICT_PATTERNS:
    found = pat.findall(text)
    if found:
      return _group(found[0])
  return None


def extract_flexible(text: str) -> Optional[str]:
  """Last number-like span (harness "flexible-extract"); None if there is none."""
  found = FLEXIBLE_RE.findall(text)
  return _group(found[-1]) if found else None


@dataclasses.dataclass(frozen=True)
class GSM8KScore:
  """Both harness metrics for one completion (extractions kept for debugging)."""
  strict_answer: Optional[str]
  flexible_answer: Optional[str]
  strict_correct: bool
  flexible_correct: bool

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


_DIGIT_RE = re.compile(r"[0-9]")


def answer_key(answer: Optional[str]) -> Optional[str]:
  """What a GSM-style answer is compared and voted by: the harness normalization, or
  None when no digit is left (the flexible pattern also matches "...", "$$" or ",,",
  which are no answer: never right, never a vote)."""
  if answer is None:
    return None
  key = normalize_answer(answer)
  return key if _DIGIT_RE.search(key) else None


def answers_match(predicted: Optional[str], reference: str) -> bool:
  """Exact match after the harness normalization of both sides (strings, not numbers:
  "1,234" and "$1,234." match 1234, "1234.0" and "1234.00" do not, as in the harness).
  A prediction without a digit never matches, whatever the reference. Kept so for GSM8K
  and the custom task's ``answer_format=gsm8k`` (numbers comparable with the harness's);
  ``answer_format=number`` compares by value (`values_match`)."""
  key = answer_key(predicted)
  return key is not None and key == normalize_answer(reference)


# A plain decimal (ASCII digits) as the harness normalization leaves one: "-12", "3.50",
# ".5", "-.5", "7." (a second trailing "." of "7.." is left by the normalization).
_PLAIN_DECIMAL_RE = re.compile(r"-?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)")


def value_key(answer: Optional[str]) -> Optional[str]:
  """What answers are compared and voted by when numbers count by value (the custom
  task's ``answer_format=number``): `answer_key` (the harness normalization; None without
  a digit), then, when what is left is a plain decimal, its value as the controller's vote
  key writes it (`o1jax.controller.answers.normalize_number`): leading zeros of the
  integer part and trailing zeros of the fraction dropped, a zero without a minus. So
  "4.0", "04", "$4.00" and "4." are "4"; "-.5" and "-0.50" are "-0.5"; "1,000.00" is
  "1000". Exact decimal text, no float parsing: "0.1" and "0.10000000000000001" are two
  values (a float would round them to one), and "4.01" is not "4"; no tolerance, no
  exponent ("1e3" is not a plain decimal). What is not a plain decimal after the
  normalization ("1.2.3") keeps its harness key: a vote of its own, never equal to a
  number's key.

  `o1jax.controller.answers` is imported on first use (the package imports jax), so the
  modules that import this one stay light."""
  key = answer_key(answer)
  if key is None or not _PLAIN_DECIMAL_RE.fullmatch(key):
    return key
  from o1jax.controller.answers import normalize_number
  return normalize_number(key)


def values_match(predicted: Optional[str], reference: str) -> bool:
  """Match by numeric value (`value_key` of both sides): "4" matches 4.0, "1000" matches
  "1,000.00", "-.5" matches "-0.50"; "4.01" does not match 4. A prediction without a
  digit never matches."""
  key = value_key(predicted)
  return key is not None and key == value_key(reference)


def reads_as(text: str, key: str, stop_sequences: tuple[str, ...] = ()) -> bool:
  """Whether both harness readings of `text` cut at `stop_sequences` (strict and flexible,
  as a score reads them) give the controller's vote key `key` by value: which of a vote's
  traces stands for it (`o1jax.controller.Controller.reads_as`). By value, not spelling:
  "3.50" is right for a reference "3.50" and "3.5" for "3.5", and the reference is not read
  (only the text is)."""
  text = truncate_at_stop(text, stop_sequences) if stop_sequences else text
  return value_key(extract_strict(text)) == key and value_key(extract_flexible(text)) == key


def score_gsm8k(completion: str, reference: str,
                stop_sequences: tuple[str, ...] = (), by_value: bool = False) -> GSM8KScore:
  """Score a completion against a gold answer (number string or ``... #### N``).

  `stop_sequences` (e.g. `COMPLETION_STOP_SEQUENCES` for plain-text few-shot)
  are applied first, so text the model wrote for an imagined next question
  cannot be extracted. Both extractions are the harness's; `by_value` compares them with
  the reference by numeric value (`values_match`, the custom task's
  ``answer_format=number``) instead of the harness's string match (`answers_match`, the
  default: GSM8K and ``answer_format=gsm8k``).
  """
  text = truncate_at_stop(completion, stop_sequences) if stop_sequences else completion
  strict = extract_strict(text)
  flexible = extract_flexible(text)
  match = values_match if by_value else answers_match
  return GSM8KScore(strict, flexible, match(strict, reference), match(flexible, reference))
