"""Run by test_tensor_parallel.py in a process of its own (8 forced CPU devices: XLA_FLAGS
must be set before jax is imported). Prints one JSON object of what the test checks."""

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from o1jax.checkpoint import load_checkpoint  # noqa: E402
from o1jax.compilation_cache import enable_compilation_cache  # noqa: E402
from o1jax.engine import Engine, EngineConfig, GenerationParams, Request  # noqa: E402
from o1jax.model import KVCache, Llama  # noqa: E402
from o1jax.sharding import DecodeCollectives, tensor_parallel  # noqa: E402
from o1jax.testing import tiny_config, write_hf_checkpoint  # noqa: E402


def tiny(n_kv_heads: int, matmul_dtype: str = "float32"):
  path = tempfile.mkdtemp()
  write_hf_checkpoint(path, tiny_config(max_context=256, n_kv_heads=n_kv_heads), seed=3)
  ck = load_checkpoint(path)
  params = dict(ck.params)
  params["embed"] = np.asarray(params["embed"]) * 0.05  # spread-out next-token distributions
  return Llama(ck.config, params, matmul_dtype=matmul_dtype), ck.tokenizer


def mesh_of(tp: int, data: int = 1):
  return jax.make_mesh((data, tp), ("data", "model"), devices=jax.devices()[:data * tp])


def generate(model, tokenizer, mesh, kv_dtype: str, prompts, max_new_tokens: int = 20):
  """Greedy and sampled tokens of every prompt; on a mesh, also the compiled decode
  program's collective ops."""
  engine = Engine(model, tokenizer, EngineConfig(max_slots=8, num_blocks=96, prefill_chunk=32,
                                                  kv_dtype=kv_dtype), mesh=mesh)
  collectives = DecodeCollectives(engine) if mesh is not None else None
  requests = [Request(p, GenerationParams(max_new_tokens=max_new_tokens, temperature=t), i)
              for i, p in enumerate(prompts) for t in (0.0, 0.8)]
  tokens = [r.samples[0].token_ids for r in engine.generate(requests)]
  return tokens, engine, collectives.counts() if collectives else None


def controller_cases(prompts):
  """The controller's loop on a TP=2 mesh against one device: self-consistency (4 sampled
  traces sharing each prompt's blocks, a backtracking verifier) and greedy, on the paged
  cache (bf16 pools) and the contiguous one (f32). Two more prompts extend a 40-token
  prefix of their own: the admission computes it once (`plan_shared_prefixes`)."""
  from o1jax.controller import Controller, LoopSettings, ReasoningRequest, build_decode_model

  model, tok = tiny(2)
  prefix = np.random.default_rng(1).integers(3, 259, 40).tolist()
  prompts = list(prompts) + [prefix + [5, 6, 7], prefix + [9]]
  requests = [ReasoningRequest(prompt=p, request_id=i, seed=7) for i, p in enumerate(prompts)]
  # Steps of 6 tokens whose geometric-mean probability (~1/259 with these soft logits)
  # is below 0.01 are retried once: every trace backtracks.
  sampled = LoopSettings(temperature=0.8, max_thinking_tokens=18, max_answer_tokens=4,
                         step_max_tokens=6, backtrack_threshold=0.01, max_step_backtracks=1,
                         max_backtracks=2)
  greedy = LoopSettings(max_thinking_tokens=16, max_answer_tokens=4)
  out = {}
  for cache, kv in (("paged", "bfloat16"), ("contiguous", "float32")):
    runs = {}
    for label, mesh in (("one", None), ("tp2", mesh_of(2))):
      decode_model = build_decode_model(model, {"cache": cache, "kv_dtype": kv}, mesh=mesh)
      ctl = Controller(decode_model, tok, max_rows=8)  # 2 requests x 4 traces at a time
      batch = ctl.generate(requests, sampled, 4)
      runs[label] = dict(
          sampled=[[t.token_ids for t in ts] for ts in batch.traces],
          actions=[[[s.action for s in t.steps] for t in ts] for ts in batch.traces],
          greedy=[ts[0].token_ids for ts in ctl.generate(requests, greedy, 1).traces])
      if mesh is not None:  # the cache really is split by KV heads
        probe = decode_model.init_cache(2, 32)
        pool = probe.pages.k_pages[0] if cache == "paged" else probe.k[0]
        runs[label]["cache_spec"] = str(pool.sharding.spec)
    one, tp2 = runs["one"], runs["tp2"]
    out[f"{cache}_{kv}"] = dict(
        same_sampled=one["sampled"] == tp2["sampled"], same_actions=one["actions"] == tp2["actions"],
        same_greedy=one["greedy"] == tp2["greedy"],
        cache_spec=tp2["cache_spec"],
        backtracks=sum(a.count("backtrack") for ts in one["actions"] for a in ts),
        tokens=sum(len(t) for ts in one["sampled"] for t in ts))
  return out


def replica_cases(prompts):
  """Data parallelism: 2 engine replicas (TP=1 each, and TP=2 each on 4 devices) against
  one engine: the same tokens, greedy and sampled, each replica on its own devices."""
  from o1jax.engine import EngineReplicas

  model, tok = tiny(2)
  requests = [Request(p, GenerationParams(max_new_tokens=16, temperature=t), i)
              for i, p in enumerate(prompts * 2) for t in (0.0, 0.8)]
  one = Engine(model, tok, EngineConfig(max_slots=8, num_blocks=96, prefill_chunk=32))
  want = [r.samples[0].token_ids for r in one.generate(requests)]
  out = {}
  for tp in (1, 2):
    engines = EngineReplicas(model, tok, EngineConfig(max_slots=8, num_blocks=96,
                                                      prefill_chunk=32, data_parallel=2,
                                                      tensor_parallel=tp))
    got = [r.samples[0].token_ids for r in engines.generate(requests)]
    devices = [sorted(d.id for d in e.cache.k_pages[0].sharding.device_set)
               for e in engines.engines]
    out[f"dp2_tp{tp}"] = dict(same_tokens=got == want, devices=devices,
                              requests_per_replica=[e.metrics.summary()["requests"]
                                                    for e in engines.engines])
  # One engine's TP group on devices the caller picks (build_engine's devices= with
  # data_parallel=1 was a TypeError).
  from o1jax.engine import build_engine
  placed = build_engine(model, tok, EngineConfig(max_slots=8, num_blocks=96, prefill_chunk=32,
                                                 tensor_parallel=2), devices=jax.devices()[4:])
  got = [r.samples[0].token_ids for r in placed.generate(requests)]
  out["build_engine_tp2_devices"] = dict(
      same_tokens=got == want,
      devices=sorted(d.id for d in placed.cache.k_pages[0].sharding.device_set))
  return out


def sampling_case():
  """`sample` on vocabulary-split logits (a split head's output) against one device, every
  path at once: top-p inside the candidates (peaked rows), the whole-row threshold search
  (flat rows), top-k, unfiltered, a greedy row beside them. (The tiny model's byte
  vocabulary never leaves the candidates.)"""
  from jax.sharding import NamedSharding, PartitionSpec

  from o1jax.model.sampling import sample

  b, v = 8, 1000
  rng = np.random.default_rng(0)
  x = (0.5 * rng.standard_normal((b, v))).astype(np.float32)
  x[::2, :3] += 30.0
  keys = jax.random.split(jax.random.PRNGKey(1), b)
  params = (jnp.asarray([0.9] * 7 + [0.0]), jnp.asarray([0, 0, 0, 0, 40, 40, 0, 0], jnp.int32),
            jnp.asarray([0.95, 0.95, 0.95, 0.95, 1.0, 1.0, 1.0, 1.0]), jnp.zeros((b,)))
  want = np.asarray(jax.jit(sample)(jnp.asarray(x), keys, *params)).tolist()
  mesh = tensor_parallel.auto_mesh(mesh_of(2))
  with jax.set_mesh(mesh):
    split = jax.device_put(jnp.asarray(x), NamedSharding(mesh, PartitionSpec(None, "model")))
    got = np.asarray(jax.jit(sample)(split, keys, *params)).tolist()
  return dict(same_tokens=got == want, tokens=got)


def main():
  enable_compilation_cache()  # as the suite's own processes (tests/conftest.py)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(3, 259, size=int(rng.integers(3, 40))).tolist() for _ in range(4)]
  out = {}
  for n_kv, tp, kv_dtype in ((2, 2, "float32"), (4, 4, "float32"), (2, 2, "bfloat16"),
                             (2, 2, "float8_e4m3fn")):
    model, tok = tiny(n_kv)
    want, one_device, _ = generate(model, tok, None, kv_dtype, prompts)
    got, engine, ops = generate(model, tok, mesh_of(tp), kv_dtype, prompts)
    sharded = tensor_parallel.shard_model(model, tensor_parallel.auto_mesh(mesh_of(tp)))
    ids = jnp.asarray([prompts[0][:16]], jnp.int32)
    starts = jnp.zeros((1,), jnp.int32)
    ref, _ = model(ids, starts, KVCache.zeros(model.config, 1, 16))
    with jax.set_mesh(tensor_parallel.auto_mesh(mesh_of(tp))):
      par, _ = sharded(ids, starts, KVCache.zeros(model.config, 1, 16))
    out[f"tp{tp}_kv{n_kv}_{kv_dtype}"] = dict(
        same_tokens=got == want, traces=dict(engine.trace_counts),
        one_device_traces=dict(one_device.trace_counts), collectives=ops,
        layers=model.config.n_layers,
        pool_spec=str(engine.cache.k_pages[0].sharding.spec),
        scale_spec=str(engine.cache.k_scale[0].sharding.spec) if engine.cache.is_fp8 else None,
        wq_spec=str(sharded.layers[0].wq.get_value().sharding.spec),
        wo_spec=str(sharded.layers[0].wo.get_value().sharding.spec),
        max_logit_diff=float(np.max(np.abs(np.asarray(ref) - np.asarray(par)))))
  # FP8 activations (matmul_dtype="float8"): a row's scale is its largest magnitude, over
  # the whole row also where the row is split (the inputs of wo and w_down).
  model, tok = tiny(2, "float8")
  want, _, _ = generate(model, tok, None, "float32", prompts)
  got, _, ops = generate(model, tok, mesh_of(2), "float32", prompts)
  out["fp8_tp2"] = dict(same_tokens=got == want, collectives=ops, layers=model.config.n_layers)
  out["controller"] = controller_cases(prompts)
  out["replicas"] = replica_cases(prompts)
  out["sampling"] = sampling_case()
  model, tok = tiny(2)
  try:
    tensor_parallel.shard_model(model, tensor_parallel.auto_mesh(mesh_of(4)))
    out["tp4_kv2_error"] = None
  except ValueError as e:
    out["tp4_kv2_error"] = str(e)
  out["errors"] = setting_errors(model, tok)
  out["quantized"] = quantized_case(prompts)
  out["kernels"] = kernel_cases(prompts)
  json.dump(out, sys.stdout)


def kernel_cases(prompts) -> dict:
  """4-bit weights on a TP=2 mesh against one device: XLA's product of the dequantized
  codes (reference backend), and the Pallas kernels (interpreted on this CPU, as a GPU
  runs them compiled: the quantized matmul, paged decode and prefill attention, FP8
  pools' scales), each on its device's part. Greedy and sampled tokens, and the compiled
  decode step's collectives. (A model wide enough that a device's part of each matrix
  is one the kernel tiles: K / 2 / 2 a multiple of the group of 32.)"""
  from o1jax.testing import write_gguf_checkpoint
  out = {}
  for matrix_type, backend, kv_dtype, matmul in (
      ("Q4_1", "reference", "bfloat16", "float32"), ("Q4_0", "pallas", "float32", "float8"),
      ("Q4_1", "pallas", "float8_e4m3fn", "float32")):
    path = tempfile.mkdtemp() + "/q4.gguf"
    write_gguf_checkpoint(path, tiny_config(max_context=256, d_model=128, head_dim=32,
                                            ffn_dim=256), seed=3, matrix_type=matrix_type,
                          embed_type="F32")
    ck = load_checkpoint(path)
    # (matmul_dtype float8: the FP8 input path of the kernel, a row's scale over the
    # whole row where the row is split)
    model = Llama(ck.config, dict(ck.params), weight_mode="quantized", backend=backend,
                  interpret=backend == "pallas", matmul_dtype=matmul)
    want, _, _ = generate(model, ck.tokenizer, None, kv_dtype, prompts, max_new_tokens=12)
    got, engine, ops = generate(model, ck.tokenizer, mesh_of(2), kv_dtype, prompts,
                                max_new_tokens=12)
    wo = engine.model.layers[0].wo.get_value()
    wo = getattr(wo, "matrix", wo)  # (an FP8 input's wrapped matrix)
    out[f"{matrix_type}_{backend}_{kv_dtype}_{matmul}"] = dict(
        same_tokens=got == want, collectives=ops, layers=model.config.n_layers,
        wo_split=list(wo.split), wo_spec=str(wo.packed.sharding.spec))
  out["cuda_lowering"] = cuda_lowering_case(ck, prompts)
  return out


def cuda_lowering_case(ck, prompts) -> dict:
  """The TP=2 engine's programs lowered for CUDA as a GPU runs them (compiled Pallas
  kernels): the Triton calls in the lowered module, and the per-device regions
  (`shard_map`'s manual computations) they sit in, one each."""
  from flax import nnx

  from o1jax.testing import as_if_on_gpu, cuda_lowering_engine

  texts = {}

  class Lowering(cuda_lowering_engine()):
    def on_lowered(self, name, lowered):
      texts.setdefault(name, lowered.as_text())

  mesh = mesh_of(2)
  with as_if_on_gpu():
    compiled_kernels = Llama(ck.config, dict(ck.params), backend="pallas",
                             weight_mode="quantized")
    graphdef, _ = nnx.split(tensor_parallel.shard_model(compiled_kernels,
                                                        tensor_parallel.auto_mesh(mesh)))
  model = Llama(ck.config, dict(ck.params), backend="pallas", interpret=True,
                weight_mode="quantized")
  engine = Lowering(model, ck.tokenizer, EngineConfig(max_slots=4, num_blocks=64,
                                                      prefill_chunk=32), mesh=mesh)
  engine.cuda_graphdef = graphdef
  engine.generate([Request(prompts[1], GenerationParams(max_new_tokens=3))])
  return {name: dict(triton=text.count("__gpu$xla.gpu.triton"),
                     per_device=text.count("sdy.manual_computation"))
          for name, text in texts.items() if name in ("decode", "prefill")}


def quantized_case(prompts) -> dict:
  """A quantized-weights model (its q/k/v and gate/up fused into one matrix each on one
  device) on a TP=2 mesh: split back into heads, the one-device forward's logits."""
  from o1jax.testing import write_gguf_checkpoint
  path = tempfile.mkdtemp() + "/q8.gguf"
  write_gguf_checkpoint(path, tiny_config(max_context=256), seed=3, matrix_type="Q8_0",
                        embed_type="F32")
  ck = load_checkpoint(path)
  model = Llama(ck.config, dict(ck.params), weight_mode="quantized")
  mesh = tensor_parallel.auto_mesh(mesh_of(2))
  sharded = tensor_parallel.shard_model(model, mesh)
  ids = jnp.asarray([prompts[0][:16]], jnp.int32)
  starts = jnp.zeros((1,), jnp.int32)
  ref, _ = model(ids, starts, KVCache.zeros(model.config, 1, 16))
  with jax.set_mesh(mesh):
    par, _ = sharded(ids, starts, KVCache.zeros(model.config, 1, 16))
  layer, split = model.layers[0], sharded.layers[0]
  return dict(fused_on_one_device=[layer.wqkv is not None, layer.w_gate_up is not None],
              split_on_the_mesh=[split.wqkv is None, split.w_gate_up is None],
              wk_spec=str(split.wk.get_value().packed.sharding.spec),
              max_logit_diff=float(np.max(np.abs(np.asarray(ref) - np.asarray(par)))))


def setting_errors(model, tok) -> dict:
  """Settings checked before any program is built: what each says (None: accepted)."""
  from o1jax.engine.speculative import SpeculativeConfig
  from o1jax.engine import build_engine
  from o1jax.sharding import group_mesh, make_mesh

  def said(make):
    try:
      make()
      return None
    except ValueError as e:
      return str(e)

  mqa_draft, _ = tiny(1)
  # int8 matmuls where q/k/v and gate/up differ in type (no fused matrices): their VNNI
  # tiles were left whole on every device.
  from o1jax.testing import write_gguf_checkpoint
  path = tempfile.mkdtemp() + "/mixed.gguf"
  write_gguf_checkpoint(path, tiny_config(max_context=256), seed=3, matrix_type="Q4_0",
                        embed_type="F32", tensor_types={"attn_v.weight": "Q8_0",
                                                        "ffn_up.weight": "Q8_0"})
  ck = load_checkpoint(path)
  int8 = Llama(ck.config, dict(ck.params), matmul_dtype="int8")
  engine = Engine(model, tok, EngineConfig(num_blocks=32), mesh=mesh_of(2))
  return dict(
      # A draft model that does not split: named, and the engine is left as it was.
      draft=said(lambda: engine.set_speculative(SpeculativeConfig(drafter="draft_model"),
                                                mqa_draft)),
      draft_left=[engine.speculative, engine.draft_model],
      config_vs_mesh=said(lambda: Engine(model, tok, EngineConfig(num_blocks=32,
                                                                  tensor_parallel=4),
                                         mesh=mesh_of(2))),
      int8_unfused=said(lambda: tensor_parallel.shard_model(
          int8, tensor_parallel.auto_mesh(mesh_of(2)))),
      # backend="pallas" where a device's part of a matrix is one the kernel cannot tile
      # (it failed inside JAX at the first forward).
      kernel_part=said(lambda: tensor_parallel.shard_model(
          Llama(ck.config, dict(ck.params), weight_mode="quantized", backend="pallas",
                interpret=True), tensor_parallel.auto_mesh(mesh_of(2)))),
      # One group of 3 on 8 devices (two replicas of 3 ran; one was refused).
      group_of_3=len(group_mesh(3).devices.flat),
      # A mesh one model cannot use: data=2 ran two copies doing the same work, a device
      # twice failed in JAX with a bare AssertionError, a str with an AttributeError; a
      # mesh beside data_parallel was a TypeError.
      data_axis=said(lambda: Engine(model, tok, EngineConfig(num_blocks=32), mesh=mesh_of(2, 2))),
      device_twice=said(lambda: Engine(model, tok, EngineConfig(num_blocks=32), mesh=jax.sharding.Mesh(
          np.array([jax.devices()[0]] * 2).reshape(1, 2), ("data", "model")))),
      not_a_mesh=said(lambda: Engine(model, tok, EngineConfig(num_blocks=32), mesh="model")),
      controller_data_axis=said(lambda: tensor_parallel.auto_mesh(mesh_of(2, 2))),
      make_mesh_twice=said(lambda: make_mesh(model=2, devices=[jax.devices()[0]] * 2)),
      replicas_and_mesh=said(lambda: build_engine(model, tok, EngineConfig(
          num_blocks=32, data_parallel=2), mesh=mesh_of(2))))


if __name__ == "__main__":
  main()
