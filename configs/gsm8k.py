"""GSM-style evaluation of the embedded model (the default job).

  python -m pipelines.eval                                   # embedded default
  python -m pipelines.eval --config=configs/gsm8k.py:smoke=True --config.dataset.n=8
Variants after the colon: comma-separated key=value (smoke=True|False).
"""

import ml_collections


def parse_arg(arg: str) -> dict:
  """"smoke=True,foo=bar" -> {"smoke": "True", "foo": "bar"}; unknown keys are an error."""
  known = {"smoke": "False"}
  if not arg:
    return known
  for part in arg.split(","):
    key, sep, value = part.partition("=")
    if not sep or key not in known:
      raise ValueError(f"config variant {part!r}: expected key=value with key in {sorted(known)}")
    known[key] = value
  return known


def get_config(arg: str = ""):
  variant = parse_arg(arg)
  smoke = variant["smoke"].lower() in ("1", "true", "yes")

  config = ml_collections.ConfigDict()
  config.model = ml_collections.ConfigDict()
  config.model.source = "embedded"  # 'embedded', a .gguf file, an HF or orbax directory
  config.model.backend = "auto"  # auto | pallas | reference

  config.dataset = ml_collections.ConfigDict()
  config.dataset.name = "gsm_synthetic"  # gsm_synthetic | gsm8k_jsonl
  config.dataset.path = ""  # for gsm8k_jsonl: official GSM8K JSONL (local, gs://, s3://)
  config.dataset.n = 8 if smoke else 40  # examples to evaluate (0 = all, for files)
  config.dataset.seed = 0
  config.dataset.levels = (1,) if smoke else (1, 2)

  config.prompt = "zero_shot"  # zero_shot | fewshot
  config.sampling = ml_collections.ConfigDict()
  config.sampling.max_new_tokens = 96 if smoke else 192
  config.sampling.temperature = 0.0
  config.sampling.top_p = 1.0
  config.sampling.top_k = 0
  config.sampling.seed = 0
  config.batch_size = 8
  config.smoke = smoke
  config.lock()
  return config
