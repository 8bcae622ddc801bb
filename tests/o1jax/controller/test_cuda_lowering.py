"""The controller's reasoning loop lowered for CUDA with the Pallas kernels compiled, on a
CPU, for the policies issue 14 names (self_consistency, deepconf, think_verify_backtrack)
over the paged cache: what runs on a GPU, caught here. The loop runs with the kernels in
interpret mode (dispatching as on a GPU); each loop program it runs is also traced with the
compiled-kernel model and lowered for CUDA."""

import pytest

from o1jax.checkpoint import load_checkpoint
from o1jax.controller import Controller, build_decode_model
from o1jax.controller.registry import get_policy
from o1jax.model import Llama
from o1jax.testing import as_if_on_gpu, tiny_config, write_gguf_checkpoint


class _LoweringLoop:
  """A ReasoningLoop whose `run` first lowers its CUDA twin for the state's shapes."""

  def __init__(self, loop, cuda_loop, lowered: list):
    self._loop, self._cuda, self._lowered = loop, cuda_loop, lowered

  def __getattr__(self, name):
    return getattr(self._loop, name)

  def run(self, params, state):
    with as_if_on_gpu():
      type(self._cuda).run.trace(self._cuda, params, state).lower(lowering_platforms=("cuda",))
      self._lowered.append((tuple(state.tokens.shape), self._cuda.verify))
      return self._loop.run(params, state)


def _tiny_models(tmp_path):
  """(checkpoint, the paged decode model with interpret-mode kernels, its twin with the
  kernels compiled for CUDA) of a tiny Q4_1 GGUF; bf16 KV under an f32 model (the GPU
  check's)."""
  write_gguf_checkpoint(tmp_path / "m.gguf", tiny_config(max_context=256), seed=1,
                        matrix_type="Q4_1")
  ck = load_checkpoint(tmp_path / "m.gguf")
  cache = {"cache": "paged", "kv_dtype": "bfloat16"}
  with as_if_on_gpu():
    cuda = build_decode_model(Llama(ck.config, ck.params, backend="auto", interpret=False,
                                    weight_mode="quantized"), cache)
    model = build_decode_model(Llama(ck.config, ck.params, backend="auto", interpret=True,
                                     weight_mode="quantized"), cache)
  return ck, model, cuda


class LoweringController(Controller):
  cuda_model = None

  def __init__(self, *args, **kwargs):
    self.lowered: list = []
    super().__init__(*args, **kwargs)

  def loop(self, settings, verify=False):
    real = super().loop(settings, verify)
    model, self.model = self.model, self.cuda_model
    try:
      with as_if_on_gpu():  # the loop a GPU runs (fixed trips)
        cuda = super().loop(settings, verify)
    finally:
      self.model = model
    assert verify or cuda.trips  # (a GPU's plain loop runs fixed trips)
    return _LoweringLoop(real, cuda, self.lowered)


POLICIES = {
    "self_consistency": dict(n=4, max_thinking_tokens=10, max_answer_tokens=3,
                             temperature=0.8, top_p=0.95),
    "deepconf": dict(n=4, warmup=2, window=4, max_thinking_tokens=10, max_answer_tokens=3,
                     step_delimiter="a", step_max_tokens=5, temperature=0.9),
    "think_verify_backtrack": dict(verifier="mean_logprob", max_thinking_tokens=12,
                                   step_delimiter="a", step_max_tokens=5),
}


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_controller_loop_lowers_for_cuda(policy, tmp_path, monkeypatch):
  monkeypatch.delenv("O1JAX_FIXED_TRIP_LOOPS", raising=False)  # a GPU's default loop
  ck, model, cuda = _tiny_models(tmp_path)
  ctl = LoweringController(model, ck.tokenizer, max_rows=8)
  ctl.cuda_model = cuda
  with as_if_on_gpu():
    results = ctl.run(["2+2=", "Say a word"], get_policy(policy, **POLICIES[policy]))
  assert len(results) == 2 and all(r.traces for r in results)
  assert ctl.lowered, "no loop program ran"


def test_an_admission_sharing_a_prompt_prefix_lowers_for_cuda(tmp_path, monkeypatch):
  """The admission program with roots and sharers (a prefix taken from another row, then
  prefilled from past it through the paged prefill kernel) lowered for CUDA."""
  from o1jax.controller import controller as controller_lib
  from o1jax.controller.decode_model import program_view

  ck, model, cuda = _tiny_models(tmp_path)
  real, lowered = controller_lib._admit_rows, []

  def lowering(view, params, state, leaders, tokens, last, sharers, *rest):
    with as_if_on_gpu():
      real.trace(program_view(cuda), cuda.params, state, leaders, tokens, last, sharers,
                 *rest).lower(lowering_platforms=("cuda",))
    lowered.append((leaders.shape[0], sharers.shape[0]))
    return real(view, params, state, leaders, tokens, last, sharers, *rest)

  monkeypatch.setattr(controller_lib, "_admit_rows", lowering)
  fewshot = "Q: two plus two? A: four.\nQ: three plus one? A: four.\nQ: "
  with as_if_on_gpu():
    results = Controller(model, ck.tokenizer, max_rows=4).run(
        [fewshot + "one plus one?", fewshot + "five?"],
        get_policy("self_consistency", n=2, max_thinking_tokens=4, max_answer_tokens=2))
  assert len(results) == 2 and all(r.traces for r in results)
  assert lowered == [(1, 1)]  # one root, one sharer, in one admission


def test_the_speculative_verify_loop_lowers_for_cuda(tmp_path, monkeypatch):
  """Prompt-lookup drafts verified inside the loop (each drafted position attends through
  the paged decode kernel, `PagedKVCache.decode_queries`) lowered for CUDA."""
  from o1jax.engine.speculative import SpeculativeConfig

  monkeypatch.delenv("O1JAX_FIXED_TRIP_LOOPS", raising=False)
  ck, model, cuda = _tiny_models(tmp_path)
  ctl = LoweringController(model, ck.tokenizer, max_rows=4,
                           speculative=SpeculativeConfig(max_drafts=3, adaptive=False))
  ctl.cuda_model = cuda
  with as_if_on_gpu():
    results = ctl.run(["abcabcabcabc", "hello hello hello"],
                      get_policy("self_consistency", n=2, max_thinking_tokens=8,
                                 max_answer_tokens=2))
  assert len(results) == 2 and all(r.traces for r in results)
  assert any(verify for _, verify in ctl.lowered), ctl.lowered
