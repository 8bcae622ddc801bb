"""The suite as a pipeline task (`config.task = "suite"`; registry in pipelines/task_specs.py).

Same interface as the other tasks (load / prompt / score_batch), plus:
  check_policy(policy)       controller policies only where they apply (category=math)
  sampling_for(example, s)   the category's token budget (min of it and sampling.max_new_tokens)
  warnings(s)                the budgets sampling.max_new_tokens caps (printed by the launcher)
  data_info()                suite version, seed, cache file, content hash, selection hash
Scoring goes by each item's `metadata.category`; a scorer that raises on one item returns
that exception in the item's place, and the pipeline turns it into a dead letter
(stage "scoring") while the other items of the batch are stored.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Iterator, Mapping, Sequence

from pipelines.datasets.records import Example
from pipelines.suite import items as suite_items
from pipelines.suite.items import CATEGORY_MODULES, CATEGORIES

# The categories' scoring rules, by version (with the sandbox's: task_specs.SANDBOX_RULES):
# 2 reads code from the reply's Python block whatever fences come first, IFEval's case,
# end-phrase and sentence rules, and QA's "The answer is X" (2026-12-06); 3 strips JSON
# fences as IFEval does (every prefix in turn). A new version recomputes. Per category
# since 4 (2026-12-07): QA reads the answer after a line that only announces it;
# instruction sentences end before closing emphasis and go on at a lowercase ellipsis;
# key facts match numbers by value.
SUITE_RULES = {"code": 3, "math": 3, "qa": 4, "instructions": 4, "summarization": 5}


class ScoringError(Exception):
  """One item's scorer raised; carried in the item's place so the batch goes on."""


@dataclasses.dataclass(frozen=True)
class SuiteTask:
  """The 5-category suite: code, math, qa, instructions, summarization."""
  dataset: Mapping[str, Any]
  prompt_cfg: Mapping[str, Any]
  sandbox_cfg: Mapping[str, Any]
  name: str = "suite"

  def __post_init__(self):
    # Settings a run would drop or clamp without a word, named when the plan is built.
    self.code_style  # a bad prompt.code_style fails when the plan is built
    style = self.prompt_cfg.get("style", "per_category")
    if style != "per_category":
      raise ValueError(f"prompt.style={style!r}: the suite renders each category's own prompt "
                       f"(per_category); prompt.code_style picks code's (chat or completion)")
    n = int(self.dataset["n"])
    if n > suite_items.ITEMS_PER_CATEGORY:
      raise ValueError(f"dataset.n={n}: the suite holds {suite_items.ITEMS_PER_CATEGORY} items "
                       f"per category (0 = all of them)")
    budgets = self.dataset["max_new_tokens"]
    for category in self.categories:
      value = budgets.get(category)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"dataset.max_new_tokens.{category}={value!r}: expected an int >= 1 "
                         f"(the category's new tokens, capped by sampling.max_new_tokens)")

  @property
  def categories(self) -> tuple[str, ...]:
    category = suite_items.check_category(self.dataset["category"])
    return CATEGORIES if category == "all" else (category,)

  @property
  def source(self) -> str:
    return str(suite_items.cache_path(self.dataset["cache_dir"], int(self.dataset["seed"])))

  @functools.cached_property
  def _loaded(self) -> tuple[list[Example], dict]:
    all_items, info = suite_items.load_or_create(self.dataset["cache_dir"], int(self.dataset["seed"]))
    chosen = suite_items.select(all_items, self.dataset["category"], int(self.dataset["n"]))
    return chosen, info

  def __getstate__(self):
    # Workers re-read the cache; the items (MBs for the full suite) stay out of the pickled plan.
    state = dict(self.__dict__)
    state.pop("_loaded", None)
    return state

  def load(self) -> Iterator[Example]:
    yield from self._loaded[0]

  def data_info(self) -> dict:
    chosen, info = self._loaded
    return {**info, "category": self.dataset["category"], "per_category": int(self.dataset["n"]),
            "items": {c: sum(ex.metadata["category"] == c for ex in chosen) for c in self.categories},
            "items_sha256": suite_items.items_sha256(chosen)}

  def check_policy(self, policy) -> None:
    """Controller policies answer with 'The answer is N' and vote on numbers: math only."""
    if policy.controller and self.categories != ("math",):
      rejected = [c for c in self.categories if c != "math"]
      raise ValueError(f"policy {policy.name!r} is a reasoning-controller policy (it votes on the "
                       f"number after 'The answer is'); suite categories {rejected} reject it "
                       f"(code needs stop sequences and pass@k, the others free-text answers): "
                       f"use category=math, or policy=greedy / sample_n")

  def warnings(self, base) -> list[str]:
    """What the run's settings change without an error (the launcher prints them)."""
    budgets = self.dataset["max_new_tokens"]
    capped = [f"{c} {budgets[c]}" for c in self.categories if budgets[c] > base.max_new_tokens]
    if not capped:
      return []
    return [f"sampling.max_new_tokens={base.max_new_tokens} caps the per-category budgets "
            f"(dataset.max_new_tokens) of {', '.join(capped)}"]

  def sampling_for(self, example: Example, base):
    budget = int(self.dataset["max_new_tokens"][example.metadata["category"]])
    return dataclasses.replace(base, max_new_tokens=min(base.max_new_tokens, budget))

  @property
  def code_style(self) -> str:
    return CATEGORY_MODULES["code"].check_style(str(self.prompt_cfg.get("code_style", "chat")))

  def prompt(self, example: Example):
    category = example.metadata["category"]
    if category == "code":
      return CATEGORY_MODULES[category].prompt(example, self.code_style)
    return CATEGORY_MODULES[category].prompt(example)

  def sandbox(self):
    if "code" not in self.categories:
      return None
    from pipelines.task_specs import sandbox_from_config
    return sandbox_from_config(self.sandbox_cfg)

  # The scoring identity depends on the item's category (the pipeline passes the example).
  scoring_by_example = True

  def scoring_identity(self, example: Example) -> dict:
    """The category's rules; the sandbox's limits only where the sandbox judges (code):
    a timeout cannot change a QA verdict (a change of it recomputed all 800 others)."""
    from pipelines.task_specs import sandbox_identity
    category = example.metadata["category"]
    sandbox = sandbox_identity(self.sandbox_cfg) if category == "code" else {}
    return {**sandbox, "suite_rules": SUITE_RULES[category]}

  def score_batch(self, items: Sequence[tuple[Example, str, tuple[str, ...]]], sandbox=None) -> list:
    """One score dict (or ScoringError) per item; code items run in the sandbox as one pool."""
    out: list = [None] * len(items)
    code = [i for i, (ex, _, _) in enumerate(items) if ex.metadata["category"] == "code"]
    if code:
      sandbox = sandbox or self.sandbox()
      scores = CATEGORY_MODULES["code"].score_many([items[i] for i in code], sandbox,
                                                   self.code_style)
      for i, s in zip(code, scores):
        out[i] = {"category": "code", **s}
    for i, (example, text, stop) in enumerate(items):
      if out[i] is not None:
        continue
      category = example.metadata["category"]
      try:
        out[i] = {"category": category, **CATEGORY_MODULES[category].score(example, text, tuple(stop))}
      except Exception as e:  # one bad item must not lose the batch: it becomes a dead letter
        out[i] = ScoringError(f"{category} scorer failed on {example.id}: {type(e).__name__}: {e}")
    return out
