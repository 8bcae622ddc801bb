"""GGUF import: block formats bit-exact, the tiny model against the numpy reference, bad files."""

import gguf
import jax.numpy as jnp
import numpy as np
import pytest

from o1jax import numpy_reference, testing
from o1jax.checkpoint import CheckpointError, load_checkpoint
from o1jax.checkpoint.gguf_loader import load_gguf, read_tensors
from o1jax.model import KVCache, Llama
from pallas_kernels.quantized_tensor import QuantizedTensor, dequantize

Q = gguf.GGMLQuantizationType


def _f16_bytes(x):
  return np.array([x], np.float16).view(np.uint8)


def _write_raw(path, tensors):
  w = gguf.GGUFWriter(str(path), "llama")
  for name, (raw, qtype) in tensors.items():
    w.add_tensor(name, raw, raw_dtype=qtype)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


def _hand_blocks():
  """Two rows (N=2) of one 32-element block each, for every supported quant type.

  Nibble byte j holds element j (low) and element j+16 (high); we store
  low = j and high = 15 - j, so element j has q = j and element j+16 has q = 15-j:
  both extreme nibbles 0 and 15 occur in each half."""
  nibbles = np.array([j | ((15 - j) << 4) for j in range(16)], np.uint8)
  q = np.concatenate([np.arange(16), 15 - np.arange(16)]).astype(np.float32)
  rows_q41, rows_q40, rows_q80, want = [], [], [], {"Q4_1": [], "Q4_0": [], "Q8_0": []}
  int8s = np.array([-128, 127, -1, 0, 1] + list(range(-13, 14)), np.int8)
  for d, m in ((0.5, -1.0), (1.0, 3.0)):
    rows_q41.append(np.concatenate([_f16_bytes(d), _f16_bytes(m), nibbles]))
    want["Q4_1"].append(q * d + m)  # Q4_1: w = q * d + m  (q=0 -> m, q=15 -> 15d + m)
    rows_q40.append(np.concatenate([_f16_bytes(2 * d), nibbles]))
    want["Q4_0"].append((q - 8) * 2 * d)  # Q4_0: w = (q - 8) * d  (q=0 -> -8d, q=15 -> 7d)
    rows_q80.append(np.concatenate([_f16_bytes(d / 4), int8s.view(np.uint8)]))
    want["Q8_0"].append(int8s.astype(np.float32) * d / 4)  # Q8_0: w = q * d (-128 and 127 included)
  raw = {"Q4_1": np.stack(rows_q41), "Q4_0": np.stack(rows_q40), "Q8_0": np.stack(rows_q80)}
  return raw, {k: np.stack(v) for k, v in want.items()}


def test_block_formats_dequantize_bit_exact(tmp_path):
  raw, want = _hand_blocks()
  path = tmp_path / "blocks.gguf"
  _write_raw(path, {f"w_{k}": (r, Q[k]) for k, r in raw.items()})
  tensors = read_tensors(path)
  for kind in raw:
    qt = tensors[f"w_{kind}"]
    assert isinstance(qt, QuantizedTensor) and qt.shape == (32, 2)
    got = np.asarray(dequantize(qt)).T  # back to GGUF rows
    np.testing.assert_array_equal(got, want[kind], err_msg=kind)
    # gguf-py's own dequantizer agrees (an independent implementation).
    np.testing.assert_array_equal(gguf.quants.dequantize(raw[kind], Q[kind]), want[kind])


@pytest.mark.slow
def test_embedded_tensors_match_gguf_py_dequantizer(embedded_checkpoint):
  names = ["token_embd.weight", "blk.0.attn_q.weight", "blk.7.ffn_down.weight", "blk.29.attn_v.weight"]
  reader = gguf.GGUFReader(embedded_checkpoint.source)
  ours = read_tensors(embedded_checkpoint.source, names)
  for t in reader.tensors:
    if t.name in names:
      ref = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
      np.testing.assert_array_equal(np.asarray(dequantize(ours[t.name])).T, ref, err_msg=t.name)


@pytest.mark.parametrize("matrix_type,embed_type", [("Q4_1", "Q8_0"), ("Q4_0", "Q4_0"), ("Q8_0", "F16"),
                                                    ("F32", "F32")])
def test_tiny_gguf_model_matches_numpy_reference(tmp_path, matrix_type, embed_type):
  config = testing.tiny_config(tie_embeddings=(matrix_type != "Q8_0"))
  path = tmp_path / "tiny.gguf"
  testing.write_gguf_checkpoint(path, config, seed=3, matrix_type=matrix_type, embed_type=embed_type)
  ck = load_checkpoint(path)
  assert ck.format == "gguf" and ck.config.n_layers == 2 and ck.config.tie_embeddings == config.tie_embeddings
  tokens = np.array([5, 17, 42, 99, 200, 7, 3, 250])
  ref = numpy_reference.gguf_forward(path, tokens)  # interleaved rotary on permuted Q/K
  for mode in ("dense", "quantized"):
    model = Llama(ck.config, ck.params, weight_mode=mode)
    logits, _ = model(jnp.asarray(tokens)[None], jnp.zeros((1,), jnp.int32), KVCache.zeros(ck.config, 1, 16))
    # f32 throughout; differences are summation order only (|logits| ~ 10).
    np.testing.assert_allclose(np.asarray(logits[0]), ref, atol=2e-4, rtol=0)


# --- bad input -----------------------------------------------------------------


def test_missing_file_names_the_path(tmp_path):
  with pytest.raises(CheckpointError, match="nope.gguf: no such file"):
    load_checkpoint(tmp_path / "nope.gguf")


def test_not_a_gguf_file(tmp_path):
  p = tmp_path / "junk.gguf"
  p.write_bytes(b"PK\x03\x04 definitely not gguf")
  with pytest.raises(CheckpointError, match="junk.gguf: not a GGUF file"):
    load_checkpoint(p)


def test_truncated_gguf_names_file_and_tensor(tmp_path):
  p = tmp_path / "tiny.gguf"
  testing.write_gguf_checkpoint(p, testing.tiny_config())
  data = p.read_bytes()
  cut = tmp_path / "cut.gguf"
  cut.write_bytes(data[: len(data) - 1000])
  # Either gguf-py fails to map the last tensor or our size check names it.
  with pytest.raises(CheckpointError, match=r"cut.gguf: (corrupt or truncated GGUF file|truncated GGUF)"):
    load_gguf(cut)
  header_only = tmp_path / "header.gguf"
  header_only.write_bytes(data[:40])
  with pytest.raises(CheckpointError, match="header.gguf: corrupt or truncated GGUF file"):
    load_gguf(header_only)


def test_unsupported_tensor_type_names_type_and_tensor(tmp_path):
  p = tmp_path / "k.gguf"
  # 4 rows of one TQ2_0 super-block (256 ternary values: BitNet's type, not built) each;
  # contents irrelevant.
  raw = np.zeros((4, gguf.GGML_QUANT_SIZES[Q.TQ2_0][1]), np.uint8)
  _write_raw(p, {"blk.0.attn_q.weight": (raw, Q.TQ2_0)})
  with pytest.raises(CheckpointError, match=r"tensor 'blk.0.attn_q.weight' has type TQ2_0"):
    read_tensors(p)


def test_read_tensors_names_a_tensor_that_is_no_vector_or_matrix(tmp_path):
  """Before: numpy's reshape ValueError (a 3-D Q4_1 tensor)."""
  p = tmp_path / "cube.gguf"
  raw = np.zeros((1, 64, 2 * gguf.GGML_QUANT_SIZES[Q.Q4_1][1]), np.uint8)
  _write_raw(p, {"blk.0.attn_q.weight": (raw, Q.Q4_1)})
  with pytest.raises(CheckpointError, match=r"cube.gguf: tensor 'blk.0.attn_q.weight' has dims "
                                            r"\(64, 64, 1\): a vector or a matrix with elements"):
    read_tensors(p)


def test_loaded_vectors_are_not_views_of_the_file(tmp_path):
  """A norm read as a view of the mapped file changed when the file was edited in place
  (and a read after the file was cut ended the process with SIGBUS)."""
  p = tmp_path / "tiny.gguf"
  testing.write_gguf_checkpoint(p, testing.tiny_config())
  ck = load_checkpoint(p)
  norm = np.array(ck.params["final_norm"])
  stored = read_tensors(p, {"output_norm.weight"})["output_norm.weight"]
  np.testing.assert_array_equal(stored, norm)
  raw = bytearray(p.read_bytes())
  at = raw.index(norm.astype(np.float32).tobytes())
  raw[at:at + 4 * norm.size] = np.full(norm.size, 7.0, np.float32).tobytes()
  with open(p, "r+b") as f:  # in place, as an editor or a second download would
    f.write(raw)
  np.testing.assert_array_equal(ck.params["final_norm"], norm)
  np.testing.assert_array_equal(stored, norm)
  assert (read_tensors(p, {"output_norm.weight"})["output_norm.weight"] == 7.0).all()
