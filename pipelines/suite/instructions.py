"""Suite category `instructions`: IFEval-style verifiable instructions, one to three per prompt.

A prompt is a short writing task ("Write a short note about tide pools.") followed by the
description of each instruction. Each instruction is a small frozen dataclass whose
`check(response)` follows the matching checker of IFEval (Zhou et al., 2023,
google-research `instruction_following_eval/instructions.py`):

  id                           check (as IFEval)
  length:max_words / min_words words = \\w+ runs (IFEval's nltk RegexpTokenizer(r"\\w+")); < N / >= N
  length:max_sentences         sentences <= N, counted by a regex splitter (IFEval counts with
                               nltk's punkt, data this offline project does not ship: they differ
                               on abbreviations it does not list, "Hello.World." (2 here, 1 there),
                               "!!!" runs and a trailing "**"; equal on 232 real replies)
  keywords:include             every keyword found, case-insensitive (re.search)
  keywords:forbidden           no keyword found as a whole word, case-insensitive
  format:json                  the response, without ```json fences, parses with json.loads
  format:bullets               exactly N lines starting "* " or "- " (markdown bullets)
  format:title                 a title in double angular brackets, <<like this>>
  case:lowercase               response.islower(): a cased letter, none upper (IFEval also runs
                               langdetect: skipped)
  case:uppercase               response.isupper()
  end:phrase                   ends (after stripping whitespace, then double quotes;
                               case-insensitive) with the exact phrase
  punctuation:no_comma         no ',' anywhere

Metrics, as IFEval defines them: prompt-level accuracy (every instruction of the prompt
followed) and instruction-level accuracy (followed instructions / all instructions), each
strict (the response as is) and loose (an instruction counts as followed when any of 8
variants passes: the response, without its first line, without its last line, without
both, and each of these with every '*' removed; empty variants are skipped). Headline:
prompt-level strict. Incompatible instructions are never combined (e.g. JSON with bullets,
a comma-free response with JSON, lowercase with uppercase).
"""

from __future__ import annotations

import abc
import dataclasses
import json
import random
import re
from typing import ClassVar

from pipelines.datasets.records import Example

CATEGORY = "instructions"

TOPICS = ("tide pools", "city gardens", "old lighthouses", "night trains", "beekeeping",
          "paper maps", "mountain huts", "public libraries", "river ferries", "winter markets",
          "wind farms", "street food", "school choirs", "desert plants", "bicycle repair",
          "weather balloons", "board games", "sourdough bread", "coral reefs", "rooftop solar")
TASKS = ("Write a short note about {t}.", "Describe {t} for a curious child.",
         "Give advice to someone who wants to learn about {t}.", "Explain why people enjoy {t}.",
         "Write a brief product pitch related to {t}.")
KEYWORDS = ("history", "future", "community", "simple", "season", "quiet", "bright", "careful",
            "travel", "water", "light", "morning")
END_PHRASES = ("Is there anything else I can help with?", "Thanks for reading.",
               "That is all for now.", "Let me know if you have questions.")


class Instruction(abc.ABC):
  """One verifiable instruction: its prompt text and its checker."""
  id: ClassVar[str]

  @abc.abstractmethod
  def check(self, response: str) -> bool:
    """True when `response` follows the instruction."""

  @abc.abstractmethod
  def describe(self) -> str:
    """The instruction as the prompt states it."""

  def to_dict(self) -> dict:
    return {"id": self.id, **dataclasses.asdict(self)}


def _words(text: str) -> int:
  return len(re.findall(r"\w+", text))


# A "." after these (case-insensitive) or after a single capital (an initial) ends no
# sentence ("Dr. Smith left." is one sentence).
_ABBREVIATIONS = ("mr", "mrs", "ms", "dr", "st", "prof", "jr", "sr", "vs", "etc", "inc", "ltd",
                  "e.g", "i.e", "fig")
# (markdown emphasis may close after the mark: "**Go at low tide.** Bring boots.")
_SENTENCE_END = re.compile(r"[.!?\u2026]+(?=[*_]*(?:\s|$|[\"')\]]|[A-Z]))")


def _sentences(text: str) -> int:
  """Sentences: text ending at . ! ? before a space, the end, a closing quote or bracket,
  or a capital ("Hello.World." is two), markdown emphasis closed between ("*One.* Two."
  is two), except after an abbreviation or an initial, at an ellipsis the sentence goes
  on after in lower case ("Hi... there." is one, as Punkt reads it), and not inside a
  number ("3.14")."""
  # (positions, not slices: a text of 30,000 "Dr. " copied its tail per stop, 73 s)
  count, start = 0, 0
  for end in _SENTENCE_END.finditer(text):
    before = _LAST_WORD.search(text, max(start, end.start() - 64), end.start())
    word = before.group().lower() if before else ""
    if end.group() == "." and (word in _ABBREVIATIONS or re.fullmatch(r"[A-Z]", before.group()
                                                                         if before else "")):
      continue
    ellipsis = set(end.group()) <= {".", "\u2026"} and end.group() != "."
    if ellipsis and _GOES_ON.match(text, end.end()):
      continue
    if _WORD.search(text, start, end.start()):
      count += 1
    start = end.end()
  return count + bool(_WORD.search(text, start))


_LAST_WORD = re.compile(r"[\w.]+$")
_GOES_ON = re.compile(r"[*_]*\s+[a-z]")
_WORD = re.compile(r"\w")


def _strip_json_fence(text: str) -> str:
  # IFEval's order: every prefix removed in turn (```json``` loses both), then the suffix.
  value = text.strip()
  for prefix in ("```json", "```Json", "```JSON", "```"):
    value = value.removeprefix(prefix)
  return value.removesuffix("```").strip()


@dataclasses.dataclass(frozen=True)
class MaxWords(Instruction):
  id: ClassVar[str] = "length:max_words"
  n: int

  def describe(self):
    return f"Answer with less than {self.n} words."

  def check(self, response):
    return _words(response) < self.n


@dataclasses.dataclass(frozen=True)
class MinWords(Instruction):
  id: ClassVar[str] = "length:min_words"
  n: int

  def describe(self):
    return f"Answer with at least {self.n} words."

  def check(self, response):
    return _words(response) >= self.n


@dataclasses.dataclass(frozen=True)
class MaxSentences(Instruction):
  id: ClassVar[str] = "length:max_sentences"
  n: int

  def describe(self):
    return f"Use at most {self.n} sentences."

  def check(self, response):
    return _sentences(response) <= self.n


@dataclasses.dataclass(frozen=True)
class IncludeKeywords(Instruction):
  id: ClassVar[str] = "keywords:include"
  keywords: tuple[str, ...]

  def describe(self):
    return f"Include the keywords {', '.join(repr(k) for k in self.keywords)} in the response."

  def check(self, response):
    return all(re.search(re.escape(k), response, flags=re.IGNORECASE) for k in self.keywords)


@dataclasses.dataclass(frozen=True)
class ForbiddenWords(Instruction):
  id: ClassVar[str] = "keywords:forbidden"
  words: tuple[str, ...]

  def describe(self):
    return f"Do not include the words {', '.join(repr(w) for w in self.words)} in the response."

  def check(self, response):
    return not any(re.search(r"\b" + re.escape(w) + r"\b", response, flags=re.IGNORECASE)
                   for w in self.words)


@dataclasses.dataclass(frozen=True)
class JsonFormat(Instruction):
  id: ClassVar[str] = "format:json"

  def describe(self):
    return "Wrap your entire output in JSON format; you can use markdown ticks such as ```."

  def check(self, response):
    try:
      json.loads(_strip_json_fence(response))
    except (ValueError, RecursionError):  # (nested past Python's limit: was a dead letter,
      return False                        # the item left out of accuracy; IFEval crashes)
    return True


@dataclasses.dataclass(frozen=True)
class Bullets(Instruction):
  id: ClassVar[str] = "format:bullets"
  n: int

  def describe(self):
    return (f"Your answer must contain exactly {self.n} bullet points. Use markdown bullet "
            f"points such as:\n* This is point 1.\n* This is point 2")

  def check(self, response):
    stars = re.findall(r"^\s*\*[^\*].*$", response, flags=re.MULTILINE)
    dashes = re.findall(r"^\s*-.*$", response, flags=re.MULTILINE)
    return len(stars) + len(dashes) == self.n


@dataclasses.dataclass(frozen=True)
class Title(Instruction):
  id: ClassVar[str] = "format:title"

  def describe(self):
    return "Your answer must contain a title, wrapped in double angular brackets, such as <<poem of joy>>."

  def check(self, response):
    return any(t.lstrip("<").rstrip(">").strip() for t in re.findall(r"<<[^\n]+>>", response))


@dataclasses.dataclass(frozen=True)
class Lowercase(Instruction):
  id: ClassVar[str] = "case:lowercase"

  def describe(self):
    return "Your entire response should be in English, and in all lowercase letters. No capital letters are allowed."

  def check(self, response):
    return response.islower()  # as IFEval: "12345." has no letter to be lowercase


@dataclasses.dataclass(frozen=True)
class Uppercase(Instruction):
  id: ClassVar[str] = "case:uppercase"

  def describe(self):
    return "Your entire response should be in English, and in all capital letters."

  def check(self, response):
    return response.isupper()


@dataclasses.dataclass(frozen=True)
class EndPhrase(Instruction):
  id: ClassVar[str] = "end:phrase"
  phrase: str

  def describe(self):
    return f"Finish your response with this exact phrase: {self.phrase} No other words should follow it."

  def check(self, response):
    # IFEval strips a closing quote too: `... "Is there anything else?"` ends with it
    return response.strip().strip('"').lower().endswith(self.phrase.strip().lower())


@dataclasses.dataclass(frozen=True)
class NoComma(Instruction):
  id: ClassVar[str] = "punctuation:no_comma"

  def describe(self):
    return "In your entire response, refrain from the use of any commas."

  def check(self, response):
    return "," not in response


REGISTRY: dict[str, type[Instruction]] = {c.id: c for c in (
    MaxWords, MinWords, MaxSentences, IncludeKeywords, ForbiddenWords, JsonFormat, Bullets, Title,
    Lowercase, Uppercase, EndPhrase, NoComma)}

# Pairs never given together: one would break the other, or both constrain the same thing.
CONFLICTS = {
    frozenset(p) for p in (
        ("format:json", "format:bullets"), ("format:json", "punctuation:no_comma"),
        ("format:json", "end:phrase"), ("format:json", "format:title"),
        ("format:json", "length:max_sentences"), ("case:lowercase", "case:uppercase"),
        ("length:max_words", "length:min_words"), ("format:bullets", "length:max_sentences"),
        ("case:uppercase", "keywords:forbidden"), ("case:lowercase", "end:phrase"),
        ("case:uppercase", "end:phrase"), ("case:lowercase", "format:title"),
        ("punctuation:no_comma", "end:phrase"), ("length:max_words", "format:bullets"))}


def from_dict(d: dict) -> Instruction:
  cls = REGISTRY[d["id"]]
  kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k != "id"}
  return cls(**kwargs)


def _make(kind: str, rng: random.Random, used_words: set) -> Instruction:
  if kind == "length:max_words":
    return MaxWords(rng.choice((30, 50, 80)))
  if kind == "length:min_words":
    return MinWords(rng.choice((40, 60, 100)))
  if kind == "length:max_sentences":
    return MaxSentences(rng.randint(2, 4))
  if kind == "keywords:include":
    words = tuple(rng.sample([k for k in KEYWORDS if k not in used_words], rng.randint(1, 2)))
    used_words.update(words)
    return IncludeKeywords(words)
  if kind == "keywords:forbidden":
    words = tuple(rng.sample([k for k in KEYWORDS if k not in used_words], 2))
    used_words.update(words)
    return ForbiddenWords(words)
  if kind == "format:bullets":
    return Bullets(rng.randint(2, 5))
  if kind == "end:phrase":
    return EndPhrase(rng.choice(END_PHRASES))
  return REGISTRY[kind]()


def generate_item(seed: int, index: int, attempt: int = 0) -> Example:
  """Item `index` has 1 + index % 3 instructions of distinct, compatible kinds; `attempt`
  draws it again (`generate`: prompts are distinct)."""
  rng = random.Random(f"suite/instructions:{seed}:{index}"
                      + (f":{attempt}" if attempt else ""))
  count = 1 + index % 3
  kinds: list[str] = []
  while len(kinds) < count:
    kind = rng.choice(sorted(REGISTRY))
    if kind not in kinds and not any(frozenset((kind, k)) in CONFLICTS for k in kinds):
      kinds.append(kind)
  used: set = set()
  instructions = [_make(k, rng, used) for k in kinds]
  task = rng.choice(TASKS).format(t=rng.choice(TOPICS))
  text = task + " " + " ".join(i.describe() for i in instructions)
  return Example(id=f"suite/instructions/{index}", dataset="suite", question=text,
                 reference="", metadata={"category": CATEGORY, "level": count,
                                         "instructions": [i.to_dict() for i in instructions]})


def generate(n: int, seed: int) -> list[Example]:
  """n items with distinct prompts: an item whose prompt an earlier one has is drawn again
  (item i depends on items < i only: the first n do not change with n)."""
  items, seen = [], set()
  for i in range(n):
    item, attempt = generate_item(seed, i), 0
    while item.question in seen:
      attempt += 1
      item = generate_item(seed, i, attempt)
    seen.add(item.question)
    items.append(item)
  return items


def prompt(example: Example):
  return [{"role": "user", "content": example.question}], ()


def loose_variants(response: str) -> list[str]:
  """IFEval's loose variants: as is, without first / last / both lines, each also without '*'."""
  lines = response.split("\n")
  cut = ["\n".join(lines[1:]).strip(), "\n".join(lines[:-1]).strip(), "\n".join(lines[1:-1]).strip()]
  variants = [response, response.replace("*", "")] + cut + [v.replace("*", "") for v in cut]
  return [v for v in variants if v.strip()]


def follows(instruction: Instruction, response: str) -> tuple[bool, bool]:
  """(strict, loose) for one instruction."""
  strict = bool(response.strip()) and instruction.check(response)
  return strict, strict or any(instruction.check(v) for v in loose_variants(response))


def score(example: Example, text: str, stop: tuple[str, ...] = ()) -> dict:
  instructions = [from_dict(d) for d in example.metadata["instructions"]]
  results = [follows(i, text) for i in instructions]
  strict = [s for s, _ in results]
  loose = [lo for _, lo in results]
  return {"answer": None, "correct": all(strict),
          "followed_strict": strict, "followed_loose": loose,
          "metrics": {"prompt_strict": float(all(strict)), "prompt_loose": float(all(loose)),
                      "instructions_strict": sum(strict), "instructions_loose": sum(loose),
                      "instructions_total": len(instructions)}}

