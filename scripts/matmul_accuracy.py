"""How far each matmul_dtype moves the embedded model's logits from exact f32.

For a few prompts, f32 greedily continues each one (--new-tokens); then every
mode (and, if llama-cpp-python is installed, llama.cpp in a child process) runs
teacher-forced over the same prompt + continuation. Per mode: the largest
logit change, mean KL(f32 || mode) over positions, and how often its top-1
token equals f32's.

  python scripts/matmul_accuracy.py [--modes bfloat16,int8] [--new-tokens 100]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile

import numpy as np

PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips "
    "in May. How many clips did Natalia sell altogether in April and May?",
    "Write a short story about a lighthouse keeper.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
]


def log_softmax(z: np.ndarray) -> np.ndarray:
  z = z - z.max(-1, keepdims=True)
  return z - np.log(np.exp(z).sum(-1, keepdims=True))


def llamacpp_logits(gguf: str, sequences: list[list[int]]) -> list[np.ndarray]:
  """Child-process entry: llama.cpp's logits at every position of each sequence."""
  import llama_cpp
  import llama_cpp.llama_cpp as low

  default_params = low.llama_model_default_params

  def no_extra_buffers():  # as in bench_engine.py: extra buffer types crash here
    p = default_params()
    p.use_extra_bufts = False
    return p

  low.llama_model_default_params = no_extra_buffers
  out = []
  for seq in sequences:  # a fresh context each: nothing carries over between sequences
    llm = llama_cpp.Llama(model_path=gguf, logits_all=True, n_ctx=1024, n_threads=2,
                          verbose=False)
    llm.eval(seq)
    out.append(np.asarray(llm.scores[:len(seq)], np.float32))
  return out


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--modes", default="bfloat16,int8")
  ap.add_argument("--new-tokens", type=int, default=100)
  ap.add_argument("--skip-llamacpp", action="store_true")
  ap.add_argument("--llamacpp-child", help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.llamacpp_child:  # no JAX in this process
    inputs = json.loads(pathlib.Path(args.llamacpp_child).read_text())
    logits = llamacpp_logits(inputs["gguf"], inputs["sequences"])
    np.savez(inputs["out"], *logits)
    return 0

  import jax
  import jax.numpy as jnp

  from o1jax.checkpoint import load_checkpoint
  from o1jax.checkpoint.embedded import embedded_model_path
  from o1jax.model import KVCache, Llama
  from o1jax.model.generation import Generator

  ck = load_checkpoint("embedded")
  f32 = Llama(ck.config, ck.params)
  generator = Generator(f32, ck.tokenizer)
  prompts = [list(generator.encode_prompt([{"role": "user", "content": p}])) for p in PROMPTS]
  continuations = generator.generate(prompts, max_new_tokens=args.new_tokens)
  sequences = [p + list(c.token_ids) for p, c in zip(prompts, continuations)]

  def logits_of(model) -> list[np.ndarray]:
    out = []
    for seq in sequences:
      tokens = jnp.asarray([seq], jnp.int32)
      cache = KVCache.zeros(ck.config, 1, len(seq))
      z, _ = jax.jit(lambda t, c: model(t, jnp.zeros((1,), jnp.int32), c))(tokens, cache)
      out.append(np.asarray(z[0], np.float32))
    return out

  reference = logits_of(f32)
  results = {m: logits_of(Llama(ck.config, ck.params, matmul_dtype=m))
             for m in args.modes.split(",") if m}
  if not args.skip_llamacpp:
    with tempfile.TemporaryDirectory() as tmp:
      spec = pathlib.Path(tmp) / "in.json"
      out = pathlib.Path(tmp) / "out.npz"
      spec.write_text(json.dumps({"gguf": str(embedded_model_path()), "sequences": sequences,
                                  "out": str(out)}))
      proc = subprocess.run([sys.executable, __file__, "--llamacpp-child", str(spec)],
                            capture_output=True, text=True)
      if proc.returncode == 0:
        data = np.load(out)
        results["llama.cpp (q8 activations)"] = [data[f"arr_{i}"] for i in range(len(sequences))]
      else:
        print(f"llama.cpp: skipped ({proc.stderr.strip().splitlines()[-1:]})")

  n = sum(len(s) for s in sequences)
  print(f"{len(sequences)} sequences, {n} positions (prompt + {args.new_tokens} f32 greedy tokens)")
  print("| matmuls | max |logit change| | mean KL(f32 ‖ mode) | top-1 = f32's |")
  print("|---|---|---|---|")
  for name, logits in results.items():
    diff = max(np.abs(a - b).max() for a, b in zip(reference, logits))
    kl = np.concatenate([(np.exp(log_softmax(a)) * (log_softmax(a) - log_softmax(b))).sum(-1)
                         for a, b in zip(reference, logits)])
    top1 = np.concatenate([a.argmax(-1) == b.argmax(-1) for a, b in zip(reference, logits)])
    print(f"| {name} | {diff:.3f} | {kl.mean():.2e} | {top1.mean():.1%} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
