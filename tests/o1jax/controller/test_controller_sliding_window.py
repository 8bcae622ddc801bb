"""Gemma 3's local layers in the controller: over the paged cache (blocks of 4, shared
prompt blocks, backtracking) the loop gives the contiguous cache's traces on prompts and
reasoning longer than the 8-token window."""

import numpy as np
import pytest
from flax import nnx

from o1jax.checkpoint import load_checkpoint
from o1jax.controller import ContiguousLlama, Controller, PagedLlama, ReasoningRequest, get_policy
from o1jax.model import Llama
from o1jax.testing import tiny_gemma3_config, write_hf_checkpoint
from tests.o1jax.controller.test_paged_model import _same_results

PROMPTS = ["hello there, a prompt longer than the window", "0123456789abcdef"]
COMMON = dict(max_thinking_tokens=24, max_answer_tokens=3, step_delimiter="a", step_max_tokens=6)


@pytest.fixture(scope="module")
def controllers(tmp_path_factory):
  path = tmp_path_factory.mktemp("tiny_gemma3_controller")
  write_hf_checkpoint(path, tiny_gemma3_config(max_context=512, sliding_window=8), seed=5)
  ck = load_checkpoint(path)
  params = dict(ck.params)
  params["embed"] = np.asarray(params["embed"]) * 0.05  # soft logits: sampling really samples
  contiguous = ContiguousLlama(Llama(ck.config, params))
  paged = PagedLlama(nnx.merge(contiguous.graphdef, contiguous.params), block_size=4)
  return Controller(contiguous, ck.tokenizer), Controller(paged, ck.tokenizer)


@pytest.mark.parametrize("policy", [
    dict(name="greedy_cot"),
    dict(name="think_verify_backtrack", verifier="mean_logprob", backtrack_threshold=0.0045,
         max_step_backtracks=1, max_backtracks=3, temperature=0.8, exit_tau=2.0, max_steps=4)],
    ids=["greedy_cot", "backtrack"])
def test_paged_controller_gives_the_contiguous_traces(controllers, policy):
  requests = [ReasoningRequest(p, request_id=30 + i, seed=4) for i, p in enumerate(PROMPTS)]
  contiguous, paged = (c.run(requests, get_policy(**{**COMMON, **policy})) for c in controllers)
  _same_results(contiguous, paged)
  assert all(len(t.token_ids) > 8 for r in paged for t in r.traces)  # past the window
