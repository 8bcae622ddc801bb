"""The standardized 5-category suite: code, math, qa, instructions, summarization (200 each).

  python -m pipelines.eval --config=configs/suite.py --output_dir=runs/suite
  python -m pipelines.eval --config=configs/suite.py:smoke=True --output_dir=runs/suite_smoke
  python -m pipelines.eval --config=configs/suite.py:category=qa,fast=True --output_dir=runs/qa
  python -m pipelines.eval --config=configs/suite.py:category=math,policy=self_consistency

Variants: category=all|code|math|qa|instructions|summarization, smoke=True|False (3 items
per category, smaller budgets), fast=True|False (the fastest matmuls here + bf16 KV), policy=<name>
(greedy, sample_n; controller policies only with category=math: the others reject them).
Items come from the versioned cache (`pipelines/suite/items.py`), generated on first use.
"""

from configs import common
from pipelines.suite.items import CATEGORIES, check_category

VARIANTS = {**common.VARIANTS, "category": "all"}

# New tokens per category: code bodies and summaries need room; a QA answer is a name, which
# small models give after restating the question (up to ~25 tokens for 4 hops).
MAX_NEW_TOKENS = {"code": 256, "math": 48, "qa": 32, "instructions": 128, "summarization": 128}
SMOKE_MAX_NEW_TOKENS = {"code": 64, "math": 32, "qa": 12, "instructions": 48, "summarization": 48}


def get_config(arg: str = ""):
  variant = common.parse_arg(arg, VARIANTS)
  smoke = common.is_true(variant["smoke"], "smoke")
  category = check_category(variant["category"])
  budgets = SMOKE_MAX_NEW_TOKENS if smoke else MAX_NEW_TOKENS
  assert set(budgets) == set(CATEGORIES)

  config = common.section()
  config.task = "suite"  # registry in pipelines/task_specs.py
  config.model = common.model_section()
  config.dataset = common.section(
      name="suite",
      category=category,  # all | code | math | qa | instructions | summarization
      n=3 if smoke else 0,  # items per category (0 = all 200)
      seed=0,  # another seed is another suite (another cache file and hash)
      cache_dir="",  # empty: $O1JAX_SUITE_CACHE, else ~/.cache/o1jax/suite
      max_new_tokens=common.section(**budgets),  # per category; capped by sampling.max_new_tokens
  )
  # Each category module renders its prompt; code: "chat" (instruction-tuned models, the
  # embedded one) or "completion" (HumanEval's raw prompt, for base models).
  config.prompt = common.section(style="per_category", code_style="chat")
  config.sampling = common.sampling_section(max_new_tokens=max(budgets.values()))
  config.policy = common.policy_section(variant["policy"], smoke=smoke)
  config.sandbox = common.sandbox_section()
  config.engine = common.engine_section(smoke)
  # Summarization prompts are ~1,700 tokens: 8 of them at f32 KV (46 KB per token for the
  # embedded model) need ~640 MiB of blocks; the smoke batch holds 3 of them and 12 short ones.
  config.engine.kv_cache_bytes = (512 if smoke else 768) << 20
  config.budget = common.budget_section()
  config.speculative = common.speculative_section()
  config.controller = common.controller_section()
  # Smoke: all 15 items in one batch of decode slots (one worker, so the items are not split
  # into two bundles that the shared engine would run one after the other): one decode pass.
  config.runner = (common.runner_section(batch_size=16, workers=1) if smoke
                   else common.runner_section(batch_size=8))
  common.fast_numerics(config, common.is_true(variant["fast"], "fast"))
  return common.finish(config)
