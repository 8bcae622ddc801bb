"""GGUF quantization types written by llama.cpp's own quantizer, read by o1jax.

Needs llama-cpp-python (the `reference` extra; it compiles llama.cpp). For each type:
  1. a tiny random Llama (dimensions multiples of 256, so every matrix takes the type;
     a Mistral-Nemo-shaped one: heads x head_dim != d_model, grouped KV heads, the
     tekken pre-tokenizer; a SmolLM3 one: its 4th layer without RoPE) is written as an
     F32 GGUF and quantized by `llama_model_quantize` (llama.cpp's
     mixes, e.g. IQ3_M keep some tensors in other types, as real files do);
  2. o1jax loads the file and computes the logits of fixed tokens (f32 matmuls on the
     quantized weights), compared with
     - the numpy reference on gguf-py's dequantization (should agree to f32 rounding), and
     - llama.cpp's own evaluation of the same file (the format's definition; its matmuls
       round the activations to 8 bits for the quantized types, so it differs by that:
       KL and top-1 agreement are reported; a wrong layout gives unrelated logits). The
       F32 row (nothing quantized) is the control: summation order only.
The types llama.cpp quantizes only with an importance matrix (IQ1_S, IQ1_M, IQ2_XXS,
IQ2_XS, IQ2_S, IQ3_XXS) cannot be made through the Python API (it takes the matrix as a
C++ map); they are checked against gguf-py only (tests/o1jax/checkpoint/test_gguf_kquants.py).

  python scripts/check_gguf_quants_llamacpp.py [--types IQ4_XS,IQ3_S] [--json OUT]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import pathlib
import sys
import tempfile

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from llamacpp_common import disable_extra_buffer_types, require_llama_cpp  # noqa: E402
from script_args import output_file  # noqa: E402

TYPES = ("F32", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K",
         "IQ4_NL", "IQ4_XS", "IQ3_S", "IQ3_M")
TOKENS = [5, 17, 42, 99, 200, 7, 3, 250, 64, 128, 33, 90]


def _shapes():
  from o1jax import testing
  small = dict(vocab_size=260, d_model=256, ffn_dim=512, tie_embeddings=False)
  return {
      "llama": testing.tiny_config(n_heads=4, n_kv_heads=2, head_dim=64, **small),
      # Mistral Nemo's layout: heads x head_dim (512) != d_model, 4 query heads per KV
      # head, RoPE base 1e6, the tekken pre-tokenizer.
      "nemo": testing.tiny_config(n_heads=8, n_kv_heads=2, head_dim=64, rope_theta=1e6, **small),
      # SmolLM3: layer 4 of 4 without RoPE, 4 query heads per KV head.
      "smollm3": testing.tiny_config(architecture="smollm3", n_layers=4, n_heads=4, n_kv_heads=1,
                                     head_dim=64, nope_layers=(3,), **small),
      # Phi-3: q/k/v and gate/up fused, rotate-half RoPE (no window: llama.cpp ignores it).
      "phi3": testing.tiny_config(architecture="phi3", n_heads=4, n_kv_heads=4, head_dim=64,
                                  **small),
      # Phi-4-mini's RoPE: 48 of 64 head dims rotate, LongRoPE's short factors and its
      # attention factor. llama.cpp turns every position by the long factors when its
      # context (here 256, its smallest) passes the original one; o1jax positions past
      # it: an original context of 256 keeps both on the short ones.
      "phi4": testing.tiny_config(
          architecture="phi3", n_heads=4, n_kv_heads=4, head_dim=64, rotary_dim=48,
          max_context=512,
          rope_scaling={"rope_type": "longrope", "original_max_position_embeddings": 256,
                        "attention_factor": 1.1902380714238083,
                        "short_factor": tuple(1.0 + 0.3 * i for i in range(24)),
                        "long_factor": tuple(4.0 + i for i in range(24))}, **small),
  }


PRE = {"llama": "smollm", "nemo": "tekken", "smollm3": "llama-bpe", "phi3": "gpt-4o",
       "phi4": "gpt-4o"}


def _log_softmax(z: np.ndarray) -> np.ndarray:
  z = z.astype(np.float64)
  z = z - z.max(-1, keepdims=True)
  return z - np.log(np.exp(z).sum(-1, keepdims=True))


def _quantize(llama_cpp, src: pathlib.Path, dst: pathlib.Path, kind: str) -> None:
  params = llama_cpp.llama_model_quantize_default_params()
  params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_ALL_F32" if kind == "F32"
                         else f"LLAMA_FTYPE_MOSTLY_{kind}")
  params.nthread = 2
  rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
  if rc != 0:
    raise RuntimeError(f"llama_model_quantize({kind}) returned {rc}")


def _llamacpp_logits(llama_cpp_module, path: pathlib.Path) -> np.ndarray:
  disable_extra_buffer_types()
  model = llama_cpp_module.Llama(str(path), n_ctx=64, n_threads=2, logits_all=True,
                                 verbose=False)
  model.eval(TOKENS)
  return np.asarray(model.scores[:len(TOKENS)], np.float32)


def check(kinds, work: pathlib.Path, shape: str = "llama") -> list[dict]:
  import gguf
  import jax.numpy as jnp
  import llama_cpp
  import llama_cpp.llama_cpp as low

  from o1jax import numpy_reference, testing
  from o1jax.checkpoint import load_checkpoint
  from o1jax.model import KVCache, Llama

  config = _shapes()[shape]
  src = work / f"tiny-{shape}-f32.gguf"
  testing.write_gguf_checkpoint(src, config, seed=11, matrix_type="F32", embed_type="F32",
                                added_tokens=("ab",), merges=("a b",), pre=PRE[shape])
  rows = []
  for kind in kinds:
    dst = work / f"tiny-{shape}-{kind}.gguf"
    _quantize(low, src, dst, kind)
    types = sorted({t.tensor_type.name for t in gguf.GGUFReader(str(dst)).tensors
                    if len(t.shape) == 2})
    ck = load_checkpoint(dst)
    model = Llama(ck.config, ck.params, weight_mode="quantized")
    ours, _ = model(jnp.asarray(TOKENS)[None], jnp.zeros((1,), jnp.int32),
                    KVCache.zeros(ck.config, 1, 32))
    ours = np.asarray(ours[0], np.float32)
    reference = numpy_reference.gguf_forward(dst, np.asarray(TOKENS))
    theirs = _llamacpp_logits(llama_cpp, dst)
    p, q = _log_softmax(theirs), _log_softmax(ours)
    kl = (np.exp(p) * (p - q)).sum(-1)
    rows.append({"shape": shape, "type": kind, "matrix_types": types,
                 "vs_numpy_reference_max_abs": float(np.abs(ours - reference).max()),
                 "vs_llamacpp_max_abs": float(np.abs(ours - theirs).max()),
                 "logit_scale": float(np.abs(theirs).max()),
                 "vs_llamacpp_mean_kl": float(kl.mean()),
                 "vs_llamacpp_top1": float((ours.argmax(-1) == theirs.argmax(-1)).mean())})
    r = rows[-1]
    print(f"{shape:6s} {kind:8s} {','.join(types):28s} ref {r['vs_numpy_reference_max_abs']:.1e}  "
          f"llama.cpp max|d| {r['vs_llamacpp_max_abs']:.3f} (|logits| <= {r['logit_scale']:.1f}) "
          f"KL {r['vs_llamacpp_mean_kl']:.1e} top-1 {r['vs_llamacpp_top1']:.0%}", flush=True)
  return rows


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--types", default=",".join(TYPES))
  parser.add_argument("--nemo-types", default="F32,Q4_K_M",
                      help="types for the Mistral-Nemo-shaped model ('' = skip)")
  parser.add_argument("--smollm3-types", default="F32,Q4_K_M",
                      help="types for the SmolLM3-shaped model ('' = skip)")
  parser.add_argument("--phi3-types", default="F32,Q4_K_M",
                      help="types for the Phi-3-shaped model ('' = skip)")
  parser.add_argument("--phi4-types", default="F32,Q4_K_M",
                      help="types for the Phi-4-mini-shaped model (partial rotary, LongRoPE; "
                      "'' = skip)")
  parser.add_argument("--json", type=output_file, default=None, help="write the rows here")
  args = parser.parse_args(argv)
  if not require_llama_cpp():
    return 2
  with tempfile.TemporaryDirectory() as tmp:
    rows = check([k for k in args.types.split(",") if k], pathlib.Path(tmp))
    rows += check([k for k in args.nemo_types.split(",") if k], pathlib.Path(tmp), "nemo")
    rows += check([k for k in args.smollm3_types.split(",") if k], pathlib.Path(tmp), "smollm3")
    rows += check([k for k in args.phi3_types.split(",") if k], pathlib.Path(tmp), "phi3")
    rows += check([k for k in args.phi4_types.split(",") if k], pathlib.Path(tmp), "phi4")
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
