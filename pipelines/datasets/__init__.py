"""Dataset loaders for the evaluation pipelines (Beam-free, pure Python).

Every loader yields `Example` or `DeadLetter` records (JSONL files also `Duplicate`
for a repeated line), so malformed input is routed aside with its source and line
number instead of stopping a run; only a dataset that cannot be used at all (missing,
unreadable) raises `DatasetError`.
"""

from pipelines.datasets.custom_jsonl import FieldMapping, read_custom_jsonl
from pipelines.datasets.gsm8k import (DatasetUnavailableError, load_gsm8k_hf,
                                      load_gsm8k_tfds, read_gsm8k_jsonl)
from pipelines.datasets.humaneval import humaneval_examples, load_humaneval
from pipelines.datasets.records import (DatasetChangedError, DatasetError, DeadLetter, Duplicate,
                                        Example, LoadResult, normalize_answer)

__all__ = [
    "DatasetChangedError", "DatasetError", "DatasetUnavailableError", "DeadLetter", "Duplicate",
    "Example", "FieldMapping", "LoadResult", "SyntheticProblem", "generate", "humaneval_examples", "load_gsm8k_hf",
    "load_gsm8k_tfds", "load_humaneval", "normalize_answer", "read_custom_jsonl",
    "read_gsm8k_jsonl", "synthetic_examples",
]


def __getattr__(name: str):
  """The generator's names, imported when first asked for: imported here, the module was in
  sys.modules before `python -m pipelines.datasets.gsm_synthetic` ran it (runpy's
  RuntimeWarning on every run of the documented command)."""
  if name in ("SyntheticProblem", "generate", "synthetic_examples"):
    from pipelines.datasets import gsm_synthetic
    return getattr(gsm_synthetic, name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
