"""`check_checkpoint`: the cheap header check a launcher runs before loading anything, and
text the tokenizer cannot take as it is."""

import json
import time

import numpy as np
import pytest

from o1jax import testing
from o1jax.checkpoint import CheckpointError, check_checkpoint
from o1jax.checkpoint.gguf_loader import load_gguf
from o1jax.checkpoint.orbax_io import MANIFEST


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
  p = tmp_path_factory.mktemp("ck") / "tiny.gguf"
  testing.write_gguf_checkpoint(p, testing.tiny_config())
  return p


def test_good_checkpoints_pass(tiny_gguf, tmp_path):
  check_checkpoint(tiny_gguf)
  testing.write_hf_checkpoint(tmp_path / "hf", testing.tiny_config())
  check_checkpoint(tmp_path / "hf")


def test_embedded_model_check_is_cheap():
  t0 = time.perf_counter()
  check_checkpoint("embedded")
  # gguf-py's reader takes seconds on its 49152-token vocabulary; the check walks the header only.
  assert time.perf_counter() - t0 < 1.5


def test_missing_random_and_truncated_files(tiny_gguf, tmp_path):
  with pytest.raises(CheckpointError, match=r"nope.gguf: no such file or directory"):
    check_checkpoint(tmp_path / "nope.gguf")
  rnd = tmp_path / "random.gguf"
  rnd.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
  with pytest.raises(CheckpointError, match=r"random.gguf: not a GGUF file"):
    check_checkpoint(rnd)
  empty = tmp_path / "empty.gguf"
  empty.write_bytes(b"")
  with pytest.raises(CheckpointError, match=r"empty.gguf: not a GGUF file"):
    check_checkpoint(empty)
  data = tiny_gguf.read_bytes()
  cut = tmp_path / "cut.gguf"
  cut.write_bytes(data[:-1000])
  with pytest.raises(CheckpointError, match=r"cut.gguf: truncated GGUF file: tensor '.*' ends at byte \d+ "
                                            rf"but the file has {len(data) - 1000}"):
    check_checkpoint(cut)
  for n in (40, 200, 2000):  # cut inside the metadata / the tensor table
    head = tmp_path / f"head{n}.gguf"
    head.write_bytes(data[:n])
    with pytest.raises(CheckpointError, match=rf"head{n}.gguf: corrupt or truncated GGUF file"):
      check_checkpoint(head)
  # GGUF magic followed by garbage: counts that cannot fit in the file.
  garbage = tmp_path / "garbage.gguf"
  garbage.write_bytes(b"GGUF" + np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes())
  with pytest.raises(CheckpointError, match=r"garbage.gguf: corrupt or truncated GGUF file"):
    check_checkpoint(garbage)


def test_unsupported_architecture_in_header(tmp_path):
  """The header check and the full load refuse it with the same message."""
  p = tmp_path / "arch.gguf"
  testing.write_gguf_checkpoint(p, testing.tiny_config(), architecture="gpt2")
  for read in (check_checkpoint, load_gguf):
    with pytest.raises(CheckpointError, match="architecture 'gpt2' is not supported"):
      read(p)


def test_bad_hf_and_orbax_directories(tmp_path):
  hf = tmp_path / "hf"
  testing.write_hf_checkpoint(hf, testing.tiny_config())
  (hf / "model.safetensors").write_bytes((hf / "model.safetensors").read_bytes()[:-64])
  with pytest.raises(CheckpointError, match=r"model.safetensors: cannot be read as safetensors"):
    check_checkpoint(hf)
  (hf / "config.json").write_text("{not json")
  with pytest.raises(CheckpointError, match=r"config.json: not valid JSON"):
    check_checkpoint(hf)
  orbax = tmp_path / "orbax"
  orbax.mkdir()
  (orbax / MANIFEST).write_text(json.dumps({"config": {}}))
  with pytest.raises(CheckpointError, match=rf"orbax/{MANIFEST}: not a valid manifest"):
    check_checkpoint(orbax)


def test_tokenizer_takes_text_with_lone_surrogates():
  tok = testing._tiny_tokenizer()  # pylint: disable=protected-access
  # A lone surrogate is not text the tokenizer library accepts; it becomes U+FFFD.
  assert tok.encode("a\ud800b") == tok.encode("a\ufffdb")
  assert tok.encode("plain") == tok.backend.encode("plain", add_special_tokens=False).ids


def _tokenizer_with_template(template):
  from o1jax.checkpoint.tokenizer import Tokenizer
  from o1jax.testing import byte_vocab, SPECIAL_TOKENS
  meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm",
          "tokenizer.ggml.tokens": byte_vocab(), "tokenizer.ggml.merges": [],
          "tokenizer.ggml.token_type": [3] * len(SPECIAL_TOKENS) + [1] * 256,
          "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
          "tokenizer.chat_template": template}
  return Tokenizer.from_gguf_metadata(meta)


def test_chat_templates_that_cannot_run_are_named():
  """A template that does not parse fails at load; one that fails on some messages fails
  when it renders them; both with one line naming the chat template. Loop controls
  ({% break %}), which transformers enables, work."""
  with pytest.raises(CheckpointError, match=r"^GGUF: chat template cannot be parsed \(line 1\): "):
    _tokenizer_with_template("{% for m in messages %}{{ m.content }}")
  tok = _tokenizer_with_template("{{ messages[1].content | upper }}")
  with pytest.raises(ValueError, match="^chat template failed to render these messages: "
                                       "UndefinedError"):
    tok.apply_chat_template([{"role": "user", "content": "hi"}])
  assert tok.apply_chat_template([{"role": "user", "content": "a"},
                                  {"role": "assistant", "content": "b"}]) == "B"
  first = _tokenizer_with_template(
      "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}"
      "{% endfor %}")
  assert first.apply_chat_template([{"role": "user", "content": "x"},
                                    {"role": "user", "content": "y"}]) == "x"
  refuses = _tokenizer_with_template("{{ raise_exception('only user turns') }}")
  with pytest.raises(ValueError, match="^chat template: only user turns$"):
    refuses.apply_chat_template([{"role": "user", "content": "x"}])


def _with_metadata_value(src: bytes, key: str, value: int) -> bytes:
  """A GGUF's bytes with the uint32 metadata value of `key` replaced."""
  import struct
  at = src.index(key.encode()) + len(key)
  assert struct.unpack_from("<I", src, at)[0] == 4  # GGUFValueType.UINT32
  out = bytearray(src)
  struct.pack_into("<I", out, at + 4, value)
  return bytes(out)


@pytest.mark.parametrize("key", ["llama.attention.head_count", "llama.attention.head_count_kv",
                                 "llama.block_count", "llama.context_length"])
def test_gguf_size_of_zero_is_named_by_check_and_load(tiny_gguf, tmp_path, key):
  # Before: ZeroDivisionError from the loader (head counts), or a model that loaded and then
  # refused every prompt (context 0) or had no layers; the header check passed them all.
  p = tmp_path / "zero.gguf"
  p.write_bytes(_with_metadata_value(tiny_gguf.read_bytes(), key, 0))
  for read in (check_checkpoint, load_gguf):
    with pytest.raises(CheckpointError, match=rf"^{p}: GGUF metadata key '{key}' is 0, "
                                              r"expected an integer >= 1$"):
      read(p)


def test_hf_config_and_tokenizer_files_that_are_not_what_they_should_be(tmp_path):
  from o1jax.checkpoint import load_checkpoint
  hf = tmp_path / "hf"
  testing.write_hf_checkpoint(hf, testing.tiny_config())
  good_config = (hf / "config.json").read_text()
  # Before: AttributeError ('list' object has no attribute 'get').
  (hf / "config.json").write_text("[]")
  with pytest.raises(CheckpointError, match=rf"^{hf}/config.json: expected a JSON object, got list$"):
    check_checkpoint(hf)
  # Before: ZeroDivisionError computing head_dim, or a model with no heads.
  hf_config = json.loads(good_config)
  hf_config.update(num_attention_heads=0)
  hf_config.pop("head_dim", None)
  (hf / "config.json").write_text(json.dumps(hf_config))
  with pytest.raises(CheckpointError, match=rf"^{hf}/config.json: n_heads=0 must be >= 1$"):
    check_checkpoint(hf)
  (hf / "config.json").write_text(good_config)
  # Before: the check passed and each worker's load raised a bare JSONDecodeError.
  (hf / "tokenizer_config.json").write_text("{not json")
  for read in (check_checkpoint, load_checkpoint):
    with pytest.raises(CheckpointError, match=rf"^{hf}/tokenizer_config.json: not valid JSON \("):
      read(hf)
  (hf / "tokenizer_config.json").unlink()
  # A shard index that does not parse: named, not a bare JSONDecodeError.
  (hf / "model.safetensors.index.json").write_text('{"weight_map": ')
  with pytest.raises(CheckpointError,
                     match=rf"^{hf}/model.safetensors.index.json: not valid JSON \("):
    check_checkpoint(hf)


@pytest.mark.parametrize("key, value, kind", [("hidden_size", "big", "an integer"),
                                              ("num_hidden_layers", 2.5, "an integer"),
                                              ("vocab_size", True, "an integer"),
                                              ("rms_norm_eps", "1e-6", "a number")])
def test_hf_config_value_of_the_wrong_type_is_named_with_its_key(tmp_path, key, value, kind):
  # Before: "invalid literal for int() with base 10: 'big'" without the key.
  hf = tmp_path / "hf"
  testing.write_hf_checkpoint(hf, testing.tiny_config())
  hf_config = json.loads((hf / "config.json").read_text())
  hf_config[key] = value
  (hf / "config.json").write_text(json.dumps(hf_config))
  with pytest.raises(CheckpointError, match=rf"^{hf}/config.json: {key}={value!r} is not {kind}$"):
    check_checkpoint(hf)


def test_a_chat_template_that_does_not_parse_is_found_by_the_check(tmp_path):
  # Before: the header check passed and each worker failed at load, without the file.
  broken = "{% for m in messages %}{{ m.content }}"
  gguf = tmp_path / "t.gguf"
  testing.write_gguf_checkpoint(gguf, testing.tiny_config(), chat_template=broken)
  with pytest.raises(CheckpointError, match=rf"^{gguf}: chat template cannot be parsed \(line 1\): "):
    check_checkpoint(gguf)
  hf = tmp_path / "hf"
  testing.write_hf_checkpoint(hf, testing.tiny_config())
  cfg = json.loads((hf / "tokenizer_config.json").read_text())
  (hf / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": broken}))
  with pytest.raises(CheckpointError,
                     match=rf"^{hf}/tokenizer_config.json: chat template cannot be parsed"):
    check_checkpoint(hf)
