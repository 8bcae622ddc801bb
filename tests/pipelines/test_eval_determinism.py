"""Same command → byte-identical per-sample outputs, whatever the workers or batch size.

Per-sample output = every results.jsonl field except `timing` (wall-clock stamps).
"""

import json

from configs import custom as custom_config
from configs import gsm8k as gsm8k_config
from pipelines.beam.testing import FakeClock
from pipelines.eval import run


def _outputs(run_dir):
  lines = (run_dir / "results.jsonl").read_text().splitlines()
  return [json.dumps({k: v for k, v in json.loads(l).items() if k != "timing"}) for l in lines]


def test_fake_predictor_one_vs_two_workers_and_batch_sizes(tmp_path):
  runs = []
  for name, workers, mode, batch in (("w1b1", 1, "in_memory", 1), ("w2b4", 2, "multi_processing", 4)):
    cfg = gsm8k_config.get_config("smoke=True,policy=sample_n")
    cfg.model.predictor = "fake"
    cfg.dataset.n = 6
    cfg.policy.n = 3
    cfg.runner.update(direct_num_workers=workers, direct_running_mode=mode, batch_size=batch)
    run(cfg, str(tmp_path / name), clock=FakeClock(), progress=False, report=False)
    runs.append(_outputs(tmp_path / name))
  assert len(runs[0]) == 18
  assert runs[0] == runs[1]


def test_tiny_random_model_batch_1_vs_3(tmp_path):
  from o1jax.testing import tiny_config, write_gguf_checkpoint
  model = tmp_path / "tiny.gguf"
  write_gguf_checkpoint(model, tiny_config(), seed=0)
  data = tmp_path / "q.jsonl"
  data.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n"
                          for q, a in (("2+3?", "5"), ("7-1?", "6"), ("4*2?", "8"))))
  runs = []
  for batch in (1, 3):
    cfg = custom_config.get_config("policy=sample_n")
    cfg.model.source = str(model)
    cfg.dataset.path = str(data)
    cfg.prompt.update(style="completion", template="Q: {question}\nA:")
    cfg.sampling.max_new_tokens = 6
    cfg.policy.update(n=2, temperature=10.0, top_p=1.0)  # the random model is very peaked
    cfg.runner.update(direct_num_workers=1, direct_running_mode="in_memory", batch_size=batch)
    run(cfg, str(tmp_path / f"b{batch}"), progress=False, report=False)
    runs.append(_outputs(tmp_path / f"b{batch}"))
  assert len(runs[0]) == 6
  texts = [json.loads(r)["output"] for r in runs[0]]
  assert texts[0] != texts[1]  # samples 0 and 1 of one example draw different random streams
  assert runs[0] == runs[1]
