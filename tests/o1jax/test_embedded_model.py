"""End to end on the embedded SmolLM2-135M: reference logits, Pallas backend, the CLI."""

import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from o1jax import numpy_reference
from o1jax.model import KVCache, Llama

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "What is 12 times 7?"}]


def test_embedded_config_from_metadata(embedded_checkpoint):
  c = embedded_checkpoint.config
  assert (c.n_layers, c.d_model, c.ffn_dim, c.n_heads, c.n_kv_heads, c.head_dim) == (30, 576, 1536, 9, 3, 64)
  assert (c.vocab_size, c.rope_theta, c.max_context, c.tie_embeddings, c.eos_ids) == (
      49152, 100000.0, 8192, True, (2,))
  assert embedded_checkpoint.tokenizer.vocab_size == 49152


def test_embedded_logits_match_numpy_reference(embedded_checkpoint):
  """Independent f32 numpy forward (gguf-py dequantization, interleaved rotary on
  the permuted weights). Tolerance 1e-3: both are f32 with different summation
  orders over 30 layers; logits reach ~40, so this is ~3e-5 relative (measured 1.1e-4)."""
  ck = embedded_checkpoint
  ids = ck.tokenizer.encode(ck.tokenizer.apply_chat_template(CHAT))
  ref = numpy_reference.gguf_forward(ck.source, ids)
  for mode in ("dense", "quantized"):
    model = Llama(ck.config, ck.params, weight_mode=mode)
    logits, _ = model(jnp.asarray([ids]), jnp.zeros((1,), jnp.int32), KVCache.zeros(ck.config, 1, len(ids)))
    np.testing.assert_allclose(np.asarray(logits[0]), ref, atol=1e-3, rtol=0, err_msg=mode)


def test_pallas_backend_interpret_matches_reference_greedy(embedded_checkpoint, embedded_generator):
  """Every heavy op through the Pallas kernels (interpret mode on CPU): quantized
  weights through the fused matmul, the engine's paged cache through the paged
  prefill and decode attention kernels. Same greedy tokens as the XLA reference."""
  from o1jax.engine import Engine, EngineConfig, Request

  ck = embedded_checkpoint
  model = Llama(ck.config, ck.params, backend="pallas", interpret=True, weight_mode="quantized")
  engine = Engine(model, ck.tokenizer, EngineConfig(max_slots=1, num_blocks=64, max_context=256))
  got = engine.generate([Request(prompt=CHAT, params={"max_new_tokens": 4})])[0].token_ids
  assert got == embedded_generator.generate([CHAT], max_new_tokens=4)[0].token_ids


@pytest.mark.parametrize("matmul_dtype", ["float32", "int8"])
def test_generate_cli_streams_an_answer(matmul_dtype):
  out = subprocess.run([sys.executable, "-m", "o1jax.generate", "--prompt", "What is the capital of France?",
                        "--max_new_tokens", "24", "--matmul_dtype", matmul_dtype],
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr
  assert "Paris" in out.stdout
  assert "tok/s" in out.stderr


def test_generate_cli_reports_bad_model_path(tmp_path):
  out = subprocess.run([sys.executable, "-m", "o1jax.generate", "--prompt", "hi", "--model",
                        str(tmp_path / "missing.gguf")], capture_output=True, text=True, timeout=300)
  assert out.returncode == 2
  assert "missing.gguf: no such file" in out.stderr and "Traceback" not in out.stderr


def test_engine_greedy_equals_generator_on_chat_prompts(embedded_checkpoint, embedded_generator):
  """The serving engine (paged cache, continuous batching) against the simple generator."""
  from o1jax.engine import Engine, EngineConfig, Request

  ck = embedded_checkpoint
  prompts = [CHAT, [{"role": "user", "content": "Name three primary colors."}],
             [{"role": "user", "content": "Write a Python function that reverses a string."}]]
  engine = Engine(Llama(ck.config, ck.params), ck.tokenizer, EngineConfig(max_slots=4, max_context=512))
  got = engine.generate([Request(prompt=p, params={"max_new_tokens": 24}) for p in prompts])
  want = embedded_generator.generate(prompts, max_new_tokens=24)
  assert [r.token_ids for r in got] == [w.token_ids for w in want]
  assert [r.text for r in got] == [w.text for w in want]


def test_engine_fp8_activations_do_not_depend_on_the_batch(embedded_checkpoint):
  """matmul_dtype="float8" rounds each row to e4m3, which turns any batch-dependent f32
  difference into whole e4m3 steps: the products must not depend on the batch (on a CPU
  the native f32 kernel's rows do not; XLA's dot forked these prompts at batch 1 vs 3)."""
  from o1jax.engine import Engine, EngineConfig, Request

  ck = embedded_checkpoint
  prompts = [[{"role": "user", "content": c}]
             for c in ("What is 2+3?", "Name a color.", "Write a haiku about rain.")]
  engine = Engine(Llama(ck.config, ck.params, matmul_dtype="float8"), ck.tokenizer,
                  EngineConfig(max_slots=4, max_context=512))
  params = {"max_new_tokens": 16}
  together = engine.generate([Request(prompt=p, params=params) for p in prompts])
  alone = [engine.generate([Request(prompt=p, params=params)])[0] for p in prompts]
  assert [r.token_ids for r in alone] == [r.token_ids for r in together]
