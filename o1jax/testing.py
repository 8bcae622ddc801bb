"""Tiny random checkpoints for tests: GGUF and HF safetensors, written on the fly.

The GGUF writer quantizes with gguf-py's own numpy quantizers and stores Q/K
rows in llama.cpp's permuted order, exactly like llama.cpp's converter, so a
tiny file exercises the same code paths as the real model.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib

import numpy as np

from o1jax.checkpoint.model_config import ModelConfig

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


@contextlib.contextmanager
def as_if_on_gpu():
  """`jax.default_backend()` answers "gpu" inside: every dispatch that asks it (the
  kernels' `backend="auto"`, the sampler's GPU branch) takes the GPU's branch, so a CPU
  test can trace and lower for CUDA (`lowering_platforms=("cuda",)`) what a GPU runs."""
  import jax

  real = jax.default_backend
  jax.default_backend = lambda: "gpu"
  try:
    yield
  finally:
    jax.default_backend = real


def cuda_lowering_engine():
  """An `Engine` subclass that shows, on a CPU, what a GPU runs: each new program of the
  engine (name, argument shapes and dtypes) is also traced with `cuda_graphdef` (the
  same model with compiled Pallas kernels) and lowered for CUDA as a GPU dispatches
  (`as_if_on_gpu`), handed to `on_lowered(name, lowered)`; then the call runs (the
  engine's own model, e.g. its interpret-mode twin, dispatching as on a GPU too). Set
  `cuda_graphdef` and `on_lowered` on the engine before it runs."""
  import jax

  from o1jax.engine import Engine

  class CudaLoweringEngine(Engine):
    cuda_graphdef = None

    def on_lowered(self, name: str, lowered) -> None:
      pass

    def _jit(self, name, fn, **jit_kwargs):
      run = super()._jit(name, fn, **jit_kwargs)
      step_fn = getattr(fn, "__wrapped__", None)  # the step of `_bound` (functools.wraps)
      seen = set()

      def call(*args):
        key = tuple((tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(args[1:])
                    if hasattr(x, "shape"))
        if key not in seen:
          seen.add(key)
          if step_fn is not None and name in ("decode", "prefill", "verify", "draft"):
            def on_cuda(leaves, *rest):
              return step_fn(self.cuda_graphdef, jax.tree.unflatten(self._state_def, leaves),
                             *rest)
          else:
            on_cuda = fn
          on_mesh = contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)
          with as_if_on_gpu(), on_mesh:  # (as the engine traces: on its mesh)
            self.on_lowered(name, jax.jit(on_cuda, **jit_kwargs).trace(*args).lower(
                lowering_platforms=("cuda",)))
        with as_if_on_gpu():
          return run(*args)

      return call

  return CudaLoweringEngine


def tiny_config(**overrides) -> ModelConfig:
  base = dict(vocab_size=len(SPECIAL_TOKENS) + 256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
              head_dim=16, ffn_dim=128, rope_theta=10000.0, rms_eps=1e-5, max_context=128,
              tie_embeddings=True, bos_id=1, eos_ids=(2,), architecture="llama", name="tiny")
  base.update(overrides)
  return ModelConfig(**base)


def tiny_gemma3_config(**overrides) -> ModelConfig:
  """A Gemma-3-shaped tiny config: 6 layers (layer 5 global, the rest local with a window of
  4 and RoPE base 10000), GeGLU, post norms, q/k norms, scaled embeddings, tied head."""
  base = dict(architecture="gemma3", n_layers=6, head_dim=32, qk_norm=True, rope_theta=1e6,
              rms_eps=1e-6, scale_embeddings=True, post_norms=True, activation="gelu_tanh",
              query_pre_attn_scalar=32.0, sliding_window=4, sliding_window_pattern=6,
              rope_local_theta=10000.0)
  base.update(overrides)
  return tiny_config(**base)


def byte_vocab() -> list[str]:
  """Special tokens then the 256 byte-level symbols: a BPE with no merges."""
  from tokenizers import pre_tokenizers

  return list(SPECIAL_TOKENS) + sorted(pre_tokenizers.ByteLevel.alphabet())


def random_hf_weights(config: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
  """HF-named f32 weights ([out, in] matrices), scaled so activations stay O(1)."""
  rng = np.random.default_rng(seed)
  d, f, hd = config.d_model, config.ffn_dim, config.head_dim

  def mat(out_dim, in_dim):
    return (rng.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)).astype(np.float32)

  gemma = config.post_norms

  def norm(n):  # Gemma's norms hold w of 1 + w
    return ((0.0 if gemma else 1.0) + 0.1 * rng.standard_normal(n)).astype(np.float32)

  w = {"model.embed_tokens.weight": rng.standard_normal((config.vocab_size, d)).astype(np.float32),
       "model.norm.weight": norm(d)}
  if not config.tie_embeddings:
    w["lm_head.weight"] = mat(config.vocab_size, d)
  for i in range(config.n_layers):
    p = f"model.layers.{i}."
    w[p + "self_attn.q_proj.weight"] = mat(config.n_heads * hd, d)
    w[p + "self_attn.k_proj.weight"] = mat(config.n_kv_heads * hd, d)
    w[p + "self_attn.v_proj.weight"] = mat(config.n_kv_heads * hd, d)
    w[p + "self_attn.o_proj.weight"] = mat(d, config.n_heads * hd)
    if config.attention_bias:
      w[p + "self_attn.q_proj.bias"] = 0.1 * rng.standard_normal(config.n_heads * hd).astype(np.float32)
      w[p + "self_attn.k_proj.bias"] = 0.1 * rng.standard_normal(config.n_kv_heads * hd).astype(np.float32)
      w[p + "self_attn.v_proj.bias"] = 0.1 * rng.standard_normal(config.n_kv_heads * hd).astype(np.float32)
    if config.qk_norm:
      w[p + "self_attn.q_norm.weight"] = norm(hd)
      w[p + "self_attn.k_norm.weight"] = norm(hd)
    w[p + "mlp.gate_proj.weight"] = mat(f, d)
    w[p + "mlp.up_proj.weight"] = mat(f, d)
    w[p + "mlp.down_proj.weight"] = mat(d, f)
    w[p + "input_layernorm.weight"] = norm(d)
    w[p + "post_attention_layernorm.weight"] = norm(d)
    if gemma:
      w[p + "pre_feedforward_layernorm.weight"] = norm(d)
      w[p + "post_feedforward_layernorm.weight"] = norm(d)
  return w


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
  """llama.cpp converter's Q/K row permutation ([out, ...] rows regrouped in pairs)."""
  return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_hf_checkpoint(directory: str | os.PathLike, config: ModelConfig, seed: int = 0,
                        dtype=np.float32, shards: int = 1) -> dict[str, np.ndarray]:
  """Writes config.json, (sharded) safetensors and a byte-level tokenizer. Returns the weights."""
  import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy)
  from safetensors.numpy import save_file

  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  split = {k: v.astype(dtype) for k, v in random_hf_weights(config, seed).items()}
  weights = dict(split)
  if config.architecture == "phi3":  # fused, as Phi-3's checkpoints store them
    for i in range(config.n_layers):
      p = f"model.layers.{i}."
      weights[p + "self_attn.qkv_proj.weight"] = np.concatenate(
          [weights.pop(p + f"self_attn.{x}_proj.weight") for x in "qkv"])
      weights[p + "mlp.gate_up_proj.weight"] = np.concatenate(
          [weights.pop(p + "mlp.gate_proj.weight"), weights.pop(p + "mlp.up_proj.weight")])
  names = sorted(weights)
  if shards == 1:
    save_file(weights, str(directory / "model.safetensors"))
  else:
    weight_map = {}
    for s in range(shards):
      fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
      part = {n: weights[n] for n in names[s::shards]}
      save_file(part, str(directory / fname))
      weight_map.update({n: fname for n in part})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
  hf = {"model_type": config.architecture, "vocab_size": config.vocab_size,
        "hidden_size": config.d_model, "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads, "num_key_value_heads": config.n_kv_heads,
        "intermediate_size": config.ffn_dim, "rope_theta": config.rope_theta,
        "rms_norm_eps": config.rms_eps, "max_position_embeddings": config.max_context,
        "tie_word_embeddings": config.tie_embeddings, "bos_token_id": config.bos_id,
        "eos_token_id": list(config.eos_ids), "rope_scaling": config.rope_scaling}
  if config.architecture in ("qwen2", "qwen3"):
    hf["attention_bias"] = config.attention_bias
  hf["head_dim"] = config.head_dim  # transformers' Qwen3 default (128) is not d_model / heads
  if config.architecture == "phi3":
    hf["sliding_window"] = config.sliding_window
    if config.rotary_dim is not None:
      hf["partial_rotary_factor"] = config.rotary_dim / config.head_dim
    if (config.rope_scaling or {}).get("rope_type") == "longrope":  # as Phi-3.5 writes it
      scaling = config.rope_scaling
      hf["rope_scaling"] = {"type": "longrope", "short_factor": list(scaling["short_factor"]),
                            "long_factor": list(scaling["long_factor"]),
                            "attention_factor": scaling["attention_factor"]}
      hf["original_max_position_embeddings"] = scaling["original_max_position_embeddings"]
  if config.architecture == "smollm3":  # 1: the layer uses RoPE
    hf["no_rope_layers"] = [int(i not in config.nope_layers) for i in range(config.n_layers)]
  if config.post_norms:  # Gemma 3, as transformers 4 writes it
    hf.update(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"],
              hidden_activation="gelu_pytorch_tanh",
              # an int, as Gemma 3's config.json (transformers 5 checks the type)
              query_pre_attn_scalar=(int(config.query_pre_attn_scalar)
                                     if float(config.query_pre_attn_scalar).is_integer()
                                     else config.query_pre_attn_scalar),
              sliding_window=config.sliding_window,
              sliding_window_pattern=config.sliding_window_pattern,
              rope_local_base_freq=config.rope_local_theta, final_logit_softcapping=None,
              attn_logit_softcapping=None, pad_token_id=0)
  (directory / "config.json").write_text(json.dumps(hf))
  _tiny_tokenizer().save(directory)
  return {k: np.asarray(v, np.float32) for k, v in split.items()}  # (Phi-3: split)


def _tiny_tokenizer():
  from o1jax.checkpoint.tokenizer import Tokenizer

  meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm",
          "tokenizer.ggml.tokens": byte_vocab(), "tokenizer.ggml.merges": [],
          "tokenizer.ggml.token_type": [3] * len(SPECIAL_TOKENS) + [1] * 256,
          "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}
  return Tokenizer.from_gguf_metadata(meta)


def write_gguf_checkpoint(path: str | os.PathLike, config: ModelConfig, seed: int = 0,
                          matrix_type: str = "Q4_1", embed_type: str = "Q8_0",
                          architecture: str | None = None,
                          tensor_types: dict[str, str] | None = None,
                          added_tokens: tuple[str, ...] = (),
                          chat_template: str | None = None,
                          merges: tuple[str, ...] = (),
                          pre: str = "smollm",
                          extra_tensors: dict[str, np.ndarray] | None = None
                          ) -> dict[str, np.ndarray]:
  """Writes a llama GGUF with random weights quantized to `matrix_type`.

  added_tokens: appended to the byte vocabulary as llama.cpp marks a model's added
  tokens (USER_DEFINED), e.g. Qwen3's <think> and </think>; config.vocab_size must count
  them. chat_template: stored as `tokenizer.chat_template`.

  tensor_types: a type per GGUF name suffix (e.g. {"attn_v.weight": "Q6_K"}), overriding
  matrix_type, as llama.cpp's mixes (Q4_K_M) do. gguf-py cannot quantize to K-quants or
  IQ4: those tensors get random codes (`random_gguf_blocks`) instead of the returned weights.
  Returns the HF-layout f32 weights it was made from (before quantization)."""
  import gguf

  arch = architecture or config.architecture
  weights = random_hf_weights(config, seed)
  block_rng = np.random.default_rng(seed + 1)
  writer = gguf.GGUFWriter(str(path), arch)
  writer.add_name(config.name or "tiny")
  writer.add_block_count(config.n_layers)
  writer.add_context_length(config.max_context)
  writer.add_embedding_length(config.d_model)
  writer.add_feed_forward_length(config.ffn_dim)
  writer.add_head_count(config.n_heads)
  writer.add_head_count_kv(config.n_kv_heads)
  writer.add_rope_freq_base(config.rope_theta)
  if config.head_dim != config.d_model // config.n_heads:
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
  writer.add_layer_norm_rms_eps(config.rms_eps)
  writer.add_vocab_size(config.vocab_size)
  writer.add_tokenizer_model("gpt2")
  writer.add_tokenizer_pre(pre)
  tokens = byte_vocab() + list(added_tokens)
  if len(tokens) != config.vocab_size:
    raise ValueError(f"{len(tokens)} tokens for vocab_size {config.vocab_size}")
  writer.add_token_list(tokens)
  writer.add_token_merges(list(merges))  # (llama.cpp refuses a BPE vocabulary without any)
  writer.add_token_types([3] * len(SPECIAL_TOKENS) + [1] * 256 + [4] * len(added_tokens))
  if chat_template is not None:
    writer.add_chat_template(chat_template)
  writer.add_bos_token_id(1)
  writer.add_eos_token_id(2)
  writer.add_add_bos_token(False)

  def add(name, w, kind):
    kind = next((t for suffix, t in (tensor_types or {}).items() if name.endswith(suffix)), kind)
    qtype = gguf.GGMLQuantizationType[kind]
    if kind.endswith("_K") or kind.startswith("IQ"):  # gguf-py quantizes neither
      raw = random_gguf_blocks(kind, w.shape[0], w.shape[1], block_rng,
                               kquant_scales(kind, w.shape[1]))
      writer.add_tensor(name, raw, raw_dtype=qtype)
    elif kind == "F32":
      writer.add_tensor(name, w.astype(np.float32))
    elif kind == "F16":
      writer.add_tensor(name, w.astype(np.float16))
    else:
      writer.add_tensor(name, gguf.quants.quantize(w.astype(np.float32), qtype), raw_dtype=qtype)

  gemma = config.post_norms
  if gemma:  # as llama.cpp's converter writes Gemma 3 (no key for the pattern or local base)
    writer.add_sliding_window(config.sliding_window)
    if (config.rope_scaling or {}).get("rope_type") == "linear":
      writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
      writer.add_rope_scaling_factor(config.rope_scaling["factor"])
  # llama.cpp's converter permutes Q/K rows for adjacent-pair RoPE, not for rotate-half
  # (Qwen, Gemma 3); it stores Gemma's norm weights w as 1 + w.
  permute = (lambda w, n: w) if arch in ("qwen2", "qwen3", "gemma3", "phi3") else llama_cpp_permute
  if arch == "llama":  # as llama.cpp's converter: the rotary width (the head's)
    writer.add_rope_dimension_count(config.rope_dim)
  if arch == "phi3":  # as llama.cpp's converter: the rotary width, the window if any,
    writer.add_rope_dimension_count(config.rope_dim)  # longrope's numbers (factors: below)
    if config.sliding_window:
      writer.add_sliding_window(config.sliding_window)
    if (config.rope_scaling or {}).get("rope_type") == "longrope":
      writer.add_rope_scaling_attn_factors(config.rope_scaling["attention_factor"])
      writer.add_rope_scaling_orig_ctx_len(
          config.rope_scaling["original_max_position_embeddings"])
  norm = (lambda w: w + np.float32(1)) if gemma else (lambda w: w)
  add("token_embd.weight", weights["model.embed_tokens.weight"], embed_type)
  for name, w in (extra_tensors or {}).items():  # as given, F32 (e.g. longrope's factors)
    add(name, w, "F32")
  add("output_norm.weight", norm(weights["model.norm.weight"]), "F32")
  if arch == "phi3" and (config.rope_scaling or {}).get("rope_type") == "longrope":
    for kind in ("long", "short"):
      add(f"rope_factors_{kind}.weight",
          np.asarray(config.rope_scaling[f"{kind}_factor"], np.float32), "F32")
  if (config.rope_scaling or {}).get("rope_type") == "llama3":
    add("rope_freqs.weight", llama3_rope_factors(config.head_dim, config.rope_theta,
                                                 config.rope_scaling), "F32")
  if not config.tie_embeddings:
    add("output.weight", weights["lm_head.weight"], matrix_type)
  for i in range(config.n_layers):
    p, h = f"model.layers.{i}.", f"blk.{i}."
    # Phi-3 stores q, k, v rows in one matrix and gate then up in one; the order of the
    # adds is the writer's draw order of random blocks (kept as it was for the others).
    fused = arch == "phi3"
    if fused:
      add(h + "attn_qkv.weight", np.concatenate([weights[p + f"self_attn.{x}_proj.weight"]
                                                 for x in "qkv"]), matrix_type)
    else:
      add(h + "attn_q.weight", permute(weights[p + "self_attn.q_proj.weight"], config.n_heads),
          matrix_type)
      add(h + "attn_k.weight", permute(weights[p + "self_attn.k_proj.weight"], config.n_kv_heads),
          matrix_type)
    if config.attention_bias:
      add(h + "attn_q.bias", permute(weights[p + "self_attn.q_proj.bias"], config.n_heads), "F32")
      add(h + "attn_k.bias", permute(weights[p + "self_attn.k_proj.bias"], config.n_kv_heads),
          "F32")
      add(h + "attn_v.bias", weights[p + "self_attn.v_proj.bias"], "F32")
    if config.qk_norm:
      add(h + "attn_q_norm.weight", norm(weights[p + "self_attn.q_norm.weight"]), "F32")
      add(h + "attn_k_norm.weight", norm(weights[p + "self_attn.k_norm.weight"]), "F32")
    if not fused:
      add(h + "attn_v.weight", weights[p + "self_attn.v_proj.weight"], matrix_type)
    add(h + "attn_output.weight", weights[p + "self_attn.o_proj.weight"], matrix_type)
    if fused:
      add(h + "ffn_up.weight", np.concatenate([weights[p + "mlp.gate_proj.weight"],
                                               weights[p + "mlp.up_proj.weight"]]), matrix_type)
    else:
      add(h + "ffn_gate.weight", weights[p + "mlp.gate_proj.weight"], matrix_type)
      add(h + "ffn_up.weight", weights[p + "mlp.up_proj.weight"], matrix_type)
    add(h + "ffn_down.weight", weights[p + "mlp.down_proj.weight"], matrix_type)
    add(h + "attn_norm.weight", norm(weights[p + "input_layernorm.weight"]), "F32")
    if gemma:
      add(h + "post_attention_norm.weight", norm(weights[p + "post_attention_layernorm.weight"]),
          "F32")
      add(h + "ffn_norm.weight", norm(weights[p + "pre_feedforward_layernorm.weight"]), "F32")
      add(h + "post_ffw_norm.weight", norm(weights[p + "post_feedforward_layernorm.weight"]),
          "F32")
    else:
      add(h + "ffn_norm.weight", weights[p + "post_attention_layernorm.weight"], "F32")
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return weights


def write_gguf_with_a_nan_scale(path: str | os.PathLike, config: ModelConfig,
                                tensor: str = "blk.1.ffn_down.weight", block: int = 3) -> None:
  """A Q4_0 GGUF of `config` whose `tensor` has a NaN f16 scale in its `block`-th block:
  a header that checks out, values that do not (only loading sees them)."""
  import gguf

  write_gguf_checkpoint(path, config, matrix_type="Q4_0")
  offset = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == tensor).data_offset
  at = offset + 18 * block  # a Q4_0 block: its f16 scale, then 16 bytes of 4-bit values
  data = bytearray(pathlib.Path(path).read_bytes())
  data[at:at + 2] = np.array([np.nan], np.float16).tobytes()
  pathlib.Path(path).write_bytes(bytes(data))


def llama3_rope_factors(head_dim: int, theta: float, scaling: dict) -> np.ndarray:
  """The per-frequency divisors llama.cpp's converter writes as a Llama 3 GGUF's rope_freqs:
  1 below wavelength original_ctx / high_freq_factor, `factor` above original_ctx /
  low_freq_factor, 1 / ((1 - a) / factor + a) in between, a = (ctx / wavelength - low) /
  (high - low)."""
  freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
  ctx = scaling["original_max_position_embeddings"]
  wavelength = 2 * np.pi / freqs
  a = (ctx / wavelength - low) / (high - low)
  out = np.where(wavelength < ctx / high, 1.0,
                 np.where(wavelength > ctx / low, factor, 1 / ((1 - a) / factor + a)))
  return out.astype(np.float32)


# Byte ranges of each GGUF block format's float scales: (start, end, dtype). Random bytes
# elsewhere are valid codes; these get finite values so tests exercise real numbers.
_BLOCK_SCALE_FIELDS = {
    "Q4_0": ((0, 2, np.float16),), "Q4_1": ((0, 2, np.float16), (2, 4, np.float16)),
    "Q8_0": ((0, 2, np.float16),), "Q5_0": ((0, 2, np.float16),),
    "Q5_1": ((0, 2, np.float16), (2, 4, np.float16)),
    "Q2_K": ((80, 82, np.float16), (82, 84, np.float16)), "Q3_K": ((108, 110, np.float16),),
    "Q4_K": ((0, 2, np.float16), (2, 4, np.float16)),
    "Q5_K": ((0, 2, np.float16), (2, 4, np.float16)), "Q6_K": ((208, 210, np.float16),),
    "Q8_K": ((0, 4, np.float32),), "IQ4_NL": ((0, 2, np.float16),),
    "IQ4_XS": ((0, 2, np.float16),), "IQ3_S": ((0, 2, np.float16),),
    "IQ3_XXS": ((0, 2, np.float16),), "IQ2_S": ((0, 2, np.float16),),
    "IQ2_XS": ((0, 2, np.float16),), "IQ2_XXS": ((0, 2, np.float16),),
    "IQ1_S": ((0, 2, np.float16),), "IQ1_M": (),  # IQ1_M: d split over 4 nibbles (below)
}


def random_gguf_blocks(kind: str, rows: int, k: int, rng: np.random.Generator,
                       scales=(0.01, 0.01)) -> np.ndarray:
  """Raw bytes [rows, K / block * nbytes] of a GGUF tensor of type `kind`: random codes,
  and per block the float fields (d, then dmin/m where the format has one) drawn as
  |N(0, 1)| * scales[i] (Q4_1's and Q5_1's m as N(0, 1) * scales[1]: a signed offset)."""
  import gguf

  block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
  if k % block:  # (k // block rows of blocks would silently write a shorter tensor)
    raise ValueError(f"{kind} holds blocks of {block} values; K={k} is not a multiple")
  raw = rng.integers(0, 256, (rows, k // block, nbytes), dtype=np.uint8)
  for i, (start, end, dtype) in enumerate(_BLOCK_SCALE_FIELDS[kind]):
    v = rng.standard_normal((rows, k // block)) * scales[i]
    v = v if kind in ("Q4_1", "Q5_1") and i == 1 else np.abs(v)
    raw[..., start:end] = v.astype(dtype)[..., None].view(np.uint8)
  if kind == "IQ1_M":  # d's 16 bits sit in the top nibbles of the last 4 uint16 (first lowest)
    d = np.abs(rng.standard_normal((rows, k // block)) * scales[0]).astype(np.float16)
    nibbles = (d.view(np.uint16)[..., None] >> np.array([0, 4, 8, 12], np.uint16)) & 0xF
    words = raw[..., 48:56].copy().view("<u2")
    raw[..., 48:56] = ((words & 0x0FFF) | (nibbles << 12).astype(np.uint16)).view(np.uint8)
  return raw.reshape(rows, -1)


def kquant_scales(kind: str, in_features: int) -> tuple[float, float]:
  """(d, dmin) magnitudes for `random_gguf_blocks` that give weights of RMS ~ 1/sqrt(K)
  and mean ~ 0: random codes have mean sc * q ~ (scale max / 2)(code max / 2), which the
  min term cancels on average."""
  target = 1.0 / np.sqrt(in_features)
  # (largest scale, largest code, mean of the min term per unit dmin)
  sc_max, q_max, min_mean = {"Q2_K": (15, 3, 7.5), "Q3_K": (32, 4, 0), "Q4_K": (63, 15, 31.5),
                             "Q5_K": (63, 31, 31.5), "Q6_K": (128, 32, 0),
                             "Q8_K": (1, 128, 0), "IQ4_NL": (1, 127, 0),
                             "IQ4_XS": (32, 127, 0), "IQ3_S": (31, 15, 0),
                             "IQ3_XXS": (8, 62, 0), "IQ2_S": (4, 43, 0), "IQ2_XS": (4, 43, 0),
                             "IQ2_XXS": (4, 43, 0), "IQ1_S": (2, 9, 0),
                             "IQ1_M": (2, 9, 0)}.get(kind, (1, 8, 0))
  d = target * 2 / (sc_max * q_max)
  dmin = d * (sc_max / 2) * (q_max / 2) / min_mean if min_mean else 0.0
  return d, dmin
