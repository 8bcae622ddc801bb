"""The standardized 5-category test set: code, math, qa, instructions, summarization.

Each category module generates its items (seeded, offline) and scores a response; `items`
writes all of them once to a versioned JSONL cache with a content hash; `task.SuiteTask`
runs them through the evaluation pipeline (`configs/suite.py`); `metrics` gives the
per-category table (accuracy, tokens, TTFT, per-token latency and its spread).
"""

from pipelines.suite.items import (CATEGORIES, ITEMS_PER_CATEGORY, SUITE_VERSION, SuiteCacheError,
                                   generate_items, load_or_create, select)
from pipelines.suite.task import SuiteTask

__all__ = ["CATEGORIES", "ITEMS_PER_CATEGORY", "SUITE_VERSION", "SuiteCacheError", "SuiteTask",
           "generate_items", "load_or_create", "select"]
