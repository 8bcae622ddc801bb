"""How far each matmul_dtype moves the embedded model's logits from exact f32.

For a few prompts, f32 greedily continues each one (--new-tokens); then every
mode (and, if llama-cpp-python is installed, llama.cpp in a child process) runs
teacher-forced over the same prompt + continuation. Per mode: the largest
logit change, mean KL(f32 || mode) over positions, and how often its top-1
token equals f32's.

With --kv-dtypes, the f32 model also runs teacher-forced through the engine's paged KV
pool in each dtype (each position attends as a decode row does, reading the keys and
values as the pool stores them: bf16, or FP8 e4m3 with a scale per token), against the
same f32 reference.

  python scripts/matmul_accuracy.py [--modes bfloat16,int8,float8] [--new-tokens 100]
      [--kquant Q4_K,Q6_K] [--kv-dtypes float32,bfloat16,float8_e4m3fn]
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
  from llamacpp_common import disable_extra_buffer_types
  disable_extra_buffer_types()
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
  ap.add_argument("--kquant", default="", help="comma-separated K-quants (Q2_K,Q3_K,Q4_K,"
                  "Q5_K,Q6_K): re-encode the weights into each and measure the int8 path on them")
  ap.add_argument("--kv-dtypes", default="", help="comma-separated paged KV pool dtypes "
                  "(float32,bfloat16,float8_e4m3fn), f32 matmuls")
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
  from o1jax.engine.kv_cache import PagedKVCache
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

  def paged_logits_of(model, kv_dtype: str, block_size: int = 16) -> list[np.ndarray]:
    out = []
    c = ck.config
    for seq in sequences:
      blocks = -(-len(seq) // block_size)
      pool = PagedKVCache.create(c.n_layers, blocks, block_size, c.n_kv_heads, c.head_dim,
                                 kv_dtype).for_batch(jnp.arange(blocks)[None],
                                                     jnp.asarray([len(seq)]),
                                                     decode_queries=True)
      tokens = jnp.asarray([seq], jnp.int32)
      z, _ = jax.jit(lambda t, c: model(t, jnp.zeros((1,), jnp.int32), c))(tokens, pool)
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
  print_table("matmuls", reference, results)
  if args.kv_dtypes:
    print_table("KV pool (f32 matmuls)", reference,
                {kv: paged_logits_of(f32, kv) for kv in args.kv_dtypes.split(",")})
  if args.kquant:
    # Each K-quant's own cost (its f32 model vs the original f32), then what the int8 path
    # adds on its weights (int8 vs f32 on the same K-quant weights): the conversion of
    # groups of 16 to Q8_0 / f32 scales to f16, plus the activation rounding that the
    # "int8" row above shows alone.
    for kind in args.kquant.split(","):  # a table per kind as it completes (each takes minutes)
      params = kquantize_params(ck.params, kind)
      exact = logits_of(Llama(ck.config, params))
      int8 = logits_of(Llama(ck.config, params, matmul_dtype="int8"))
      print_table(f"{kind} weights", None, {"f32 matmuls vs the original f32": (reference, exact),
                                            "int8 vs f32 matmuls on them": (exact, int8)})
  return 0


def print_table(title: str, reference, results) -> None:
  """results: name -> logits per sequence (against `reference`), or name -> (reference,
  logits) pairs when reference is None."""
  print(f"| {title} | max \\|logit change\\| | mean KL(ref ‖ mode) | top-1 = ref's |")
  print("|---|---|---|---|")
  for name, logits in results.items():
    ref, logits = (reference, logits) if reference is not None else logits
    diff = max(np.abs(a - b).max() for a, b in zip(ref, logits))
    kl = np.concatenate([(np.exp(log_softmax(a)) * (log_softmax(a) - log_softmax(b))).sum(-1)
                         for a, b in zip(ref, logits)])
    top1 = np.concatenate([a.argmax(-1) == b.argmax(-1) for a, b in zip(ref, logits)])
    print(f"| {name} | {diff:.3f} | {kl.mean():.2e} | {top1.mean():.1%} |", flush=True)


# K-quant value sets: (group, lowest code, highest code, largest 6/4/8-bit scale,
# largest min or None when symmetric: those scales are signed).
KQUANTS = {"Q2_K": (16, 0, 3, 15, 15), "Q3_K": (16, -4, 3, 31, None),
           "Q4_K": (32, 0, 15, 63, 63), "Q5_K": (32, 0, 31, 63, 63),
           "Q6_K": (16, -32, 31, 127, None)}


def kquantize(w: np.ndarray, kind: str):
  """Round-to-nearest into `kind`'s value set: per group an integer scale (and min) under
  an f16 super-block d (and dmin), as llama.cpp's formats store them; returned as the
  QuantizedTensor gguf_blocks would load (f32 products). Super-blocks are gcd(K, 256)
  rows (the embedded model's K = 576 is not a multiple of 256). Plain RTN, not llama.cpp's
  error-minimising search: the weights differ, the value set does not. The symmetric
  formats' scales are signed, as llama.cpp's make_qx_quants sets them: a group's value
  of largest magnitude takes the lowest code (-4 in Q3_K, -32 in Q6_K) whatever its sign
  (positive scales clipped a positive peak at +3 / +31 steps: 15-20% more error), and
  the super-block's scale of largest magnitude the lowest scale code (-32 / -128)."""
  from pallas_kernels.quantized_tensor import QuantizedTensor, pack_int4

  group, lo, hi, sc_max, m_max = KQUANTS[kind]
  k, n = w.shape
  sb = np.gcd(k, 256)
  wg = w.astype(np.float32).reshape(k // sb, sb // group, group, n)
  f16 = lambda a: a.astype(np.float16).astype(np.float32)
  safe = lambda a: np.where(a != 0, a, 1)
  if m_max is None:  # symmetric: w = d sc q, d and sc signed
    peak = np.take_along_axis(wg, np.abs(wg).argmax(axis=2)[:, :, None], axis=2)[:, :, 0]
    s = peak / lo  # the peak is code `lo`
    # The same one level up: the scale of largest magnitude is scale code -(sc_max + 1).
    top = np.take_along_axis(s, np.abs(s).argmax(axis=1)[:, None], axis=1)
    d = f16(top / -(sc_max + 1))
    scale = d * np.clip(np.round(s / safe(d)), -(sc_max + 1), sc_max)
    minimum = None
    q = np.clip(np.round(wg / safe(scale)[:, :, None]), lo, hi)
  else:  # w = d sc q - dmin m, with the min the group's lowest value (or 0)
    low = np.minimum(wg.min(axis=2), 0)
    s = (wg.max(axis=2) - low) / hi
    d = f16(s.max(axis=1, keepdims=True) / sc_max)
    dmin = f16((-low).max(axis=1, keepdims=True) / m_max)
    scale = d * np.clip(np.round(s / safe(d)), 0, sc_max)
    minimum = -(dmin * np.clip(np.round(-low / safe(dmin)), 0, m_max))
    q = np.clip(np.round((wg - minimum[:, :, None]) / safe(scale)[:, :, None]), lo, hi)
  q = q.reshape(k, n)
  flat = lambda a: None if a is None else a.reshape(k // group, n).astype(np.float32)
  bits = 4 if lo >= 0 and hi <= 15 else 8
  packed = pack_int4(q.astype(np.uint8)) if bits == 4 else q.astype(np.int8)
  return QuantizedTensor(packed=packed, scale=flat(scale), minimum=flat(minimum), bits=bits,
                         group_size=group)


def kquantize_params(params, kind: str):
  """Every matrix of a parameter tree re-encoded into `kind`'s value set."""
  from pallas_kernels.quantized_tensor import QuantizedTensor, dequantize

  def convert(w):
    if isinstance(w, QuantizedTensor):
      return kquantize(np.asarray(dequantize(w)), kind)
    return kquantize(np.asarray(w), kind) if np.ndim(w) == 2 else w

  out = {k: convert(v) for k, v in params.items() if k != "layers"}
  out["layers"] = [{k: convert(v) for k, v in layer.items()} for layer in params["layers"]]
  return out


if __name__ == "__main__":
  sys.exit(main())
