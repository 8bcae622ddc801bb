"""Any JSONL dataset, mapped onto `Example` by a field mapping.

E.g. ``{"question": "prompt", "answer": "target"}`` reads ``prompt`` as the
question and ``target`` as the gold answer. Optional ``id`` maps a source id
field; without it ids are content hashes so they survive reordering.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Literal, Mapping, Optional, get_args

from pipelines.datasets.jsonl import JsonLine, load_records, require_str
from pipelines.datasets.records import (Example, LoadResult, RecordError,
                                        content_id, is_number, normalize_answer, text_answer_key,
                                        split_gsm8k_answer)

AnswerFormat = Literal["number", "gsm8k", "text"]
ANSWER_FORMATS: tuple[str, ...] = get_args(AnswerFormat)
_TARGETS = ("question", "answer", "id")


@dataclasses.dataclass(frozen=True)
class FieldMapping:
  """Where the common fields live in the source records (dotted paths allowed).

  `answer_format` says how to normalize the gold answer: ``text`` (strip only),
  ``number`` (GSM8K normalization; must be a plain decimal, a JSON number read as
  Python writes it: 4.0 is "4.0") or ``gsm8k`` (a worked solution ending in
  ``#### N``). The reference keeps its text ("4.0", "1000.00"); the custom task
  compares ``number`` answers with it by value ("4" matches), ``gsm8k`` ones by the
  harness's string match (`pipelines.task_specs.CustomTask.score_batch`).
  """
  question: str = "question"
  answer: str = "answer"
  id: Optional[str] = None
  answer_format: AnswerFormat = "text"

  @classmethod
  def from_dict(cls, mapping: Mapping[str, str],
                answer_format: AnswerFormat = "text") -> "FieldMapping":
    """From ``{"question": src, "answer": src[, "id": src]}``; rejects unknown keys."""
    unknown = set(mapping) - set(_TARGETS)
    if unknown:
      raise ValueError(f"unknown target fields {sorted(unknown)}; allowed {_TARGETS}")
    if answer_format not in ANSWER_FORMATS:
      raise ValueError(f"unknown answer_format {answer_format!r}")
    for target, source in mapping.items():  # ("": every line "malformed", named so)
      if source is not None and (not isinstance(source, str) or not source.strip()):
        raise ValueError(f"dataset.{target}_field={source!r}: name the records' field that "
                         f"holds the {target}")
    return cls(question=mapping.get("question", "question"),
               answer=mapping.get("answer", "answer"),
               id=mapping.get("id"), answer_format=answer_format)


def _reference(answer: str, fmt: AnswerFormat) -> tuple[str, dict[str, Any]]:
  if fmt == "gsm8k":
    solution, final = split_gsm8k_answer(answer)
    return final, {"solution": solution}
  if fmt == "number":
    norm = normalize_answer(answer)
    if not is_number(norm):
      raise RecordError(f"answer is not a number: {shown(answer)}")
    return norm, {}
  gold = answer.strip()
  # Golds no reply could match (a reply is matched by its last line, normalized): were
  # scored wrong for every sample, as if the model had failed them.
  if len(gold.splitlines()) > 1:  # (as a reply's last line is found: U+2028, \x85 too)
    raise RecordError(f"answer has {len(gold.splitlines())} lines: a reply is matched by its "
                      f"last line, so no reply could match it: {shown(answer)}")
  if text_answer_key(gold) is None:
    raise RecordError(f"answer {shown(answer)} is nothing once normalized (commas, $, a "
                      f"trailing period go): no reply could match it")
  return gold, {}


def shown(value: str, limit: int = 80) -> str:
  """`value` for a one-line message: repr, cut to `limit` characters (a 200,000-character
  answer made a 200 KB error line and dead letters)."""
  return repr(value) if len(value) <= limit else f"{value[:limit]!r}... ({len(value)} characters)"


def example_from_custom_record(obj: dict[str, Any], mapping: FieldMapping, *,
                               dataset: str) -> Example:
  """Map one source dict to an `Example`; unmapped fields go to metadata."""
  question = require_str(obj, mapping.question, what="question").strip()
  answer = require_str(obj, mapping.answer, what="answer")
  reference, extra = _reference(answer, mapping.answer_format)
  if mapping.id is not None:
    ex_id = f"{dataset}/{require_str(obj, mapping.id, what='id')}"
  else:
    ex_id = content_id(dataset, question, answer)
  used = {mapping.question.split(".")[0], mapping.answer.split(".")[0]}
  if mapping.id:
    used.add(mapping.id.split(".")[0])
  metadata = {k: v for k, v in obj.items() if k not in used}
  metadata.update(extra)
  return Example(id=ex_id, dataset=dataset, question=question,
                 reference=reference, metadata=metadata)


def read_custom_jsonl(
    path: str,
    mapping: FieldMapping | Mapping[str, str],
    *,
    dataset: str = "custom",
    answer_format: Optional[AnswerFormat] = None,
) -> Iterator[LoadResult]:
  """Read a dataset file (JSONL, or another of `jsonl.FORMATS`) through `mapping`,
  yielding `Example` or `DeadLetter`.

  `mapping` may be a plain dict such as ``{"question": "prompt", "answer":
  "target"}``; `answer_format` overrides the mapping's own.
  """
  if not isinstance(mapping, FieldMapping):
    mapping = FieldMapping.from_dict(mapping, answer_format or "text")
  elif answer_format is not None:
    mapping = dataclasses.replace(mapping, answer_format=answer_format)

  def parse(line: JsonLine) -> Example:
    return example_from_custom_record(line.obj, mapping, dataset=dataset)
  return load_records(path, parse)
