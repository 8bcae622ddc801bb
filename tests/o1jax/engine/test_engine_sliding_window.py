"""Gemma 3's local layers in the engine: greedy tokens equal the contiguous Generator's
(whose cache masks keys by position, checked against the numpy reference in
tests/o1jax/model/test_gemma3.py) on prompts and outputs much longer than the window,
so the window is applied in chunked prefill (chunks of 16 over 8-token windows), in
paged decode (blocks of 4: the window starts mid-block) and in draft verification."""

import dataclasses

import numpy as np
import pytest

from o1jax.checkpoint import load_checkpoint
from o1jax.engine import Engine, EngineConfig, GenerationParams, Request
from o1jax.model import Generator, Llama
from o1jax.testing import tiny_gemma3_config, write_hf_checkpoint

WINDOW = 8
GREEDY = GenerationParams(max_new_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
  path = tmp_path_factory.mktemp("tiny_gemma3_engine")
  write_hf_checkpoint(path, tiny_gemma3_config(max_context=256, sliding_window=WINDOW), seed=3)
  ck = load_checkpoint(path)
  params = dict(ck.params)
  params["embed"] = np.asarray(params["embed"]) * 0.05  # soft logits: greedy does not loop
  return Llama(ck.config, params), ck.tokenizer, params


def _prompts(n, seed, low, high):
  rng = np.random.default_rng(seed)
  return [rng.integers(3, 259, size=int(rng.integers(low, high))).tolist() for _ in range(n)]


def test_engine_greedy_matches_the_contiguous_generator(gemma):
  model, tok, _ = gemma
  prompts = _prompts(5, seed=1, low=2, high=60)
  engine = Engine(model, tok, EngineConfig(max_slots=8, block_size=4, num_blocks=256,
                                           prefill_chunk=16))
  got = engine.generate([Request(p, GREEDY) for p in prompts])
  want = Generator(model, tok).generate(prompts, max_new_tokens=GREEDY.max_new_tokens)
  for g, w in zip(got, want):
    assert len(g.token_ids) == GREEDY.max_new_tokens
    assert g.token_ids == w.token_ids[:len(g.token_ids)]


def test_window_changes_the_engine_tokens(gemma):
  """The engine really masks: the same weights with the window removed decode other tokens."""
  model, tok, params = gemma
  wide = Llama(dataclasses.replace(model.config, sliding_window=10_000), params)
  prompts = _prompts(3, seed=2, low=30, high=50)
  cfg = EngineConfig(max_slots=4, block_size=4, num_blocks=256, prefill_chunk=16)
  a = Engine(model, tok, cfg).generate([Request(p, GREEDY) for p in prompts])
  b = Engine(wide, tok, cfg).generate([Request(p, GREEDY) for p in prompts])
  assert any(x.token_ids != y.token_ids for x, y in zip(a, b))


def test_pallas_kernels_apply_the_window(gemma):
  """The Pallas paged prefill and decode kernels (interpret mode on CPU; on a GPU the
  same kernels compiled) with the local layers' window: the Generator's greedy tokens."""
  model, tok, params = gemma
  pallas = Llama(model.config, params, backend="pallas", interpret=True)
  prompts = _prompts(1, seed=3, low=20, high=21)
  engine = Engine(pallas, tok, EngineConfig(max_slots=1, block_size=8, num_blocks=16,
                                            prefill_chunk=16))
  params6 = GenerationParams(max_new_tokens=6, ignore_eos=True)
  got = engine.generate([Request(prompts[0], params6)])[0].token_ids
  assert got == Generator(model, tok).generate(prompts, max_new_tokens=6)[0].token_ids
