"""The serving engine on a GPU: Pallas kernels against the XLA reference, and throughput.

No checkpoint travels to the GPU machine (the embedded GGUF is larger than what
one device call may carry), so the model is SmolLM2-135M-*shaped* (576 wide, 9/3
heads of 64, FFN 1536, vocab 49152, tied head) with random weights quantized
like Q4_1 (4-bit, group 32, scale + minimum). Values do not change the work done
per token, so throughput is that of the real model; the correctness check
compares two backends on the same weights, which is what it needs.

  correctness: the engine with backend "pallas" (quantized matmul, paged prefill
    and decode attention kernels), the same on a one-device tensor-parallel mesh, and
    with backend "reference" (XLA; dense f32 weights dequantized from the same 4-bit
    values), random prompts of 5 tokens up to --max-prompt,
    greedy, new tokens with logprobs: share of identical tokens (common prefix
    per sequence) and the largest |log p| difference on the common prefix.
  throughput: aggregate generated tok/s at each concurrency, both backends, at each
    number of decode steps per device call (--decode-steps 1,8: 1 is a host
    round trip per token). A warm-up run compiles every program a timed run needs:
    every engine's at once, on threads, then the timed runs one at a time
    (--serial-warmup: each engine's right before its timed run).
  ablate: the Pallas path with one op at a time sent to the XLA reference
    (quantized matmul / decode attention / prefill attention), at one
    concurrency: which op makes the Pallas path slow.
  hf: the peer in the same run: HF transformers `LlamaForCausalLM` of the same
    shape, random init, bf16, `generate` (greedy, exactly --new-tokens) at each
    concurrency.
  speculative: speculative decoding against plain decoding on one engine per
    concurrency (--backends: its first), with scripts/bench_speculative.py's
    `measure` (every K bucket compiled first, warm-up, timed run; tokens
    compared): prompt lookup, early exit at layer 8, and a draft model with the
    target's own weights. Random weights set the acceptance: the same-weights
    draft model is accepted (nearly) always, the early exit (nearly) never, so
    the rows bound what a trained checkpoint's drafters can do on this device
    (the best case, and that adaptive K never loses much).
  profile: one warm engine run under jax.profiler (Python tracer off): each device
    line's busy time against the run's wall time, the kernels, XLA ops and modules
    that take the device's time, the host's busiest lines (issue 14: where a decode
    step's time goes).
  controller: self-consistency (n=8) through the reasoning controller's device loop
    against the engine sampling the same rows (prompts x 8): generated tok/s (issue 14's
    controller target: >= 0.7x the engine's).
  --shape llama3-8b (throughput, hf): a Llama-3-8B-shaped model with random
    weights made on the device: the engine with int4 weights (pallas) vs dense
    bf16 weights (reference backend, bf16 matmuls).

  python scripts/gpu_engine_check.py correctness [--layers 2] [--sequences 8] [--max-prompt 120]
      [--new-tokens 16] [--interpret] [--matmul-dtype float32|float8] [--out F]
  python scripts/gpu_engine_check.py throughput [--layers 30] [--concurrency 1,64]
      [--new-tokens 128] [--backends pallas,reference] [--decode-steps 1,8] [--serial-warmup]
      [--out F]
  python scripts/gpu_engine_check.py ablate [--concurrency 64] [--out F]
  python scripts/gpu_engine_check.py hf [--concurrency 1,64,256] [--shape smollm2|llama3-8b]
      [--out F]
  python scripts/gpu_engine_check.py speculative [--concurrency 1,64] [--new-tokens 128]
      [--max-drafts 7] [--backends pallas] [--out F]
  python scripts/gpu_engine_check.py profile [--concurrency 64] [--backends pallas] [--out F]
  python scripts/gpu_engine_check.py controller [--concurrency 64] [--new-tokens 128]
      [--backends pallas] [--out F]

On a CPU, correctness with --interpret runs the kernels in Pallas interpret
mode (slow; use --layers 1); the other modes run with --backends reference only (the
Pallas kernels compile for a GPU: refused in one line, not a traceback).
"""

from __future__ import annotations

import pathlib
import argparse
import functools
import json
import sys
import time

import numpy as np
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # (sibling modules)
from script_args import output_file  # noqa: E402

SMOLLM2_SHAPE = dict(d_model=576, n_heads=9, n_kv_heads=3, head_dim=64, ffn_dim=1536,
                     vocab_size=49152, rope_theta=100000.0, rms_eps=1e-5)
LLAMA3_8B_SHAPE = dict(d_model=4096, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=14336,
                       vocab_size=128256, rope_theta=500000.0, rms_eps=1e-5)
SHAPES = {"smollm2": (SMOLLM2_SHAPE, 30, True), "llama3-8b": (LLAMA3_8B_SHAPE, 32, False)}


def random_model_params(n_layers: int, seed: int = 0, max_context: int = 2048):
  """(ModelConfig, params) of a SmolLM2-shaped model with 4-bit random weights."""
  from o1jax.checkpoint.model_config import ModelConfig
  from pallas_kernels.quantized_tensor import quantize

  c = ModelConfig(n_layers=n_layers, max_context=max_context, tie_embeddings=True, bos_id=1,
                  eos_ids=(2,), architecture="llama", name="smollm2-shaped-random",
                  **SMOLLM2_SHAPE)
  rng = np.random.default_rng(seed)

  def q4(k, n):  # [K, N] with unit-variance outputs
    return quantize(rng.standard_normal((k, n), np.float32) / np.sqrt(k), bits=4, group_size=32,
                    symmetric=False)

  def norm(n):
    return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

  d, f, hd = c.d_model, c.ffn_dim, c.head_dim
  layers = [{"attn_norm": norm(d), "wq": q4(d, c.n_heads * hd), "wk": q4(d, c.n_kv_heads * hd),
             "wv": q4(d, c.n_kv_heads * hd), "wo": q4(c.n_heads * hd, d), "ffn_norm": norm(d),
             "w_gate": q4(d, f), "w_up": q4(d, f), "w_down": q4(f, d)} for _ in range(n_layers)]
  # embed is [d_model, vocab] like the GGUF loader's; std 0.15 puts the tied
  # head's logits at std ~3.5 (RMS-normed inputs have norm ~24): log p of the
  # chosen tokens is far from 0, and the top two are rarely near-ties.
  embed = quantize(0.15 * rng.standard_normal((d, c.vocab_size), np.float32), bits=4,
                   group_size=32, symmetric=False)
  return c, {"embed": embed, "layers": layers, "final_norm": norm(d)}


def random_device_params(shape: dict, n_layers: int, tied: bool, dense_bf16: bool, seed: int = 0,
                         max_context: int = 4096):
  """(ModelConfig, params) with random weights made on the device (nothing travels).

  int4: random packed codes and per-group scales (Q4_0 layout, std ~1/sqrt(K) per
  output); dense_bf16: bf16 matrices of the same statistics. The values only need
  to be finite and non-degenerate: the work per token does not depend on them."""
  import jax
  import jax.numpy as jnp

  from o1jax.checkpoint.model_config import ModelConfig
  from pallas_kernels.quantized_tensor import QuantizedTensor

  c = ModelConfig(n_layers=n_layers, max_context=max_context, tie_embeddings=tied, bos_id=1,
                  eos_ids=(2,), architecture="llama", name="random-" + str(shape["d_model"]),
                  **shape)
  keys = iter(jax.random.split(jax.random.PRNGKey(seed), 16 * n_layers + 8))

  def matrix(k, n):
    if dense_bf16:
      return (jax.random.normal(next(keys), (k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    packed = jax.random.randint(next(keys), (k // 2, n), 0, 256, jnp.int32).astype(jnp.uint8)
    # (q - 8) has std ~4.6: scale so that each output has unit variance.
    scale = jnp.full((k // 32, n), 1.0 / (4.6 * np.sqrt(k)), jnp.float16)
    return QuantizedTensor(packed=packed, scale=scale, minimum=None, bits=4, group_size=32)

  def norm(n):
    return jnp.ones((n,), jnp.float32)

  d, f, hd = c.d_model, c.ffn_dim, c.head_dim
  layers = [{"attn_norm": norm(d), "wq": matrix(d, c.n_heads * hd),
             "wk": matrix(d, c.n_kv_heads * hd), "wv": matrix(d, c.n_kv_heads * hd),
             "wo": matrix(c.n_heads * hd, d), "ffn_norm": norm(d), "w_gate": matrix(d, f),
             "w_up": matrix(d, f), "w_down": matrix(f, d)} for _ in range(n_layers)]
  params = {"embed": matrix(d, c.vocab_size), "layers": layers, "final_norm": norm(d)}
  if not tied:
    params["head"] = matrix(d, c.vocab_size)
  return c, params


def byte_tokenizer():
  from o1jax.testing import _tiny_tokenizer

  return _tiny_tokenizer()  # ids past its 259 decode to "": only ids are compared here


def make_engine(config, params, backend: str, max_slots: int, interpret: bool = False,
                num_blocks: int = 2048, decode_steps: int = 8, matmul_dtype: str = "float32",
                weight_mode: str | None = None, kv_dtype: str = "float32", mesh=None):
  from o1jax.engine import Engine, EngineConfig
  from o1jax.model import Llama

  weight_mode = weight_mode or ("dense" if backend == "reference" else "quantized")
  model = Llama(config, params, backend=backend, interpret=interpret, weight_mode=weight_mode,
                matmul_dtype=matmul_dtype)
  cfg = EngineConfig(max_slots=max_slots, num_blocks=num_blocks, prefill_chunk=256,
                     kv_dtype=kv_dtype,
                     max_prefill_seqs=8, prefix_caching=False, decode_steps=decode_steps,
                     reuse_compiled_shapes=False)  # timed warm: no compile in a timed run
  return Engine(model, byte_tokenizer(), cfg, mesh=mesh)


def prompts(n: int, seed: int, low: int, high: int, vocab: int) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [rng.integers(3, vocab, size=int(rng.integers(low, high))).tolist() for _ in range(n)]


def common_prefix(a: list[int], b: list[int]) -> int:
  return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def correctness(args) -> dict:
  from o1jax.engine import GenerationParams, Request
  from o1jax.sharding.tensor_parallel import group_mesh

  config, params = random_model_params(args.layers)
  ps = prompts(args.sequences, seed=1, low=5, high=args.max_prompt, vocab=config.vocab_size)
  gp = GenerationParams(max_new_tokens=args.new_tokens, ignore_eos=True, logprobs=True)
  # The Pallas path twice: as is, and on a one-device tensor-parallel mesh placed by the
  # machine's topology (issue 20: the mesh code on a real GPU).
  variants = {"reference": ("reference", None), "pallas": ("pallas", None),
              "pallas, TP=1 mesh": ("pallas", group_mesh(1))}
  runs = {}

  def compare(got_runs):
    same, total, worst = 0, 0, 0.0
    for ref, got in zip(runs["reference"], got_runs):
      n = common_prefix(ref.token_ids, got.token_ids)
      same += n
      total += len(ref.token_ids)
      if n:
        worst = max(worst, float(np.max(np.abs(np.subtract(ref.logprobs[:n],
                                                           got.logprobs[:n])))))
    first = sum(r.token_ids[0] == g.token_ids[0] for r, g in zip(runs["reference"], got_runs))
    return same / total, worst, first

  out = {"layers": args.layers, "sequences": len(ps), "new_tokens": args.new_tokens,
         "matmul_dtype": args.matmul_dtype}
  # Each variant compared and written as it finishes: a stage cut by its time limit (or a
  # crash in the next variant) keeps what was measured.
  for label, (backend, mesh) in variants.items():
    engine = make_engine(config, params, backend, max_slots=len(ps), interpret=args.interpret,
                         matmul_dtype=args.matmul_dtype, mesh=mesh)
    t0 = time.perf_counter()
    runs[label] = engine.generate([Request(p, gp) for p in ps])
    print(f"{label}: {time.perf_counter() - t0:.1f} s, {sum(engine.trace_counts.values())} "
          f"programs compiled", flush=True)
    if label == "reference":
      continue
    share, worst, first = compare(runs[label])
    key = "" if label == "pallas" else "mesh_"
    out.update({f"{key}identical_token_share": share, f"{key}max_abs_logprob_diff": worst,
                f"{key}first_tokens_equal": first})
    _dump(args, out)
    print(f"{label} vs reference: {100 * share:.1f}% identical tokens (common prefix), first "
          f"token equal in {first}/{len(ps)}, max |log p diff| {worst:.2e}", flush=True)
  return out


# Seconds spent compiling, by JAX's compile events (tracing, lowering to MLIR, XLA's
# backend compile): summed by a listener registered in main().
COMPILE_SECONDS: dict[str, float] = {}
_listening = False


def _count_compile(event: str, seconds: float, **_) -> None:
  # A program loaded from the persistent cache (JAX_COMPILATION_CACHE_DIR) reports a
  # cache retrieval instead of a backend compile.
  if event.startswith(("/jax/core/compile/", "/jax/compilation_cache/")):
    name = event.rsplit("/", 1)[-1].removesuffix("_duration")
    COMPILE_SECONDS[name] = COMPILE_SECONDS.get(name, 0.0) + seconds


def _backend_compile_s() -> float:
  return COMPILE_SECONDS.get("backend_compile", 0.0)


def _dump(args, out: dict) -> None:
  """Write the rows so far to --out: a stage cut by its time limit keeps what it measured."""
  if args.out:
    with open(args.out, "w") as f:
      json.dump(out, f, indent=1)


def _timed_generate(engine, batch) -> tuple[float, float, int, int, float]:
  """(warm-up s, timed wall s, generated tokens, programs compiled, XLA compile s of the
  warm-up) of one workload. (Programs this engine traced: engines on an equal model
  share them, so a later engine compiles only the shapes no earlier one had.)"""
  compiled = _backend_compile_s()
  warm = _warm_up(engine, batch)
  compiled = _backend_compile_s() - compiled
  programs = sum(engine.trace_counts.values())
  wall, generated = _timed_run(engine, batch)
  return warm, wall, generated, programs, compiled


def _seconds(run) -> float:
  t0 = time.perf_counter()
  run()
  return time.perf_counter() - t0


def _warm_up(engine, batch) -> float:
  """Seconds of a first run of the workload: it compiles every program the timed run needs."""
  return _seconds(lambda: engine.generate(batch))


def _timed_run(engine, batch) -> tuple[float, int]:
  """(wall s, generated tokens) of a run of the workload."""
  t0 = time.perf_counter()
  results = engine.generate(batch)
  return time.perf_counter() - t0, sum(len(r.token_ids) for r in results)


def _warm_up_together(runs) -> tuple[list[float], float, float]:
  """Warm-up runs (callables: a first run of a workload, which compiles its programs) on
  threads at once: ([s per run], wall s, XLA compile s summed over them). XLA compiles
  without Python's lock, so the compiles of several engines overlap on a many-core host
  (one engine's warm-up took 32-111 s on an H200's host, 2026-12-04, most of it
  compiling); the timed runs come after, one at a time. (XLA's GEMM autotuning then times
  its candidates beside other work: the choice may differ from a lone compile's;
  --serial-warmup warms one engine at a time.)"""
  from concurrent.futures import ThreadPoolExecutor

  compiled = _backend_compile_s()
  t0 = time.perf_counter()
  with ThreadPoolExecutor(max_workers=len(runs)) as pool:
    seconds = list(pool.map(_seconds, runs))
  return seconds, time.perf_counter() - t0, _backend_compile_s() - compiled


def _engine_variants(args):
  """(label, config, params, make_engine kwargs) of the engines to time."""
  if args.shape == "smollm2":
    config, params = random_model_params(args.layers)
    return [(b, config, params, dict(backend=b, matmul_dtype=args.matmul_dtype))
            for b in args.backends.split(",")]
  if args.matmul_dtype != "float32":
    raise SystemExit(f"--matmul-dtype {args.matmul_dtype}: the smollm2 shape only (--shape "
                     f"{args.shape} compares int4 against bf16 weights)")
  shape, layers, tied = SHAPES[args.shape]
  layers = args.layers or layers
  c4, p4 = random_device_params(shape, layers, tied, dense_bf16=False)
  c16, p16 = random_device_params(shape, layers, tied, dense_bf16=True)
  return [("int4 pallas", c4, p4, dict(backend="pallas", weight_mode="quantized")),
          ("bf16 reference", c16, p16, dict(backend="reference", weight_mode="dense",
                                            matmul_dtype="bfloat16"))]


def throughput(args) -> dict:
  from o1jax.engine import GenerationParams, Request

  concurrency = [int(c) for c in args.concurrency.split(",")]
  gp = GenerationParams(max_new_tokens=args.new_tokens, ignore_eos=True)
  out = {"shape": args.shape, "layers": args.layers, "new_tokens": args.new_tokens,
         "matmul_dtype": args.matmul_dtype, "rows": []}
  variants = _engine_variants(args)
  if len({config.vocab_size for _, config, _, _ in variants}) != 1:
    raise SystemExit("throughput: the engines compared must share a vocabulary (same prompts)")
  ps = prompts(max(concurrency), seed=2, low=30, high=40, vocab=variants[0][1].vocab_size)
  # Concurrency outermost: a stage cut by its time limit keeps the engines' rows in pairs.
  runs = [(c, steps, label, config, params, kw) for c in concurrency
          for steps in [int(k) for k in args.decode_steps.split(",")]
          for label, config, params, kw in variants]
  engine_for = lambda c, steps, config, params, kw: make_engine(
      config, params, max_slots=c, decode_steps=steps,
      num_blocks=max(256, c * (args.new_tokens // 16 + 4)), **kw)
  batch_for = lambda c: [Request(p, gp) for p in ps[:c]]
  warmed = {}
  if not args.serial_warmup and len(runs) > 1:
    engines = [engine_for(c, steps, config, params, kw)
               for c, steps, _, config, params, kw in runs]
    seconds, wall, compile_s = _warm_up_together(
        [functools.partial(_warm_up, e, batch_for(run[0])) for e, run in zip(engines, runs)])
    out["warmup"] = {"together": len(runs), "wall_s": wall, "xla_compile_s": compile_s}
    print(f"warm-up of {len(runs)} engines together: {wall:.0f} s ({compile_s:.0f} s XLA "
          f"compile summed over them)", flush=True)
    warmed = dict(enumerate(zip(engines, seconds)))
    del engines  # each engine is freed after its timed run (`warmed.pop`)
    _dump(args, out)
  for i, (c, steps, label, config, params, kw) in enumerate(runs):
    if i in warmed:
      engine, warm = warmed.pop(i)
      compile_s = None  # counted for all of them together
      programs = sum(engine.trace_counts.values())
      wall, generated = _timed_run(engine, batch_for(c))
    else:
      engine = engine_for(c, steps, config, params, kw)
      warm, wall, generated, programs, compile_s = _timed_generate(engine, batch_for(c))
    row = {"engine": label, "decode_steps": steps, "concurrency": c,
           "gen_tok_s": generated / wall, "ms_per_step": 1e3 * wall / args.new_tokens,
           "warmup_s": warm, "xla_compile_s": compile_s, "programs": programs,
           "recompiled": sum(engine.trace_counts.values()) - programs}
    out["rows"].append(row)
    _dump(args, out)
    compiled = "" if compile_s is None else f" ({compile_s:.0f} s XLA compile)"
    print(f"{label:15s} steps/call {steps} c={c:4d}: {row['gen_tok_s']:9.1f} gen tok/s, "
          f"{row['ms_per_step']:.2f} ms per decode step (prefill included), "
          f"warm-up {warm:.0f} s{compiled}, {programs} programs", flush=True)
    del engine
  return out


def fresh_programs() -> None:
  """Forget every compiled program of the process (the engines' shared ones and JAX's)."""
  import jax

  from o1jax.engine import engine as engine_module
  engine_module._PROGRAMS.clear()
  jax.clear_caches()


def ablate(args) -> dict:
  """The Pallas path with one op at a time on the XLA reference."""
  from o1jax.engine import GenerationParams, Request
  from pallas_kernels import ops

  config, params = random_model_params(args.layers)
  c = int(args.concurrency.split(",")[-1])
  ps = prompts(c, seed=2, low=30, high=40, vocab=config.vocab_size)
  gp = GenerationParams(max_new_tokens=args.new_tokens, ignore_eos=True)
  originals = {name: getattr(ops, name) for name in
               ("quantized_matmul", "paged_decode_attention", "paged_prefill_attention")}
  out = {"concurrency": c, "layers": args.layers, "new_tokens": args.new_tokens, "rows": []}
  for on_reference in [None] + list(originals):
    for name, fn in originals.items():
      if name == on_reference:
        setattr(ops, name, lambda *a, _fn=fn, **k: _fn(*a, **{**k, "backend": "reference"}))
      else:
        setattr(ops, name, fn)
    # Engines of an equal model share their compiled programs (o1jax.engine.engine): the
    # swap above is read only when a program is traced, so each variant traces anew.
    fresh_programs()
    engine = make_engine(config, params, "pallas", max_slots=c,
                         num_blocks=max(256, c * (args.new_tokens // 16 + 4)))
    _, wall, generated, _, _ = _timed_generate(engine, [Request(p, gp) for p in ps])
    row = {"on_reference": on_reference or "none", "gen_tok_s": generated / wall,
           "ms_per_step": 1e3 * wall / args.new_tokens,
           "programs": sum(engine.trace_counts.values())}  # (0: another variant's programs)
    out["rows"].append(row)
    _dump(args, out)
    print(f"pallas, {row['on_reference']:24s} on XLA: {row['gen_tok_s']:9.1f} gen tok/s, "
          f"{row['ms_per_step']:.2f} ms per step", flush=True)
  for name, fn in originals.items():
    setattr(ops, name, fn)
  return out


def _line_summary(line, top: int) -> dict:
  """Events of one profiler line: count, busy time, span and the top names by total time."""
  totals: dict[str, list] = {}
  first, last, busy = None, None, 0.0
  for event in line.events:
    d = float(event.duration_ns)
    busy += d
    first = event.start_ns if first is None else min(first, event.start_ns)
    last = event.end_ns if last is None else max(last, event.end_ns)
    entry = totals.setdefault(event.name, [0, 0.0])
    entry[0] += 1
    entry[1] += d
  ranked = sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]
  return {"line": line.name, "events": sum(n for n, _ in totals.values()), "busy_ms": busy / 1e6,
          "span_ms": 0.0 if first is None else (last - first) / 1e6,
          "top": [{"name": name[:160], "count": n, "ms": ns / 1e6} for name, (n, ns) in ranked]}


def profile(args) -> dict:
  """One warm engine run (--backends: its first; --concurrency: its last) under
  jax.profiler with the Python tracer off: each device line's busy time against the
  run's wall time (the rest is the host's and the gaps between launches) and the
  kernels, XLA ops and modules that take the device's time; the host's busiest lines."""
  import glob
  import os
  import shutil
  import tempfile

  import jax
  from jax.profiler import ProfileData

  from o1jax.engine import GenerationParams, Request

  config, params = random_model_params(args.layers)
  backend = args.backends.split(",")[0]
  c = int(args.concurrency.split(",")[-1])
  steps = int(args.decode_steps.split(",")[0])
  ps = prompts(c, seed=2, low=30, high=40, vocab=config.vocab_size)
  gp = GenerationParams(max_new_tokens=args.new_tokens, ignore_eos=True)
  engine = make_engine(config, params, backend, max_slots=c, decode_steps=steps,
                       num_blocks=max(256, c * (args.new_tokens // 16 + 4)))
  batch = [Request(p, gp) for p in ps]
  t0 = time.perf_counter()
  engine.generate(batch)  # compiles every program of the traced run
  untraced = time.perf_counter() - t0  # compiling included
  log_dir = tempfile.mkdtemp()
  options = jax.profiler.ProfileOptions()
  options.python_tracer_level = 0
  t0 = time.perf_counter()
  with jax.profiler.trace(log_dir, profiler_options=options):
    results = engine.generate(batch)
  wall = time.perf_counter() - t0
  traces = glob.glob(os.path.join(log_dir, "**", "*.xplane.pb"), recursive=True)
  if not traces:
    raise RuntimeError(f"profile: jax.profiler wrote no .xplane.pb under {log_dir}")
  path = traces[0]
  out = {"backend": backend, "concurrency": c, "decode_steps": steps, "layers": args.layers,
         "new_tokens": args.new_tokens, "generated": sum(len(r.token_ids) for r in results),
         "warmup_wall_s": untraced, "traced_wall_s": wall,
         "trace_bytes": os.path.getsize(path), "device_lines": [], "host_lines": []}
  _dump(args, out)
  for plane in ProfileData.from_file(path).planes:
    if plane.name.startswith("/device:"):
      out["device_lines"] += [dict(plane=plane.name, **_line_summary(line, 25))
                              for line in plane.lines]
    elif plane.name.startswith("/host:"):
      out["host_lines"] += [dict(plane=plane.name, **_line_summary(line, 12))
                            for line in plane.lines]
  out["host_lines"] = sorted(out["host_lines"], key=lambda r: -r["busy_ms"])[:8]
  print(f"{backend} c={c} steps/call {steps}: wall {wall:.2f} s traced, {untraced:.2f} s "
        f"warm-up (compiles)", flush=True)
  for row in out["device_lines"] + out["host_lines"]:
    print(f"{row['plane']} | {row['line']}: {row['events']} events, busy {row['busy_ms']:.1f} ms "
          f"over {row['span_ms']:.1f} ms", flush=True)
    for top in row["top"][:6]:
      print(f"    {top['ms']:9.2f} ms {top['count']:6d}x {top['name'][:100]}", flush=True)
  if args.out and out["trace_bytes"] < 8 << 20:
    shutil.copy(path, os.path.splitext(args.out)[0] + ".xplane.pb")
  shutil.rmtree(log_dir, ignore_errors=True)
  return out


def load_script(name: str):
  """Another script of this directory as a module (scripts/ is not a package)."""
  import importlib.util
  import pathlib

  spec = importlib.util.spec_from_file_location(name, pathlib.Path(__file__).parent / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def repeat_prompts(n: int, vocab: int, seed: int = 3) -> list[list[int]]:
  """Copy-shaped token prompts: a random passage of 48 tokens, the passage again, and
  its first 8 tokens a third time (prompt lookup drafts the passage's rest)."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    passage = rng.integers(3, vocab, size=48).tolist()
    out.append(passage + passage + passage[:8])
  return out


def speculative(args) -> dict:
  """Per concurrency, one engine: plain, each drafter (adaptive K), plain again; the
  ratios are to the mean of the two plain runs. Each run is written to --out as it
  finishes (a stage cut by its time limit keeps the runs it measured)."""
  from o1jax.engine import SpeculativeConfig
  from o1jax.model import Llama

  bench = load_script("bench_speculative")
  config, params = random_model_params(args.layers)
  backend = args.backends.split(",")[0]
  same_weights = Llama(config, params, backend=backend,
                       weight_mode="dense" if backend == "reference" else "quantized")
  drafters = [("prompt_lookup", SpeculativeConfig(max_drafts=args.max_drafts), None),
              ("early_exit:8", SpeculativeConfig(drafter="early_exit",
                                                 exit_layer=min(8, args.layers - 1),
                                                 max_drafts=args.max_drafts), None),
              ("draft_model:same", SpeculativeConfig(drafter="draft_model",
                                                     max_drafts=args.max_drafts), same_weights)]
  opts = argparse.Namespace(max_new_tokens=args.new_tokens)
  out = {"layers": args.layers, "new_tokens": args.new_tokens, "max_drafts": args.max_drafts,
         "backend": backend, "rows": []}
  for c in [int(x) for x in args.concurrency.split(",")]:
    engine = make_engine(config, params, backend, max_slots=c,
                         num_blocks=max(256, c * ((112 + args.new_tokens) // 16 + 4)))
    batch = [(p, ()) for p in repeat_prompts(max(c, 4), config.vocab_size)]
    runs = []
    for name, spec, draft in [("plain", None, None), *drafters, ("plain (again)", None, None)]:
      runs.append((name, bench.measure(engine, batch, opts, spec, draft)))
      # A stage cut by its time limit keeps the runs it measured (ratios come at the end).
      out["partial"] = {"concurrency": c, "runs": [
          {"config": n, **{k: v for k, v in r.items() if k != "tokens"}} for n, r in runs]}
      _dump(args, out)
    del out["partial"]
    base = (runs[0][1]["decode_tok_s"] + runs[-1][1]["decode_tok_s"]) / 2
    for name, r in runs:
      row = {"concurrency": c, "config": name, "decode_ratio": r["decode_tok_s"] / base,
             "same_tokens": r["tokens"] == runs[0][1]["tokens"],
             **{k: v for k, v in r.items() if k != "tokens"}}
      out["rows"].append(row)
      print(f"c={c:3d} {name:16s} {r['decode_tok_s']:9.1f} decode tok/s "
            f"{row['decode_ratio']:5.2f}x plain, accept {r['acceptance_rate']:.2f}, "
            f"{100 * r['verify_share']:3.0f}% verify calls, same tokens {row['same_tokens']}, "
            f"compiled in timed run {r['compiled_in_timed_run']}", flush=True)
    _dump(args, out)
    del engine
  return out


def controller(args) -> dict:
  """Self-consistency (n=8 sampled traces per prompt, each prompt's blocks shared) through
  the reasoning controller's device loop on the paged cache, against the engine sampling
  the same rows (prompts x 8, `GenerationParams(n=8)`), per concurrency (= rows): generated
  tokens per second of each, timed warm (first runs of both compile every program, at
  once unless --serial-warmup)."""
  from o1jax.controller import Controller, build_decode_model
  from o1jax.engine import GenerationParams, Request
  from o1jax.model import Llama

  n = 8
  config, params = random_model_params(args.layers)
  backend = args.backends.split(",")[0]
  weight_mode = "dense" if backend == "reference" else "quantized"
  model = Llama(config, params, backend=backend, weight_mode=weight_mode,
                matmul_dtype=args.matmul_dtype)
  # Thinking and answer budgets that add up to --new-tokens per trace; random weights rarely
  # end a trace early, on either side.
  # Both sides sample alike (temperature 0.8, --top-p): with top-p below 1 a random
  # model's flat rows keep more tokens than the sampler's candidates and take its
  # whole-row threshold search, on both sides.
  policy = {"name": "self_consistency", "n": n, "max_thinking_tokens": args.new_tokens - 16,
            "max_answer_tokens": 16, "temperature": 0.8, "top_p": args.top_p}
  out = {"layers": args.layers, "new_tokens": args.new_tokens, "n": n, "backend": backend,
         "kv_dtype": args.kv_dtype, "top_p": args.top_p, "rows": []}
  for rows in [int(c) for c in args.concurrency.split(",")]:
    ps = prompts(max(1, rows // n), seed=4, low=30, high=40, vocab=config.vocab_size)
    ctl = Controller(build_decode_model(model, {"cache": "paged", "kv_dtype": args.kv_dtype}),
                     byte_tokenizer(), max_rows=max(n, rows))
    engine = make_engine(config, params, backend, max_slots=max(n, rows),
                         num_blocks=max(256, rows * (args.new_tokens // 16 + 4)),
                         matmul_dtype=args.matmul_dtype, weight_mode=weight_mode,
                         kv_dtype=args.kv_dtype)
    gp = GenerationParams(max_new_tokens=args.new_tokens, n=n, temperature=0.8,
                          top_p=args.top_p, seed=1, ignore_eos=True)
    # First runs compile, both sides at once (`_warm_up_together`); then each is timed alone.
    warm = [lambda: ctl.run(ps, policy), lambda: engine.generate([Request(p, gp) for p in ps])]
    if args.serial_warmup:
      for run in warm:
        run()
    else:
      _warm_up_together(warm)
    t0 = time.perf_counter()
    results = ctl.run(ps, policy)
    ctl_s = time.perf_counter() - t0
    ctl_tokens = sum(r.tokens.generated for r in results)
    t0 = time.perf_counter()
    done = engine.generate([Request(p, gp) for p in ps])
    wall = time.perf_counter() - t0
    engine_tokens = sum(len(sample.token_ids) for r in done for sample in r.samples)
    row = {"rows": len(ps) * n, "controller_tok_s": ctl_tokens / ctl_s,
           "engine_tok_s": engine_tokens / wall, "controller_tokens": ctl_tokens,
           "engine_tokens": engine_tokens}
    row["ratio"] = row["controller_tok_s"] / row["engine_tok_s"]
    out["rows"].append(row)
    _dump(args, out)
    print(f"rows={row['rows']:3d}: controller {row['controller_tok_s']:9.1f} gen tok/s, engine "
          f"{row['engine_tok_s']:9.1f} gen tok/s ({row['ratio']:.2f}x)", flush=True)
  return out


def hf(args) -> dict:
  """HF transformers, same shape, random init, bf16 on the GPU, `generate` greedy."""
  import torch
  import transformers

  if args.matmul_dtype != "float32":
    raise SystemExit(f"--matmul-dtype {args.matmul_dtype}: the smollm2 shape only (--shape "
                     f"{args.shape} compares int4 against bf16 weights)")
  shape, layers, tied = SHAPES[args.shape]
  layers = args.layers or layers
  cfg = transformers.LlamaConfig(
      vocab_size=shape["vocab_size"], hidden_size=shape["d_model"],
      intermediate_size=shape["ffn_dim"], num_hidden_layers=layers,
      num_attention_heads=shape["n_heads"], num_key_value_heads=shape["n_kv_heads"],
      head_dim=shape["head_dim"], rope_theta=shape["rope_theta"], rms_norm_eps=shape["rms_eps"],
      tie_word_embeddings=tied, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
      pad_token_id=0)
  torch.manual_seed(0)
  with torch.device("cuda"):
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
  out = {"shape": args.shape, "layers": layers, "new_tokens": args.new_tokens,
         "torch": torch.__version__, "transformers": transformers.__version__, "rows": []}
  for c in [int(x) for x in args.concurrency.split(",")]:
    ps = prompts(c, seed=2, low=30, high=40, vocab=shape["vocab_size"])
    width = max(map(len, ps))
    ids = torch.zeros((c, width), dtype=torch.long)
    mask = torch.zeros((c, width), dtype=torch.long)
    for i, p in enumerate(ps):  # left padding
      ids[i, width - len(p):] = torch.tensor(p)
      mask[i, width - len(p):] = 1
    ids, mask = ids.cuda(), mask.cuda()
    kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=args.new_tokens,
              min_new_tokens=args.new_tokens, pad_token_id=0)
    with torch.inference_mode():
      model.generate(ids, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
      torch.cuda.synchronize()
      t0 = time.perf_counter()
      gen = model.generate(ids, **kw)
      torch.cuda.synchronize()
      wall = time.perf_counter() - t0
    row = {"concurrency": c, "gen_tok_s": (gen.shape[1] - width) * c / wall,
           "ms_per_step": 1e3 * wall / args.new_tokens}
    out["rows"].append(row)
    _dump(args, out)
    print(f"transformers bf16 c={c:4d}: {row['gen_tok_s']:9.1f} gen tok/s, "
          f"{row['ms_per_step']:.2f} ms per step", flush=True)
  return out


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("mode", choices=("correctness", "throughput", "ablate", "hf", "speculative",
                                   "controller", "profile"))
  ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
  ap.add_argument("--decode-steps", default="8")
  ap.add_argument("--layers", type=int, default=None)
  ap.add_argument("--new-tokens", type=int, default=None)
  ap.add_argument("--interpret", action="store_true")
  ap.add_argument("--sequences", type=int, default=8)
  ap.add_argument("--max-prompt", type=int, default=120)
  ap.add_argument("--concurrency", default="1,64")
  ap.add_argument("--backends", default="pallas,reference")
  ap.add_argument("--max-drafts", type=int, default=7)
  ap.add_argument("--kv-dtype", default="bfloat16", help="controller: both sides' KV pools")
  ap.add_argument("--top-p", type=float, default=1.0, help="controller: both sides' top-p "
                  "(the self_consistency policy's own default is 0.95)")
  ap.add_argument("--matmul-dtype", default="float32",
                  help="the Llama's matmul_dtype (smollm2 shape; float8: FP8 activations)")
  ap.add_argument("--serial-warmup", action="store_true",
                  help="throughput, controller: warm each engine up alone (default: every "
                  "engine's warm-up at once, on threads, then the timed runs one at a time)")
  ap.add_argument("--out", type=output_file)
  args = ap.parse_args(argv)
  import jax

  if jax.default_backend() != "gpu":  # (the Pallas kernels compile for a GPU only)
    here = f"jax's backend here is {jax.default_backend()}"
    if args.mode == "correctness" and not args.interpret:
      ap.error(f"correctness compiles the Pallas kernels for a GPU ({here}): add --interpret")
    if args.mode not in ("correctness", "hf") and "pallas" in args.backends.split(","):
      ap.error(f"{args.mode} with backend pallas needs a GPU ({here}): pass --backends reference")

  global _listening
  if not _listening:  # once per process: a second main() would count every event twice
    jax.monitoring.register_event_duration_secs_listener(_count_compile)
    _listening = True
  COMPILE_SECONDS.clear()  # this run's
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
  if args.mode == "correctness":
    args.layers = args.layers or 2
    args.new_tokens = args.new_tokens or 16
    result = correctness(args)
  else:
    if args.shape == "smollm2":
      args.layers = args.layers or SHAPES["smollm2"][1]
    args.new_tokens = args.new_tokens or 128
    result = {"throughput": throughput, "ablate": ablate, "hf": hf, "speculative": speculative,
              "controller": controller, "profile": profile}[args.mode](args)
  result["device"] = jax.devices()[0].device_kind
  result["compile_seconds"] = dict(COMPILE_SECONDS)
  print("compile seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in COMPILE_SECONDS.items()),
        flush=True)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
