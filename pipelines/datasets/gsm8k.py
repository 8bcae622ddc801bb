"""GSM8K in its official JSONL format (``question``, ``answer`` ending ``#### N``).

The default route reads a file from any location Beam's FileSystems can open.
TFDS and Hugging Face loaders exist for convenience but are optional, lazily
imported, never used by default, and raise `DatasetUnavailableError` when the
package or the data is missing (e.g. offline).
"""

from __future__ import annotations

import importlib
from typing import Any, Iterable, Iterator, Optional

from pipelines.datasets.jsonl import JsonLine, load_records, require_str
from pipelines.datasets.records import (DeadLetter, Example, LoadResult,
                                        RecordError, split_gsm8k_answer)

DATASET = "gsm8k"


class DatasetUnavailableError(RuntimeError):
  """An optional online dataset route cannot be used here (package or data missing)."""


def example_from_gsm8k_record(
    obj: dict[str, Any],
    *,
    dataset: str = DATASET,
    split: str = "test",
    index: int,
) -> Example:
  """Build an `Example` from one GSM8K-format dict; raise `RecordError` if unusable.

  The id is the record's own ``id`` field when present (synthetic sets carry
  one), else ``{dataset}/{split}/{index}``. Extra fields (e.g. ``level``) are
  kept in metadata, together with the worked solution.
  """
  question = require_str(obj, "question").strip()
  answer = require_str(obj, "answer")
  solution, final = split_gsm8k_answer(answer)
  rec_id = obj.get("id")
  if rec_id is not None and (isinstance(rec_id, bool) or not isinstance(rec_id, (str, int))):
    raise RecordError(f"field 'id' must be a string, got {type(rec_id).__name__}")
  if isinstance(rec_id, str) and not rec_id.strip():
    raise RecordError("field 'id' is empty")
  metadata = {k: v for k, v in obj.items() if k not in ("question", "answer", "id")}
  metadata["solution"] = solution
  metadata["answer"] = answer
  metadata["split"] = split
  return Example(
      id=str(rec_id) if rec_id is not None else f"{dataset}/{split}/{index}",
      dataset=dataset, question=question, reference=final, metadata=metadata)


def read_gsm8k_jsonl(
    path: str,
    *,
    dataset: str = DATASET,
    split: str = "test",
) -> Iterator[LoadResult]:
  """Read a GSM8K-format file (JSONL, or another of `jsonl.FORMATS`), yielding `Example`
  or `DeadLetter` per record.

  Ids default to ``{dataset}/{split}/{i}`` with i the 0-based line index, so an
  example keeps its id even if an earlier malformed line gets fixed or dropped.
  """
  def parse(line: JsonLine) -> Example:
    return example_from_gsm8k_record(line.obj, dataset=dataset, split=split,
                                     index=line.index)
  return load_records(path, parse)


def _from_records(records: Iterable[dict[str, Any]], source: str, split: str,
                  dataset: str) -> Iterator[LoadResult]:
  for i, rec in enumerate(records):
    rec = {k: v.decode("utf-8") if isinstance(v, bytes) else v for k, v in rec.items()}
    try:
      yield example_from_gsm8k_record(rec, dataset=dataset, split=split, index=i)
    except RecordError as e:
      yield DeadLetter(source, i + 1, str(e), repr(rec))


def _import_optional(module: str, hint: str) -> Any:
  try:
    return importlib.import_module(module)
  except ImportError as e:
    raise DatasetUnavailableError(
        f"optional loader needs the '{module}' package ({hint}); "
        "the default route is read_gsm8k_jsonl(path) on a local or gs:// file") from e


def load_gsm8k_tfds(
    split: str = "test",
    *,
    data_dir: Optional[str] = None,
    download: bool = False,
) -> Iterator[LoadResult]:
  """Optional: GSM8K via tensorflow-datasets (``gsm8k``); not used by default.

  `download` stays False so nothing is fetched at run time unless asked; a
  missing prepared copy raises `DatasetUnavailableError`.
  """
  tfds = _import_optional("tensorflow_datasets", "pip install tensorflow-datasets")
  try:
    ds = tfds.load("gsm8k", split=split, data_dir=data_dir, download=download)
    records = list(tfds.as_numpy(ds))
  except Exception as e:  # tfds raises many types for missing data / offline.
    raise DatasetUnavailableError(
        f"tensorflow-datasets could not provide gsm8k/{split} "
        f"(download={download}, data_dir={data_dir!r}): {e}") from e
  return _from_records(records, f"tfds:gsm8k/{split}", split, DATASET)


def load_gsm8k_hf(
    split: str = "test",
    *,
    name: str = "openai/gsm8k",
    config: str = "main",
) -> Iterator[LoadResult]:
  """Optional: GSM8K via Hugging Face `datasets` (needs network or a local cache)."""
  hf = _import_optional("datasets", "pip install datasets")
  try:
    records = list(hf.load_dataset(name, config, split=split))
  except Exception as e:  # network / cache errors come in many types.
    raise DatasetUnavailableError(
        f"Hugging Face datasets could not provide {name}/{config}/{split}: {e}") from e
  return _from_records(records, f"hf:{name}/{split}", split, DATASET)
