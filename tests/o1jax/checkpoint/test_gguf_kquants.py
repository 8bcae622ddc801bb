"""GGUF K-quants and IQ types: every block format bit-exact against gguf-py, through every
matmul path, and tiny K-quant and IQ models against the numpy reference."""

import gguf
import jax.numpy as jnp
import numpy as np
import pytest

from o1jax import numpy_reference, testing
from o1jax.checkpoint import load_checkpoint
from o1jax.checkpoint.gguf_blocks import FORMATS, unpack_blocks, quantized_from_gguf
from o1jax.model import KVCache, Llama
from o1jax.model.llama import _pack_int8_matrices
from pallas_kernels import ops
from pallas_kernels.quantized_tensor import dequantize

Q = gguf.GGMLQuantizationType


@pytest.mark.parametrize("kind", sorted(set(FORMATS) - {"Q8_K"}))  # Q8_K: by hand below
def test_dequantize_bit_exact_against_gguf_py(kind):
  """Random codes and random f16 scales (over and under 1, subnormals included)."""
  rng = np.random.default_rng(sum(map(ord, kind)))
  for scale in (1e-2, 3.0, 1e-6):
    raw = testing.random_gguf_blocks(kind, 5, 512, rng, scales=(scale, scale))
    want = gguf.quants.dequantize(raw, Q[kind])  # [rows, K]
    got = np.asarray(dequantize(quantized_from_gguf(kind, raw))).T
    np.testing.assert_array_equal(got, want, err_msg=f"{kind} scale {scale}")


@pytest.mark.parametrize("kind", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS",
                                  "IQ3_S", "IQ2_XS", "IQ1_M"])
def test_pallas_matmul_on_gguf_blocks(kind):
  """The fused kernel (interpret mode) on a loaded K-quant weight = x @ gguf-py's values."""
  rng = np.random.default_rng(7)
  raw = testing.random_gguf_blocks(kind, 32, 512, rng, testing.kquant_scales(kind, 512))
  x = rng.standard_normal((3, 512)).astype(np.float32)
  want = x.astype(np.float64) @ gguf.quants.dequantize(raw, Q[kind]).T.astype(np.float64)
  got = ops.quantized_matmul(jnp.asarray(x), quantized_from_gguf(kind, raw), backend="pallas",
                             interpret=True)
  np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_q8_k_by_hand():  # gguf-py has no Q8_K dequantizer
  # One super-block: f32 d = 0.5, codes 0..127 then -128..-1; w = d * q.
  q = np.arange(-128, 128, dtype=np.int8)
  q = np.concatenate([q[128:], q[:128]])
  raw = np.concatenate([np.array([0.5], np.float32).view(np.uint8), q.view(np.uint8),
                        np.zeros(32, np.uint8)])[None]
  got = np.asarray(dequantize(quantized_from_gguf("Q8_K", raw)))[:, 0]
  np.testing.assert_array_equal(got, q.astype(np.float32) * 0.5)


def test_q4_k_sub_block_by_hand():
  """d = 2, dmin = 1; scales 1..8 and mins 0..7 (6-bit fields split as in the format);
  every nibble = 3 except element 0 (low nibble 0) and element 32 (high nibble 15).
  So sub-block i has w = 2 (i + 1) 3 - i; element 0: -0 = 0; element 32: 2*2*15 - 1 = 59."""
  sc, mn = np.arange(1, 9), np.arange(8)
  s = np.zeros(12, np.uint8)
  s[0:4] = sc[:4] | ((sc[4:] >> 4) << 6)
  s[4:8] = mn[:4] | ((mn[4:] >> 4) << 6)
  s[8:12] = (sc[4:] & 0xF) | ((mn[4:] & 0xF) << 4)
  qs = np.full(128, 0x33, np.uint8)
  qs[0] = 0xF0  # low nibble 0 (element 0, sub-block 0), high 15 (element 32, sub-block 1)
  raw = np.concatenate([np.array([2.0, 1.0], np.float16).view(np.uint8), s, qs])[None]
  codes = unpack_blocks("Q4_K", raw)
  np.testing.assert_array_equal(codes.scale[0], 2.0 * sc)
  np.testing.assert_array_equal(codes.minimum[0], -1.0 * mn)
  w = np.asarray(dequantize(quantized_from_gguf("Q4_K", raw)))[:, 0]
  want = np.repeat(2.0 * sc * 3 - mn, 32).astype(np.float32)
  want[0], want[32] = 0.0, 2.0 * 2 * 15 - 1
  np.testing.assert_array_equal(w, want)


def test_iq4_xs_by_hand():
  """d = 0.5; sub-block i has the 6-bit scale ls_i = 32 + (i - 4) * 3 (so i - 4 = 3 (ls - 32) / 3
  steps, negative below 4), split as the format stores it: low nibbles in scales_l (sub-block
  2j low, 2j + 1 high), top 2 bits at bits 2i of the little-endian uint16 scales_h. Every
  nibble is 8 (level 1) except element 0 (low nibble 0: -127) and element 16 of sub-block 7
  (high nibble 15: 113). w = d (ls - 32) level."""
  ls = 32 + (np.arange(8) - 4) * 3
  scales_l = (ls[0::2] & 0xF) | ((ls[1::2] & 0xF) << 4)
  scales_h = sum(int(v >> 4) << (2 * i) for i, v in enumerate(ls))
  qs = np.full(128, 0x88, np.uint8)
  qs[0] = 0x80  # element 0 of sub-block 0: low nibble 0
  qs[7 * 16] = 0xF8  # element 16 of sub-block 7: high nibble 15
  raw = np.concatenate([np.array([0.5], np.float16).view(np.uint8),
                        np.array([scales_h], "<u2").view(np.uint8), scales_l.astype(np.uint8),
                        qs])[None]
  assert raw.shape == (1, 136)
  w = np.asarray(dequantize(quantized_from_gguf("IQ4_XS", raw)))[:, 0]
  want = np.repeat(0.5 * (ls - 32), 32).astype(np.float32)  # level 1 everywhere
  want[0] = 0.5 * (ls[0] - 32) * -127
  want[7 * 32 + 16] = 0.5 * (ls[7] - 32) * 113
  np.testing.assert_array_equal(w, want)


def test_iq_grids_and_signs_by_hand():
  """ggml's tables as its source writes them (iq2xxs_grid[1] = 0x080808080808082b,
  iq3xxs_grid[1] = 0x04040414, iq1s_grid[1] = 0xffffffffffffff01; little-endian bytes),
  and the 7-to-8 sign expansion: the 8th bit makes the number of minus signs even."""
  from o1jax.checkpoint.gguf_blocks import _EVEN_SIGNS, _grid
  np.testing.assert_array_equal(_grid("IQ2_XXS")[1], [0x2B] + [8] * 7)
  np.testing.assert_array_equal(_grid("IQ3_XXS")[1], [0x14, 4, 4, 4])
  np.testing.assert_array_equal(_grid("IQ1_S")[1], [1] + [-1] * 7)
  assert _grid("IQ2_S").shape == (1024, 8) and _grid("IQ3_S").shape == (512, 4)
  bits = np.unpackbits(_EVEN_SIGNS[:, None], axis=1)
  assert (bits.sum(1) % 2 == 0).all() and ((_EVEN_SIGNS & 0x7F) == np.arange(128)).all()


def test_iq2_xxs_block_by_hand():
  """d = 1; sub-block 0: grid indices (1, 0, 0, 0), sign index 1 for its first 8 values
  (ksigns 0x81: values 0 and 7 negative), scale ls = 3: (3 + 1/2) / 4 = 0.875; other
  sub-blocks all zero bytes: grid 0 (all 8), signs +, ls 0: 1/8."""
  raw = np.zeros(66, np.uint8)
  raw[0:2] = np.array([1.0], np.float16).view(np.uint8)
  raw[2:10] = np.concatenate([[1, 0, 0, 0], np.array([1 | (3 << 28)], "<u4").view(np.uint8)])
  w = np.asarray(dequantize(quantized_from_gguf("IQ2_XXS", raw[None])))[:, 0]
  want = np.full(256, 8 / 8, np.float32)
  want[:32] = 0.875 * 8
  want[0], want[7] = -0.875 * 43, -0.875 * 8
  np.testing.assert_array_equal(w, want)


# Q4_K_M's mix: Q4_K matrices, Q6_K for attn_v, ffn_down and the embedding table; plus one
# matrix of each other K-quant, Q5_0/Q5_1 (llama.cpp's fallback where K is not a
# multiple of 256) and IQ4_XS/IQ4_NL. K = 256 everywhere (a K-quant super-block).
KQUANT_CONFIG = dict(d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=256)
KQUANT_MIX = {"attn_v.weight": "Q6_K", "ffn_down.weight": "Q6_K", "blk.1.ffn_up.weight": "Q5_K",
              "blk.1.attn_output.weight": "Q3_K", "blk.1.ffn_gate.weight": "Q2_K",
              "blk.1.attn_k.weight": "Q8_K", "blk.0.ffn_up.weight": "Q5_0",
              "blk.0.ffn_gate.weight": "Q5_1", "blk.1.attn_q.weight": "IQ4_XS",
              "blk.0.attn_output.weight": "IQ4_NL"}


# The low-bit IQ mixes (IQ2_M, IQ3_M, ...): every other IQ type, one matrix each, IQ4_XS
# elsewhere and for the embedding table.
IQ_MIX = {"blk.0.attn_q.weight": "IQ3_S", "blk.0.attn_k.weight": "IQ3_XXS",
          "blk.0.attn_v.weight": "IQ2_S", "blk.0.attn_output.weight": "IQ2_XS",
          "blk.0.ffn_gate.weight": "IQ2_XXS", "blk.0.ffn_up.weight": "IQ1_M",
          "blk.0.ffn_down.weight": "IQ1_S", "blk.1.attn_k.weight": "IQ4_NL"}
MIXES = {"q4_k_m": ("Q4_K", "Q6_K", KQUANT_MIX), "iq": ("IQ4_XS", "IQ4_XS", IQ_MIX)}


@pytest.fixture(scope="module", params=sorted(MIXES))
def kquant_gguf(tmp_path_factory, request):
  path = tmp_path_factory.mktemp("kquant") / f"tiny-{request.param}.gguf"
  config = testing.tiny_config(tie_embeddings=True, **KQUANT_CONFIG)
  matrix_type, embed_type, mix = MIXES[request.param]
  testing.write_gguf_checkpoint(path, config, seed=5, matrix_type=matrix_type,
                                embed_type=embed_type, tensor_types=mix)
  return path


def test_the_mixes_hold_every_block_format():
  types = {kind for matrix, embed, mix in MIXES.values() for kind in (matrix, embed, *mix.values())}
  assert set(FORMATS) - {"Q4_0", "Q4_1", "Q8_0"} == types  # those three: test_gguf_import


TOKENS = np.array([5, 17, 42, 99, 200, 7, 3, 250])


def _logits(ck, **kw):
  model = Llama(ck.config, ck.params, **kw)
  logits, _ = model(jnp.asarray(TOKENS)[None], jnp.zeros((1,), jnp.int32),
                    KVCache.zeros(ck.config, 1, 16))
  return np.asarray(logits[0])


def test_kquant_model_matches_numpy_reference(kquant_gguf):
  """Weights stay quantized (every type in the file) and give the reference's logits."""
  ck = load_checkpoint(kquant_gguf)
  types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(kquant_gguf)).tensors}
  mix = MIXES[kquant_gguf.stem.removeprefix("tiny-")][2]
  assert all(types[name] == kind for name, kind in mix.items() if name.startswith("blk."))
  if "q4_k_m" in kquant_gguf.name:
    assert ck.params["layers"][0]["wq"].bits == 4 and ck.params["layers"][0]["wv"].group_size == 16
  else:  # IQ codes take the int8 layout; IQ2_S's scales are per 16
    assert ck.params["layers"][0]["wq"].bits == 8 and ck.params["layers"][0]["wv"].group_size == 16
  ref = numpy_reference.gguf_forward(kquant_gguf, TOKENS)  # gguf-py's dequantizer, f32 numpy
  # f32 throughout; differences are summation order only (|logits| ~ 10). Weights stay
  # quantized through the matmuls; "dense" mode runs the same `dequantize` once at load
  # (bit-exact above) and takes ~10x longer to build here, op by op.
  np.testing.assert_allclose(_logits(ck, weight_mode="quantized"), ref, atol=2e-4, rtol=0)


def test_kquant_model_int8_matmuls(kquant_gguf):
  """The int8 path (Q6_K/Q3_K/Q2_K requantized to Q8_0, f32 scales rounded to f16; Q5_0/Q5_1
  and IQ4_NL exact; codes of at most 16 levels as nibbles with a lut) stays
  near the exact logits; measured here: KL and top-1 agreement."""
  ck = load_checkpoint(kquant_gguf)
  exact = _logits(ck)
  int8 = _logits(ck, matmul_dtype="int8")
  log_softmax = lambda z: z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
      - z.max(-1, keepdims=True)
  p, q = log_softmax(exact.astype(np.float64)), log_softmax(int8.astype(np.float64))
  kl = (np.exp(p) * (p - q)).sum(-1)
  print(f"int8 matmuls on a K-quant mix: max KL {kl.max():.1e}, max |logit change| "
        f"{np.abs(int8 - exact).max():.1e}")
  assert kl.max() < 1e-3, kl
  np.testing.assert_array_equal(int8.argmax(-1), exact.argmax(-1))
  if "iq" in kquant_gguf.name:  # IQ4_XS / IQ4_NL (and IQ1_S's few levels): 4-bit with a lut
    packed = _pack_int8_matrices(ck.params)["layers"]
    assert all(w.bits == 4 and w.lut is not None for w in packed[1].values() if hasattr(w, "lut"))
    # Layer 0: IQ1_S's few levels take a lut; IQ2_S (groups of 16) became Q8_0, so its
    # q/k/v stay apart.
    assert packed[0]["w_down"].lut is not None and packed[0]["wv"].bits == 8
    assert "wqkv" not in packed[0] and "wqkv" in packed[1]
