"""Any JSONL dataset, mapped onto question/answer by field names.

  python -m pipelines.eval --config=configs/custom.py --config.dataset.path=data.jsonl \
      --config.dataset.question_field=prompt --config.dataset.answer_field=target \
      --config.dataset.answer_format=number --output_dir=runs/custom

answer_format: number (the gold answer a plain decimal, or a JSON number; the GSM8K
strict/flexible extraction, compared by numeric value: "4", "4.0" and (flexible only: the
strict patterns take no "$") "$4.00" match a gold 4.0, "1000" matches "1,000.00", "4.01" does not match 4 (exact decimals, no rounding,
no tolerance); the majority vote counts "4" and "4.0" as one answer), gsm8k (worked
solution ending "#### N", compared as lm-evaluation-harness does, as strings: "1234.0"
does not match 1234), text (the reply's last line, matched after the GSM8K normalization - commas, $, one trailing period - in NFC, case-folded; prompt.system=short_answer then asks for a last line holding only the answer).
Variants: smoke=True|False, fast=True|False, policy=<name> (see configs/gsm8k.py; controller
policies vote on numbers: answer_format=text rejects them, use sample_n and the majority vote).
"""

from configs import common


def get_config(arg: str = ""):
  variant = common.parse_arg(arg, common.VARIANTS)
  smoke = common.is_true(variant["smoke"], "smoke")

  config = common.section()
  config.task = "custom"
  config.model = common.model_section()
  config.dataset = common.section(
      name="custom",  # dataset name used in example ids ("custom/<id or content hash>")
      path="",  # required: JSONL file (local, gs://, s3://; .gz ok)
      n=8 if smoke else 0,  # 0 = all
      question_field="question",  # dotted paths reach nested fields ("meta.q")
      answer_field="answer",
      id_field="",  # empty: content-hash ids
      answer_format="number",  # number (by value) | gsm8k (harness strings) | text
  )
  config.prompt = common.section(
      style="chat",  # chat (system + user turn) | completion (raw text)
      template="{question}",
      system="short_answer",  # short_answer | tutor | none | any literal text
      stop=(),
  )
  config.sampling = common.sampling_section(max_new_tokens=48 if smoke else 128)
  config.policy = common.policy_section(variant["policy"], smoke=smoke)
  config.engine = common.engine_section(smoke)
  config.budget = common.budget_section()
  config.speculative = common.speculative_section()
  config.controller = common.controller_section()
  config.runner = common.runner_section(batch_size=8)
  common.fast_numerics(config, common.is_true(variant["fast"], "fast"))
  return common.finish(config)
