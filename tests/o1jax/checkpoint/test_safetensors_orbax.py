"""HF safetensors import, orbax conversion, and identical logits across formats."""

import json
import os
import pathlib
import subprocess
import sys
import time

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from o1jax import numpy_reference, testing
from o1jax.checkpoint import CheckpointError, load_checkpoint
from o1jax.checkpoint.orbax_io import save_orbax
from o1jax.checkpoint.safetensors_loader import save_safetensors
from o1jax.model import KVCache, Llama

TOKENS = np.array([5, 17, 42, 99, 200, 7, 3, 250, 11, 64])


def _logits(ck, tokens=TOKENS):
  model = Llama(ck.config, ck.params)
  logits, _ = model(jnp.asarray(tokens)[None], jnp.zeros((1,), jnp.int32),
                    KVCache.zeros(ck.config, 1, len(tokens)))
  return np.asarray(logits[0])


def _hp(config):
  return {"n_layers": config.n_layers, "n_heads": config.n_heads, "n_kv_heads": config.n_kv_heads,
          "head_dim": config.head_dim, "theta": config.rope_theta, "eps": config.rms_eps}


@pytest.mark.parametrize("dtype,shards,overrides", [
    (np.float32, 1, {}),
    (ml_dtypes.bfloat16, 1, {}),
    (np.float16, 3, {"tie_embeddings": False}),
    (np.float32, 2, {"architecture": "qwen2", "attention_bias": True}),
    (np.float32, 1, {"architecture": "mistral", "n_kv_heads": 1}),
])
def test_hf_checkpoint_matches_numpy_reference(tmp_path, dtype, shards, overrides):
  config = testing.tiny_config(**overrides)
  weights = testing.write_hf_checkpoint(tmp_path, config, seed=1, dtype=dtype, shards=shards)
  ck = load_checkpoint(tmp_path)
  assert ck.format == "safetensors"
  assert ck.config.attention_bias == config.attention_bias
  assert ck.config.tie_embeddings == config.tie_embeddings
  ref = numpy_reference.forward(weights, _hp(config), TOKENS, interleaved_rotary=False)
  np.testing.assert_allclose(_logits(ck), ref, atol=2e-4, rtol=0)


def test_tiny_gguf_safetensors_orbax_give_identical_logits(tmp_path):
  gguf_path = tmp_path / "tiny.gguf"
  testing.write_gguf_checkpoint(gguf_path, testing.tiny_config(), seed=2)
  ck = load_checkpoint(gguf_path)
  save_safetensors(tmp_path / "hf", ck.config, ck.params)
  ck.tokenizer.save(tmp_path / "hf")
  save_orbax(tmp_path / "orbax", ck.config, ck.params, ck.tokenizer)
  from_gguf = _logits(ck)
  np.testing.assert_array_equal(_logits(load_checkpoint(tmp_path / "hf")), from_gguf)
  orbax_ck = load_checkpoint(tmp_path / "orbax")
  assert orbax_ck.config == ck.config
  np.testing.assert_array_equal(_logits(orbax_ck), from_gguf)
  text = "<|im_start|>user\nhello 123<|im_end|>"
  assert orbax_ck.tokenizer.encode(text) == ck.tokenizer.encode(text)


def test_a_gemma3_gguf_and_a_windowed_mistral_convert_and_load_back(tmp_path):
  """A Gemma 3 GGUF's config says "gemma3" (HF: gemma3_text): its orbax copy was checked
  against Llama's tensor names and refused its post-norms. A Mistral's window on every
  layer is written to config.json (absent, transformers' default window of 4096 applies)."""
  gguf_path = tmp_path / "gemma.gguf"
  testing.write_gguf_checkpoint(gguf_path, testing.tiny_gemma3_config(), seed=2)
  ck = load_checkpoint(gguf_path)
  save_orbax(tmp_path / "orbax", ck.config, ck.params, ck.tokenizer)
  orbax_ck = load_checkpoint(tmp_path / "orbax")
  assert orbax_ck.config == ck.config
  np.testing.assert_array_equal(_logits(orbax_ck), _logits(ck))
  for window in (4, None):
    hf = tmp_path / f"mistral{window}"
    testing.write_hf_checkpoint(hf, testing.tiny_config(architecture="mistral"))
    value = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**value, "sliding_window": window}))
    mistral = load_checkpoint(hf)
    save_safetensors(tmp_path / f"copy{window}", mistral.config, mistral.params)
    mistral.tokenizer.save(tmp_path / f"copy{window}")
    copy = load_checkpoint(tmp_path / f"copy{window}")
    assert (copy.config.sliding_window, copy.config.sliding_window_pattern) == (
        (window, 0) if window else (None, 1))
    np.testing.assert_array_equal(_logits(copy), _logits(mistral))


@pytest.mark.slow
def test_embedded_model_identical_logits_across_formats(tmp_path, embedded_checkpoint):
  """GGUF -> orbax via the convert script, GGUF -> safetensors; same logits bit for bit."""
  ck = embedded_checkpoint
  ids = ck.tokenizer.encode(ck.tokenizer.apply_chat_template([{"role": "user", "content": "Hi there!"}]))
  out = subprocess.run([sys.executable, "scripts/convert_checkpoint.py", "embedded", str(tmp_path / "orbax")],
                       capture_output=True, text=True, check=True)
  assert "load gguf source" in out.stdout and "load converted orbax" in out.stdout
  save_safetensors(tmp_path / "hf", ck.config, ck.params)
  ck.tokenizer.save(tmp_path / "hf")
  ref = _logits(ck, ids)
  np.testing.assert_array_equal(_logits(load_checkpoint(tmp_path / "orbax"), ids), ref)
  np.testing.assert_array_equal(_logits(load_checkpoint(tmp_path / "hf"), ids), ref)


def _convert_script():
  import importlib.util
  spec = importlib.util.spec_from_file_location(
      "convert_checkpoint", pathlib.Path(__file__).resolve().parents[3] / "scripts" / "convert_checkpoint.py")
  convert = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(convert)
  return convert


def test_a_conversion_that_fails_leaves_the_destination_as_it_was(tmp_path):
  """A refused save (Gemma 3 as safetensors) left an empty directory, and a copy that did
  not load stayed: every later load and rerun refused it."""
  convert = _convert_script()
  gemma = tmp_path / "gemma.gguf"
  testing.write_gguf_checkpoint(gemma, testing.tiny_gemma3_config(), seed=2)
  with pytest.raises(CheckpointError, match="saving a 'gemma3' model as safetensors is not supported"):
    convert.convert(str(gemma), str(tmp_path / "new"), "safetensors")
  assert not (tmp_path / "new").exists()
  (tmp_path / "empty").mkdir()
  with pytest.raises(CheckpointError):
    convert.convert(str(gemma), str(tmp_path / "empty"), "safetensors")
  assert (tmp_path / "empty").is_dir() and not any((tmp_path / "empty").iterdir())
  assert convert.convert(str(gemma), str(tmp_path / "new"))["source_format"] == "gguf"


def test_a_conversion_stopped_or_out_of_space_leaves_no_copy_that_loads(tmp_path, monkeypatch):
  """A conversion killed between tokenizer.json and tokenizer_config.json left a copy that
  loaded with no BOS and the ChatML fallback template (session red-team); a full disk was
  a traceback; a failed conversion left the parent directories it made. The copy is now
  written beside the destination and renamed into place; save_orbax writes its manifest
  last."""
  import errno

  from o1jax.checkpoint import orbax_io, tokenizer as tokenizer_module
  convert = _convert_script()
  src = tmp_path / "tiny.gguf"
  testing.write_gguf_checkpoint(src, testing.tiny_config(), seed=3)
  real_save = tokenizer_module.Tokenizer.save

  def stopped_halfway(self, directory):
    real_save(self, directory)
    (pathlib.Path(directory) / "tokenizer_config.json").unlink()  # as if killed before it
    raise KeyboardInterrupt

  monkeypatch.setattr(tokenizer_module.Tokenizer, "save", stopped_halfway)
  for fmt in ("orbax", "safetensors"):
    with pytest.raises(KeyboardInterrupt):
      convert.convert(str(src), str(tmp_path / "a" / "b" / fmt), fmt)
    assert not (tmp_path / "a").exists()  # (the parents it made too)
  # save_orbax itself: a stop in the tokenizer leaves no manifest, so no checkpoint.
  ck = load_checkpoint(src)
  with pytest.raises(KeyboardInterrupt):
    orbax_io.save_orbax(tmp_path / "direct", ck.config, ck.params, ck.tokenizer)
  with pytest.raises(CheckpointError, match="directory holds neither o1jax_model.json"):
    load_checkpoint(tmp_path / "direct")
  monkeypatch.setattr(tokenizer_module.Tokenizer, "save", real_save)

  def full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")

  monkeypatch.setattr(convert, "save_safetensors", full)
  (tmp_path / "empty").mkdir()
  with pytest.raises(CheckpointError, match=r"/empty: cannot write the checkpoint: OSError: "
                                            r"\[Errno 28\] No space left on device$"):
    convert.convert(str(src), str(tmp_path / "empty"), "safetensors")
  assert list(tmp_path.glob(".*converting*")) == [] and not any((tmp_path / "empty").iterdir())
  monkeypatch.undo()
  # What a conversion killed with kill -9 left (pid 2**22 + 1: above Linux's pid_max, no
  # process) does not make the destination "not empty".
  (tmp_path / "empty" / f".converting-{2**22 + 1}" / "params").mkdir(parents=True)
  assert convert.convert(str(src), str(tmp_path / "empty"), "safetensors")["source_format"] == "gguf"
  assert load_checkpoint(tmp_path / "empty").tokenizer.bos_id == ck.tokenizer.bos_id


_WRITER_NOISE_DRIVER = """
import importlib.util, pathlib, sys, threading, time
spec = importlib.util.spec_from_file_location("convert_checkpoint", sys.argv[1])
convert = importlib.util.module_from_spec(spec)
spec.loader.exec_module(convert)

def failing_save(staging, *args):
  # As orbax on a full disk: its threads print tracebacks before the error and after it,
  # and write files after its save has raised.
  def after():
    time.sleep(0.3)
    print("Traceback (most recent call last):\\nRuntimeError: Event loop is closed",
          file=sys.stderr)
    (staging / "late").mkdir(parents=True, exist_ok=True)
    (staging / "late" / "chunk").write_bytes(b"x")
  threading.Thread(target=after).start()
  print("ERROR:absl:_SignalingThread.run() raised an exception", file=sys.stderr)
  raise ValueError("RESOURCE_EXHAUSTED: Error writing: No space left on device\\nmore")

convert.save_orbax = failing_save
sys.exit(convert.main([sys.argv[2], sys.argv[3]]))
"""


def test_a_failed_orbax_write_is_one_line_and_leaves_nothing(tmp_path):
  """On a full disk orbax's threads printed ~240 lines of tracebacks around the one-line
  error, and went on writing after the save raised: the destination the conversion had
  removed came back with 20-odd files (measured on a 600 KiB tmpfs)."""
  src = tmp_path / "tiny.gguf"
  testing.write_gguf_checkpoint(src, testing.tiny_config(), seed=3)
  script = pathlib.Path(__file__).resolve().parents[3] / "scripts" / "convert_checkpoint.py"
  driver = tmp_path / "driver.py"
  driver.write_text(_WRITER_NOISE_DRIVER)
  out = subprocess.run([sys.executable, str(driver), str(script), str(src), str(tmp_path / "a" / "out")],
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 2
  assert out.stderr.splitlines() == [
      f"error: {tmp_path / 'a' / 'out'}: cannot write the checkpoint: ValueError: "
      f"RESOURCE_EXHAUSTED: Error writing: No space left on device"], out.stderr
  assert not (tmp_path / "a").exists()


@pytest.mark.skipif(sys.platform != "linux" or not hasattr(os, "geteuid") or os.geteuid() != 0,
                    reason="mounts a small tmpfs (root on Linux)")
def test_a_conversion_onto_a_full_disk_is_one_line_and_leaves_nothing(tmp_path):
  """The real case of the test above: the embedded model (100 MB) onto a 600 KiB tmpfs."""
  disk = tmp_path / "disk"
  disk.mkdir()
  if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(disk)],
                    capture_output=True).returncode != 0:
    pytest.skip("cannot mount a tmpfs here")
  try:
    script = pathlib.Path(__file__).resolve().parents[3] / "scripts" / "convert_checkpoint.py"
    out = subprocess.run([sys.executable, str(script), "embedded", str(disk / "out")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    assert len(out.stderr.splitlines()) == 1, out.stderr
    assert out.stderr.startswith(f"error: {disk / 'out'}: cannot write the checkpoint: ")
    assert "No space left on device" in out.stderr
    time.sleep(1.0)  # (what orbax's threads wrote after the removal came within a second)
    assert list(disk.iterdir()) == []
  finally:
    subprocess.run(["umount", str(disk)], check=True)


def test_hf_errors_name_the_file(tmp_path):
  with pytest.raises(CheckpointError, match="neither o1jax_model.json"):
    load_checkpoint(tmp_path)
  config = testing.tiny_config()
  testing.write_hf_checkpoint(tmp_path, config)
  cfg = json.loads((tmp_path / "config.json").read_text())
  (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt_neox"}))
  with pytest.raises(CheckpointError, match="model_type 'gpt_neox' is not supported"):
    load_checkpoint(tmp_path)
  del cfg["hidden_size"]
  (tmp_path / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(CheckpointError, match="config.json lacks the key 'hidden_size'"):
    load_checkpoint(tmp_path)


def test_hf_missing_tensor_is_named(tmp_path):
  from safetensors.numpy import load_file, save_file

  testing.write_hf_checkpoint(tmp_path, testing.tiny_config())
  tensors = load_file(str(tmp_path / "model.safetensors"))
  del tensors["model.layers.1.mlp.up_proj.weight"]
  save_file(tensors, str(tmp_path / "model.safetensors"))
  with pytest.raises(CheckpointError, match="tensor 'model.layers.1.mlp.up_proj.weight' is missing"):
    load_checkpoint(tmp_path)


@pytest.mark.parametrize("fmt", ["orbax", "safetensors"])
def test_saving_refuses_to_overwrite_and_names_the_destination(tmp_path, fmt):
  # Before (safetensors): config.json in a non-empty directory overwritten; a file as the
  # destination a NotADirectoryError traceback.
  save = {"orbax": lambda d, ck: save_orbax(d, ck.config, ck.params, ck.tokenizer),
          "safetensors": lambda d, ck: save_safetensors(d, ck.config, ck.params)}[fmt]
  (tmp_path / "x").mkdir()
  (tmp_path / "x" / "config.json").write_text("precious")
  gguf_path = tmp_path / "tiny.gguf"
  testing.write_gguf_checkpoint(gguf_path, testing.tiny_config())
  ck = load_checkpoint(gguf_path)
  with pytest.raises(CheckpointError, match=r"/x: destination exists and is not empty$"):
    save(tmp_path / "x", ck)
  assert (tmp_path / "x" / "config.json").read_text() == "precious"
  with pytest.raises(CheckpointError, match=r"tiny\.gguf: destination is a file, not a directory$"):
    save(gguf_path, ck)
  with pytest.raises(CheckpointError, match=r"/tiny\.gguf/sub: cannot create the destination: "):
    save(gguf_path / "sub", ck)
  with pytest.raises(CheckpointError, match=r"^destination is empty: name the directory"):
    save("", ck)


def test_an_orbax_checkpoint_without_its_tokenizer_config_is_refused(tmp_path):
  """Without tokenizer_config.json a copy loaded with no BOS and the ChatML fallback
  template, which is what save_orbax writes its manifest last to prevent."""
  src = tmp_path / "tiny.gguf"
  testing.write_gguf_checkpoint(src, testing.tiny_config(), seed=3)
  ck = load_checkpoint(src)
  save_orbax(tmp_path / "o", ck.config, ck.params, ck.tokenizer)
  (tmp_path / "o" / "tokenizer" / "tokenizer_config.json").unlink()
  from o1jax.checkpoint import check_checkpoint
  for read in (check_checkpoint, load_checkpoint):
    with pytest.raises(CheckpointError, match=rf"^{tmp_path / 'o' / 'tokenizer'}: "
                                              r"tokenizer_config.json is missing$"):
      read(tmp_path / "o")


def test_ctrl_c_during_the_save_is_said_on_stderr(tmp_path, monkeypatch, capsys):
  """The writers' stderr buffer became a sink for every BaseException out of the save: a
  Ctrl-C there (KeyboardInterrupt) ended the run with nothing said."""
  convert = _convert_script()
  src = tmp_path / "tiny.gguf"
  testing.write_gguf_checkpoint(src, testing.tiny_config(), seed=3)

  def interrupted(*args, **kwargs):
    print("a writer's warning", file=sys.stderr)
    raise KeyboardInterrupt

  monkeypatch.setattr(convert, "save_orbax", interrupted)
  stderr = sys.stderr
  with pytest.raises(KeyboardInterrupt):
    convert.main([str(src), str(tmp_path / "out")])
  assert sys.stderr is stderr  # (the real one again: the traceback reaches the user)
  assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fmt", ["orbax", "safetensors"])
def test_a_saved_checkpoint_is_readable_as_the_umask_allows(tmp_path, fmt):
  # Before: safetensors wrote model.safetensors 0600 beside a 0644 config.json, so the
  # other users of a shared model folder (a cluster's workers) could not read the weights.
  import os
  import stat
  gguf_path = tmp_path / "tiny.gguf"
  testing.write_gguf_checkpoint(gguf_path, testing.tiny_config())
  ck = load_checkpoint(gguf_path)
  old = os.umask(0o022)
  try:
    if fmt == "orbax":
      save_orbax(tmp_path / "out", ck.config, ck.params, ck.tokenizer)
    else:
      save_safetensors(tmp_path / "out", ck.config, ck.params)
  finally:
    os.umask(old)
  modes = {str(p.relative_to(tmp_path)): stat.S_IMODE(p.stat().st_mode)
           for p in (tmp_path / "out").rglob("*") if p.is_file()}
  assert modes and all(m & 0o044 == 0o044 for m in modes.values()), modes
