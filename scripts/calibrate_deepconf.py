"""A fixed DeepConf stop threshold for a model, from held-out GSM-style problems.

  python scripts/calibrate_deepconf.py [--problems 8] [--seed 1000] [--n 8]
      [--keep-percent 10] [--window 8] [--model embedded]

Runs `n` unstopped traces per problem (synthetic level-1/2 problems of --seed: keep it
apart from the seeds you evaluate on) with deepconf's sampling and confidence window,
and prints the (100 - keep_percent)th percentile of their confidences
(`DeepConf.calibrate`) and the config flag that uses it:

  python -m pipelines.eval --config=configs/gsm8k.py:policy=deepconf \\
      --config.policy.threshold=<printed value> ...
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from o1jax.compilation_cache import enable_compilation_cache  # noqa: E402
from script_args import count, levels, percent, user_errors  # noqa: E402


@user_errors
def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--problems", type=count(1), default=8)
  p.add_argument("--seed", type=int, default=1000)
  p.add_argument("--levels", type=levels, default="1,2")
  p.add_argument("--n", type=count(1), default=8)
  p.add_argument("--keep-percent", type=percent, default=None,
                 help="default: deepconf's configured keep_percent")
  p.add_argument("--window", type=count(1), default=None, help="default: deepconf's configured window")
  p.add_argument("--max-thinking", type=count(0), default=96)
  p.add_argument("--max-answer", type=count(1), default=12)
  p.add_argument("--max-rows", type=count(1), default=16)
  p.add_argument("--model", default="embedded", help="checkpoint: embedded, a GGUF, an HF dir")
  a = p.parse_args(argv)
  enable_compilation_cache()
  from o1jax.checkpoint import load_checkpoint
  from bench_policies import gsm_requests
  from o1jax.controller import ContiguousLlama, Controller, get_policy
  from o1jax.model import Llama

  params = {"n": a.n, "max_thinking_tokens": a.max_thinking,
            "max_answer_tokens": a.max_answer}
  if a.keep_percent is not None:
    params["keep_percent"] = a.keep_percent
  if a.window is not None:
    params["window"] = a.window
  policy = get_policy("deepconf", **params)
  ck = load_checkpoint(a.model)
  ctl = Controller(ContiguousLlama(Llama(ck.config, ck.params)), ck.tokenizer, max_rows=a.max_rows)
  _, requests = gsm_requests(a.problems, a.seed, a.levels)
  t0 = time.perf_counter()
  threshold = policy.calibrate(ctl, requests)
  print(json.dumps({"threshold": threshold, "problems": len(requests), "seed": a.seed, "n": a.n,
                    "keep_percent": policy.keep_percent, "window": policy.window,
                    "seconds": round(time.perf_counter() - t0, 1)}))
  print(f"--config.policy.threshold={threshold:.6g}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
