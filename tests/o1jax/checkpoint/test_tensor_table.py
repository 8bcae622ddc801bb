"""The tensor-table check both loaders share (`tensor_table.check_tensors`): messages the
bad-input tests do not reach, and what each loader asks of it differently."""

import pytest

from o1jax import testing
from o1jax.checkpoint import CheckpointError
from o1jax.checkpoint import gguf_loader, safetensors_loader
from o1jax.checkpoint.gguf_loader import load_gguf


def _gguf(config, **extra):
  """(dims, types) of a GGUF file holding what `config` reads, plus `extra` F32 tensors."""
  dims = {name: d for name, d, required in gguf_loader._expected_tensors(config) if required}
  dims.update(extra)
  return dims, {name: "F32" for name in dims}


def _hf(config, **extra):
  """An HF header table ({name: (shard, shape)}) holding what `config` reads, plus `extra`."""
  headers = {name: ("s", shape)
             for *_, name, shape, read in safetensors_loader.expected_tensors(config) if read}
  headers.update({name: ("s", shape) for name, shape in extra.items()})
  return headers


def test_gguf_layer_tensor_that_blk0_lacks_is_not_read():
  config = testing.tiny_config()
  gguf_loader._check_tensors("f.gguf", config, *_gguf(config))
  with pytest.raises(CheckpointError, match=r"^f.gguf: tensor 'blk.1.attn_q.bias' is not read: blk.0 "
                                            r"has no such tensor, so the model would ignore it$"):
    gguf_loader._check_tensors("f.gguf", config, *_gguf(config, **{"blk.1.attn_q.bias": (64,)}))
  # GGUF checks an unread tensor's shape first (numpy's order); HF names it unread.
  with pytest.raises(CheckpointError, match=r"^f.gguf: tensor 'blk.1.attn_q.bias' has shape \(65,\), "
                                            r"expected \(64,\)$"):
    gguf_loader._check_tensors("f.gguf", config, *_gguf(config, **{"blk.1.attn_q.bias": (65,)}))
  with pytest.raises(CheckpointError, match=r"^d: tensor 'model.layers.1.self_attn.q_proj.bias' is not "
                                            r"read by the model config.json describes"):
    safetensors_loader._check_tensors(
        "d", config, _hf(config, **{"model.layers.1.self_attn.q_proj.bias": (65,)}))


def test_gguf_matrix_shapes_print_in_numpy_order():
  config = testing.tiny_config(tie_embeddings=False)
  dims, types = _gguf(config, **{"output.weight": (64, 300)})
  with pytest.raises(CheckpointError, match=r"tensor 'output.weight' has shape \(300, 64\), expected "
                                            r"\(259, 64\)$"):
    gguf_loader._check_tensors("f.gguf", config, dims, types)
  with pytest.raises(CheckpointError, match=r"tensor 'lm_head.weight' has shape \(300, 64\), expected "
                                            r"\(259, 64\)$"):
    safetensors_loader._check_tensors("d", config, _hf(config, **{"lm_head.weight": (300, 64)}))


def test_gguf_q_k_norms_in_a_permuted_file_are_refused(tmp_path):
  p = tmp_path / "qk.gguf"
  testing.write_gguf_checkpoint(p, testing.tiny_config(qk_norm=True))
  with pytest.raises(CheckpointError, match=r"qk.gguf: q/k norms in a 'llama' file \(permuted Q/K rows\) "
                                            r"are not supported"):
    load_gguf(p)


def test_gguf_tokenizer_metadata_names_every_token_id_key(tmp_path):
  p = tmp_path / "tiny.gguf"
  testing.write_gguf_checkpoint(p, testing.tiny_config())
  _, params, meta = load_gguf(p)
  assert set(gguf_loader._TOKEN_ID_KEYS) <= set(meta)
  assert (meta["tokenizer.ggml.bos_token_id"], meta["tokenizer.ggml.eos_token_id"]) == (1, 2)
  assert "lm_head" not in params and len(params["layers"]) == 2
  assert "bq" not in params["layers"][0] and "q_norm" not in params["layers"][0]
