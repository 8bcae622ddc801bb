"""The inference step behind one small interface, so the engine/controller is a one-class swap.

  predictor = build_predictor(PredictorSpec(name="generator", source="embedded"))
  predictions = predictor.predict(work_items)   # one dict per item, same order

A prediction dict holds:
  text: the generated text (cut at the first stop sequence; scoring cuts again, harmlessly)
  tokens: {"prompt": n, "completion": n}  (the controller adds kinds: "thinking", ...)
  finish_reason: "stop" | "length"
  latency_s: seconds from submit to the last token of this item
  trace: policy trace (steps, backtracks, early_exit, ...; {} for plain sampling);
    deterministic, it goes into the stored record
  metrics (optional): measured, non-deterministic numbers the Beam handler merges
    into the record's `timing`: latency_ms (this request's own), ttft_ms, token_ms
    (one latency per generated token: TTFT, then the gaps), prompt_tokens_computed

Implementations (registry `PREDICTORS`, chosen by `model.predictor`):
  engine      `o1jax.engine.Engine`: continuous batching, paged KV cache, prefix sharing,
              real per-request metrics (the default for plain sampling policies)
  generator   the simple static-batch `o1jax.model.Generator` (batch latency only)
  controller  `o1jax.controller.Controller.run` for the controller's reasoning policies
  fake        `FakePredictor`, whose outputs are worked out on paper (see its docstring)
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import itertools
import math
import re
import threading
import time
from typing import Any, Callable, Mapping, Protocol, Sequence

from o1jax.controller.sampling_policies import SamplingSpec
from o1jax.model.sampling import SamplingParams
from o1jax.model.thinking import cut_at_stop
from pipelines.config_imports import import_modules
from pipelines.datasets.records import text_bytes


@dataclasses.dataclass(frozen=True)
class WorkItem:
  """One unit of work: an example's sample `sample_index`, keyed by content hash.

  Attributes:
    key: sha256 of (model, generation config, example, sample index); the store's file name.
    example: the `pipelines.datasets.Example` (as a dict, to cross process boundaries cheaply).
    example_index: position of the example in its dataset (orders results.jsonl).
    sample_index: 0 .. policy.num_samples - 1.
    prompt: completion text, or chat messages [{"role", "content"}].
    stop: stop sequences.
    sampling: decoding settings of this sample.
    request_id: 63-bit int from (example id, sample index): the sampler's random stream,
      so a sample draws the same tokens in any batch, slot or worker.
  """
  key: str
  example: dict
  example_index: int
  sample_index: int
  prompt: Any
  stop: tuple[str, ...]
  sampling: SamplingSpec
  request_id: int


# Which `request_id_for` drew a sampled record (its content key holds it): 31-bit ids
# before, where the samples of one example at n = 100,000 shared ~2 random streams.
REQUEST_STREAM = 2


def _request_digest(example_id: str, sample_index: int) -> bytes:
  return hashlib.sha256(text_bytes(f"{example_id}\x00{sample_index}")).digest()


def request_id_for(example_id: str, sample_index: int) -> int:
  """63 bits of sha256(example id, sample index): an int64, as the records' JSON readers
  (pandas, Arrow) read it."""
  return int.from_bytes(_request_digest(example_id, sample_index)[:8], "big") >> 1


def request_id_before_2026_12_07(example_id: str, sample_index: int) -> int:
  """The 31-bit id records stored before REQUEST_STREAM 2 carry: a greedy sample does not
  draw from its stream, so its key stayed and such a record is resumed (with the new id)."""
  return int.from_bytes(_request_digest(example_id, sample_index)[:4], "big") & 0x7FFFFFFF


class Predictor(Protocol):
  """Turns a batch of work items into prediction dicts (same order, same length)."""

  def predict(self, items: Sequence[WorkItem]) -> list[dict]:
    ...


@dataclasses.dataclass(frozen=True)
class PredictorSpec:
  """What a worker needs to build its predictor (picklable; no model inside).

  Attributes beyond the model: batch_size (the runner's), batches_in_flight (Beam
  batches one shared predictor may serve at once: the worker processes or threads that
  share it; the engine's default slot count is batch_size x batches_in_flight), engine (sorted items of the config's `engine` section), policy
  (sorted items of a controller policy's `{"name", **params}`; controller only),
  controller (sorted items of `o1jax.controller.CacheConfig`: the `controller` section
  plus the engine section's kv_dtype; controller only),
  thinking (the model section's thinking span setting, o1jax/model/thinking.py: every
  predictor that runs a model scores the answer after the span),
  budget (sorted items of the `budget` section: the latency-aware budget; engine and controller),
  speculative (sorted items of the `speculative` section; engine and controller),
  imports (the config's modules, imported before the predictor is built: they may
  define the policy, its verifier or scorer; not part of the model's identity).
  """
  name: str  # which predictor: no default (the configs' default is model.predictor)
  source: str = "embedded"
  backend: str = "auto"
  matmul_dtype: str = "float32"
  thinking: str = "auto"
  fake_delay_s: float = 0.0
  batch_size: int = 8
  batches_in_flight: int = 1
  engine: tuple[tuple[str, Any], ...] = ()
  policy: tuple[tuple[str, Any], ...] = ()
  controller: tuple[tuple[str, Any], ...] = ()
  budget: tuple[tuple[str, Any], ...] = ()
  speculative: tuple[tuple[str, Any], ...] = ()
  imports: tuple[str, ...] = ()
  # The job's longest prompts (JSON) and largest max_new_tokens: the engine's KV pool is
  # sized so every slot holds such a sequence (set by the launcher from its work items).
  longest_prompts: tuple[str, ...] = ()
  max_new_tokens: int = 0

  def __post_init__(self):
    # Checked when the plan is built: each failed inside every worker's model load before.
    from o1jax.model.layers import MATMUL_DTYPES
    from pallas_kernels.ops import BACKENDS
    for key, value, valid in (("backend", self.backend, BACKENDS),
                              ("matmul_dtype", self.matmul_dtype, MATMUL_DTYPES)):
      if value not in valid:
        raise ValueError(f"model.{key}={value!r}: valid values are {list(valid)}")
    if not (math.isfinite(self.fake_delay_s) and self.fake_delay_s >= 0):
      # (else every sample a dead letter: "sleep length must be non-negative")
      raise ValueError(f"model.fake_delay_s={self.fake_delay_s!r}: expected seconds >= 0")

  @classmethod
  def from_config(cls, model_cfg, *, name: str | None = None, batch_size: int = 8,
                  batches_in_flight: int = 1, engine=None, policy=None, controller=None,
                  budget=None, speculative=None, imports=()) -> "PredictorSpec":
    def items(section):
      if section is None:
        return ()
      plain = section.to_dict() if hasattr(section, "to_dict") else dict(section)
      return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in plain.items()))
    return cls(name=name or model_cfg.predictor, source=model_cfg.source,
               backend=model_cfg.backend, matmul_dtype=str(model_cfg.matmul_dtype),
               thinking=str(model_cfg.thinking), fake_delay_s=float(model_cfg.fake_delay_s),
               batch_size=int(batch_size),
               batches_in_flight=int(batches_in_flight), engine=items(engine), policy=items(policy), controller=items(controller),
               budget=items(budget), speculative=items(speculative), imports=tuple(imports))

  def budget_loop(self):
    """A live `BudgetLoop` when the budget section says adaptive, else None."""
    from o1jax.engine.budget import BudgetConfig, BudgetLoop
    config = BudgetConfig.from_dict(dict(self.budget))
    return BudgetLoop(config) if config.mode == "adaptive" else None

  def speculative_config(self):
    """The engine's `SpeculativeConfig` when the speculative section is enabled, else None."""
    return speculative_config(dict(self.speculative))


def speculative_config(section: dict):
  """`SpeculativeConfig` of an enabled `speculative` config section (None when it is off
  or absent); an unknown key or a bad value raises ValueError naming it."""
  import numpy as np
  from o1jax.engine.speculative import SpeculativeConfig
  values = dict(section)
  enabled = values.pop("enabled", False)
  if not isinstance(enabled, (bool, np.bool_)):  # (the str "false" was truthy: on)
    raise ValueError(f"speculative.enabled must be a bool, got {enabled!r}")
  config = SpeculativeConfig.from_dict(values)  # (checked when off too: a typo stays one)
  return config if enabled else None


def _load_model(spec: PredictorSpec):
  """(Llama, tokenizer) from the spec's source, with the compilation cache on."""
  from o1jax.checkpoint import load_checkpoint
  from o1jax.compilation_cache import enable_compilation_cache
  from o1jax.model import Llama
  from pallas_kernels.ops import check_backend_runs_here
  enable_compilation_cache()
  try:
    check_backend_runs_here(spec.backend)  # (each request was a dead letter saying JAX's words)
  except ValueError as e:
    raise ValueError(f"model.{e}") from None
  ck = load_checkpoint(spec.source)
  return (Llama(ck.config, ck.params, backend=spec.backend, matmul_dtype=spec.matmul_dtype),
          ck.tokenizer)


def model_sources(spec: PredictorSpec) -> list[str]:
  """The checkpoints a predictor will load: its model and a speculative draft model's."""
  if spec.name == "fake":  # loads no model
    return []
  speculative = spec.speculative_config()
  draft = speculative.draft_source if speculative is not None else ""
  return [spec.source] + ([draft] if draft else [])


# A prediction holding only this key: the predictor refused the item (or its output is no
# answer); it becomes an inference dead letter with the value as reason.
ERROR_KEY = "error"

def _overflowed(where: str) -> dict:
  """The prediction of a sample drawn from logits that were not finite (engine / generator
  finish reason, controller exit "error"): an inference dead letter."""
  return {ERROR_KEY: f"the model's logits were not finite (NaN or inf) {where}: its weights "
                     f"or activations overflow"}


TRACE_FLOAT_DIGITS = 4


# `ReasoningResult.info` keys the record holds elsewhere: timing and the budget (its
# `metrics`), the thinking limit (the trace, under its own name).
_INFO_RECORDED_ELSEWHERE = frozenset({"budget", "ttft_s", "token_ms", "thinking_limit"})


def _finite(x):
  """JSON-safe copy: NaN/inf floats (unscored steps) become None, tuples lists.

  Finite floats are rounded to TRACE_FLOAT_DIGITS decimals: log-probs and
  confidences move by ~1e-7 with the compiled batch shape (f32 reductions), and
  the record must not depend on the batch the example ran in.
  """
  if isinstance(x, float):
    return round(x, TRACE_FLOAT_DIGITS) if math.isfinite(x) else None
  if isinstance(x, dict):
    return {k: _finite(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_finite(v) for v in x]
  return x


class GeneratorPredictor:
  """Today's static-batch `Generator`: one `generate` call per (stop, max_new_tokens) group.

  1. group the batch by (stop sequences, max_new_tokens), keeping order; 2. call
  `generate` with per-item `SamplingParams` and `request_ids=item.request_id`;
  3. report every item of a call with that call's wall time as its latency.
  """

  def __init__(self, generator, clock: Callable[[], float] = time.perf_counter):
    self.generator = generator
    self.clock = clock

  @classmethod
  def load(cls, spec: PredictorSpec) -> "GeneratorPredictor":
    from o1jax.model import Generator
    return cls(Generator(*_load_model(spec), thinking=spec.thinking))

  def predict(self, items: Sequence[WorkItem]) -> list[dict]:
    out: list[dict | None] = [None] * len(items)
    order = sorted(range(len(items)), key=lambda i: (items[i].stop, items[i].sampling.max_new_tokens))
    for (stop, max_new), group in itertools.groupby(
        order, key=lambda i: (items[i].stop, items[i].sampling.max_new_tokens)):
      idx = list(group)
      params = [SamplingParams(**_sampling_fields(items[i].sampling)) for i in idx]
      t0 = self.clock()
      outputs = self.generator.generate([items[i].prompt for i in idx], max_new, params,
                                        request_ids=[items[i].request_id for i in idx], stop=stop)
      elapsed = self.clock() - t0
      for i, o in zip(idx, outputs):
        if o.finish_reason == "error":  # an output that is no answer: a dead letter
          out[i] = _overflowed(f"after {len(o.token_ids)} tokens")
          continue
        out[i] = {"text": o.text, **_tokens_and_thinking(o.prompt_tokens, o),
                  "finish_reason": o.finish_reason, "latency_s": elapsed}
    return out  # type: ignore[return-value]


def _tokens_and_thinking(prompt_tokens: int, output) -> dict:
  """`tokens` and `trace` of a plain predictor's sample (a GenerationOutput or an engine
  SampleResult). With a thinking span the text is the answer after it: the thinking goes
  into the trace and its tokens into `tokens.thinking` (completion counts both)."""
  tokens = {"prompt": prompt_tokens, "completion": len(output.token_ids)}
  if output.thinking is None:
    return {"tokens": tokens, "trace": {}}
  tokens["thinking"] = output.thinking_tokens
  tokens["answer"] = len(output.token_ids) - output.thinking_tokens
  return {"tokens": tokens, "trace": {"thinking": output.thinking}}


def _sampling_fields(spec: SamplingSpec) -> dict[str, Any]:
  """The `SamplingParams` fields of a sample's settings (what the samplers read)."""
  return {f.name: getattr(spec, f.name) for f in dataclasses.fields(SamplingParams)}


def engine_config(spec: PredictorSpec):
  """`EngineConfig` from the spec's engine section; 0 / unset sizes take defaults.

  1. max_slots 0 -> the runner's batch size x the batches in flight on a shared engine
     (every batch that can reach it at once has its slots: a second worker's batch
     decodes beside the first instead of waiting for its slots); replicas
     (data_parallel > 1) run one batch at a time: the batch size;
  2. num_blocks 0 -> derived from kv_cache_bytes; 3. other keys map 1:1 onto
  EngineConfig fields (an unknown one lists the valid fields).
  """
  from o1jax.engine import EngineConfig
  values = dict(spec.engine)
  valid = {f.name for f in dataclasses.fields(EngineConfig)}
  unknown = sorted(set(values) - valid)
  if unknown:
    raise ValueError(f"engine section has no keys {unknown}; EngineConfig fields: {sorted(valid)}")
  # The section's 0 means automatic (the EngineConfig's own message would ask for >= 1).
  for key, zero in (("max_slots", "runner.batch_size x the batches sharing the model"),
                    ("num_blocks", "from kv_cache_bytes")):
    value = values.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
      raise ValueError(f"{key} must be an int >= 0 (0: {zero}), got {value!r}")
  value = values.get("kv_cache_bytes")
  if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
    raise ValueError(f"kv_cache_bytes must be an int >= 1 (the KV pool's bytes; num_blocks "
                     f"sets it in blocks), got {value!r}")
  in_flight = spec.batches_in_flight if int(values.get("data_parallel") or 1) == 1 else 1
  values["max_slots"] = int(values.get("max_slots") or spec.batch_size * in_flight)
  values["num_blocks"] = int(values.get("num_blocks") or 0) or None
  for key in ("decode_buckets",):
    if key in values:
      values[key] = tuple(values[key])
  return EngineConfig(**values)  # the model carries the backend (its ops pick by it)


def _longest_prompt_tokens(tokenizer, prompts: Sequence[str], vocab_size: int,
                           thinking: str) -> int:
  """Tokens of the longest of these prompts (JSON), rendered as the engine renders them
  under `thinking`; one the tokenizer refuses counts 0 (its request becomes a dead letter,
  not the whole worker)."""
  from o1jax.model.generation import encode_prompt
  from o1jax.model.thinking import template_kwargs
  chat_kwargs = template_kwargs(thinking, tokenizer)
  longest = 0
  for p in prompts:
    try:
      longest = max(longest, len(encode_prompt(tokenizer, json.loads(p), vocab_size, chat_kwargs)))
    except Exception:  # noqa: BLE001 - the request fails on its own later
      continue
  return longest


class EnginePredictor:
  """`o1jax.engine.Engine`, built once per worker and shared by the batches in flight.

  1. each work item becomes a `Request` (prompt, stop sequences, sampling params,
     seed; `request_id` = the item's, so its random stream is the same in any
     batch, slot or worker); 2. the batch's requests join the engine's queue, beside
     those of other batches in flight (worker processes sharing the model call in on
     threads of one process), and every waiting caller drives the shared engine one
     step at a time until its own requests finish: a batch's long sample no longer
     idles the other slots, which the other batches' requests fill (continuous
     batching across Beam batches; a shared few-shot prefix is prefilled once);
  3. each result's own metrics become the prediction's `metrics`: end-to-end latency,
     TTFT, and one latency per generated token after the first (the gaps between tokens).
  Engine replicas (engine.data_parallel > 1) run one batch at a time with `generate`.
  """

  def __init__(self, engine):
    self.engine = engine
    # The engine's queues and donated cache see one thread at a time: callers take turns
    # with this lock, one engine step per turn. Replicas only run whole batches.
    self._lock = threading.Lock()
    self._shared = hasattr(engine, "add_request")
    self._queue = _QueuedItems(getattr(engine, "budget", None))

  @classmethod
  def load(cls, spec: PredictorSpec) -> "EnginePredictor":
    from o1jax.engine import build_engine
    model, tokenizer = _load_model(spec)
    config = engine_config(spec)
    if spec.longest_prompts and config.num_blocks is None:  # a fixed num_blocks stays
      config = dataclasses.replace(config, min_tokens_per_slot=_longest_prompt_tokens(
          tokenizer, spec.longest_prompts, model.config.vocab_size, spec.thinking)
          + spec.max_new_tokens)
    # data_parallel > 1: replicas of the engine over this worker's devices (one batch dealt out)
    return cls(build_engine(model, tokenizer, config, budget=spec.budget_loop(),
                            speculative=spec.speculative_config(), thinking=spec.thinking))

  def predict(self, items: Sequence[WorkItem]) -> list[dict]:
    from o1jax.engine import GenerationParams, Request
    requests = [Request(prompt=i.prompt, request_id=i.request_id, params=GenerationParams(
        **_sampling_fields(i.sampling),
        max_new_tokens=i.sampling.max_new_tokens, stop=tuple(i.stop))) for i in items]
    self._queue.add(len(items))
    with self._lock:
      self._queue.add(-len(items))
      if not self._shared:  # replicas: one batch at a time
        results = self.engine.generate(requests)
      else:
        self.engine.check_requests(requests)  # a bad request queues nothing
        groups = [self.engine.add_request(r) for r in requests]
    if self._shared:
      results = self._drive(groups)
    out = []
    for result in results:
      sample, m = result.samples[0], result.metrics
      times = m.token_times[0] if m.token_times else []
      # Each token's time after the first (whose time is ttft_ms: the summary's per-token
      # latency is the time between tokens, not the prompt's prefill, which made it
      # a P95 and a CV of prefill times); the step that sampled eos counts: real work.
      token_s = [t - prev for prev, t in zip(times[:-1], times[1:])]
      metrics = {"latency_ms": _ms(m.e2e), "ttft_ms": _ms(m.ttft),
                 "token_ms": [_ms(x) for x in token_s],
                 "prompt_tokens_computed": int(m.prompt_tokens_computed)}
      if m.budget:  # the token limits it ran under, and why they changed
        metrics["budget"] = m.budget
      if m.spec_drafted:  # speculative decoding: drafts verified for it, and accepted
        metrics["speculative"] = {"drafted": m.spec_drafted, "accepted": m.spec_accepted}
      if m.recomputed_tokens:  # preempted (the KV pool was full) and run again
        metrics["recomputed_tokens"] = int(m.recomputed_tokens)
      if sample.finish_reason == "error":  # an output that is no answer: a dead letter
        out.append(_overflowed(f"after {len(sample.token_ids)} tokens"))
        continue
      out.append({"text": sample.text, **_tokens_and_thinking(len(result.prompt_token_ids), sample),
                  "finish_reason": sample.finish_reason, "latency_s": m.e2e or 0.0,
                  "metrics": metrics})
    return out


  def _drive(self, groups) -> list:
    """Steps the shared engine, a turn at a time, until `groups` finished; their results.
    If a step fails, this batch's requests leave the engine (the batch goes to dead
    letters; the other batches in flight keep their slots)."""
    while True:
      with self._lock:
        if not any(g.unfinished for g in groups):
          return [self.engine.result(g) for g in groups]
        try:
          self.engine.step()
        except BaseException:
          for g in groups:
            self.engine.cancel(g)
          raise
      # A lock is not fair: a batch waiting to join would wait for this whole loop. Let
      # it in before the next step.
      while self._queue.count > 0:
        time.sleep(0.001)


class _QueuedItems:
  """Items of batches waiting for the shared model: the budget's `queued_outside` (its
  load counts requests queued before the engine as well as those queued inside it)."""

  def __init__(self, budget):
    self.budget = budget
    self.count = 0
    self._lock = threading.Lock()

  def add(self, n: int) -> None:
    with self._lock:
      self.count += n
      if self.budget is not None:
        self.budget.queued_outside = self.count


def _ms(seconds) -> float | None:
  return None if seconds is None else round(float(seconds) * 1e3, 3)


class ControllerPredictor:
  """`o1jax.controller.Controller.run` with the config's controller policy.

  1. each work item (sample index 0 of an example) becomes a `ReasoningRequest`
     (prompt, request_id, seed); 2. `Controller.run(requests, policy)` runs the
     policy (n traces share the prompt's cache; vote / best / threshold inside)
     on the decode model the `controller` section names (paged or contiguous KV);
  3. each `ReasoningResult` becomes a prediction: text = the chosen trace's text
     (scored by the task like any completion), tokens by kind (thinking, answer,
     probe, discarded, waits; completion = every generated token), and the
     reasoning path in `trace`: answer, votes, chosen, steps, backtracks,
     early_exit, loop invocations and every trace with its steps. Metrics: the
     request's latency (admission to finish), TTFT and one latency per kept token as
     the host sees the device loop (see `o1jax.controller.Batch`).
  """

  def __init__(self, controller, policy):
    from o1jax.controller import build_policy
    self.controller = controller
    # Built once (a section: its params checked here), not per batch by `Controller.run`.
    self.policy = build_policy(policy) if isinstance(policy, Mapping) else policy
    self._lock = threading.Lock()  # one batch at a time, as for the engine
    self._queue = _QueuedItems(getattr(controller, "budget", None))

  @classmethod
  def load(cls, spec: PredictorSpec) -> "ControllerPredictor":
    from o1jax.controller import Controller, build_decode_model, build_policy
    if not spec.policy:
      raise ValueError("predictor=controller needs a controller policy (policy.name = one of the "
                       "controller's policies)")
    model, tokenizer = _load_model(spec)
    policy = dict(spec.policy)
    engine = dict(spec.engine)
    # One Beam batch x n traces in one compiled loop, unless engine.max_slots caps the rows.
    rows = int(engine.get("max_slots") or 0) or spec.batch_size * int(policy.get("n", 1) or 1)
    section = dict(spec.controller)  # kv_dtype included
    from o1jax.sharding import group_mesh
    tp = int(engine.get("tensor_parallel", 1) or 1)  # the loop split over tp devices by heads
    decode_model = build_decode_model(model, section, mesh=group_mesh(tp) if tp > 1 else None)
    controller = Controller(decode_model, tokenizer, max_rows=max(rows, 1),
                            budget=spec.budget_loop(), thinking=spec.thinking,
                            admission=str(engine.get("policy", "fifo")),
                            speculative=spec.speculative_config())
    built = build_policy(policy)
    controller.check_policy_fits(built)  # once here, not per request
    return cls(controller, built)

  def predict(self, items: Sequence[WorkItem]) -> list[dict]:
    from o1jax.controller import ReasoningRequest
    requests = []
    for i in items:
      # An example's metadata may carry its own step limit ("max_steps"; e.g. by difficulty).
      steps = (i.example.get("metadata") or {}).get("max_steps")
      try:
        requests.append(ReasoningRequest(prompt=i.prompt, request_id=i.request_id,
                                         seed=i.sampling.seed, max_steps=steps))
      except ValueError:  # the batch goes to dead letters with this line
        raise ValueError(f"example {i.example.get('id')!r}: metadata max_steps={steps!r} is not "
                         f"an int >= 1") from None
    self._queue.add(len(items))
    # A vote's chosen trace: one whose text the task reads as the voted answer, cut at the
    # items' stop sequences as the score cuts it (controller policies run GSM-style tasks).
    from pipelines.tasks.gsm8k import reads_as
    stops = {tuple(i.stop) for i in items}
    with self._lock:
      self._queue.add(-len(items))
      self.controller.reads_as = (functools.partial(reads_as, stop_sequences=stops.pop())
                                  if len(stops) == 1 else None)
      results = self.controller.run(requests, self.policy)
    out = []
    for item, result in zip(items, results):
      overflowed = [t.sample_index for t in result.traces if t.exit_reason == "error"]
      if overflowed:  # traces drawn from NaN/inf logits: no answer to score
        out.append(_overflowed(f"in trace {overflowed[0]} (of {len(overflowed)})"))
        continue
      text = result.answer_text or (self.controller.final_text(result.traces[0])
                                    if result.traces else "")
      # Cut at the item's stop sequences, as the engine's text is: the loop does not stop at
      # them (a few-shot trace wrote the next "Question:" on into the record).
      whole = text
      text = cut_at_stop(text, tuple(item.stop), final=True)
      counts = result.tokens.to_dict()
      tokens = {"prompt": len(self.controller.encode(item.prompt)), "completion": counts.pop("generated"),
                **counts}
      chosen = result.traces[result.chosen] if result.chosen is not None else None
      finish = ("stop" if chosen is None or chosen.exit_reason != "length" or text != whole
                else "length")
      trace = _finite({"answer": result.answer, "chosen": result.chosen, "votes": result.votes,
                       "steps": result.steps, "backtracks": result.backtracks,
                       "early_exit": result.early_exit, "loop_invocations": result.loop_invocations,
                       "exit_reasons": [t.exit_reason for t in result.traces],
                       "traces": [t.to_dict() for t in result.traces]})
      if result.info.get("thinking_limit") is not None:  # lowered to fit the model's context
        trace["thinking_limit"] = result.info["thinking_limit"]
      # The policy's own figures (deepconf: its threshold, traces stopped for low
      # confidence or by the consensus, key mismatches; think_verify_backtrack: max_steps):
      # what its decisions are checked against. Timing and the budget go to `metrics`.
      policy_info = {k: v for k, v in result.info.items() if k not in _INFO_RECORDED_ELSEWHERE}
      if policy_info:
        trace["policy_info"] = _finite(policy_info)
      # Per-token times as the host sees a device loop: each token's loop call's wall
      # time / the iterations it ran (o1jax.controller.Batch), after the first token
      # (as the engine's); TTFT from its admission.
      metrics = {"latency_ms": _ms(result.wall_time_s), "ttft_ms": _ms(result.info.get("ttft_s")),
                 "token_ms": [round(float(x), 3) for x in result.info.get("token_ms", [])[1:]]}
      if result.info.get("budget"):  # the step limits it ran under, and why they changed
        metrics["budget"] = result.info["budget"]
      spec = [t.pop("speculative", None) for t in trace["traces"]]  # timing, not content
      if any(spec):  # drafts verified for this example's traces, and accepted
        metrics["speculative"] = {k: sum(d[k] for d in spec if d) for k in ("drafted", "accepted")}
      out.append({"text": text, "tokens": tokens, "finish_reason": finish,
                  "latency_s": result.wall_time_s, "trace": trace, "metrics": metrics})
    return out


class FakePredictor:
  """Hand-computable stand-in: output depends only on (example, sample index), never the batch.

  For an item with h = int(sha256(key)[:8], 16):
    * GSM-style examples (a numeric reference R): text is "The answer is R." when
      h % 4 != 0, else "The answer is R+1." (so about 3 of 4 samples are right);
    * other references (code): text is the reference itself (the canonical solution)
      when h % 4 != 0, else "    return None\n".
    tokens: prompt = len(str(prompt)) // 4, completion = len(text) // 4 + 1;
    latency_s = delay_s (the configured sleep per batch); trace = {}.
  """

  def __init__(self, delay_s: float = 0.0, sleep: Callable[[float], None] = time.sleep):
    self.delay_s = delay_s
    self.sleep = sleep

  @classmethod
  def load(cls, spec: PredictorSpec) -> "FakePredictor":
    return cls(spec.fake_delay_s)

  @staticmethod
  def text_for(item: WorkItem) -> str:
    h = int(hashlib.sha256(item.key.encode()).hexdigest()[:8], 16)
    ref = item.example["reference"]
    try:
      value = float(ref)
    except ValueError:
      return ref if h % 4 else "    return None\n"
    if h % 4:  # right: the reference as written ("3.50"; a float rounds big integers)
      return f"The answer is {ref}."
    wrong = int(ref) + 1 if re.fullmatch(r"-?[0-9]+", ref) else value + 1
    return f"The answer is {wrong}."

  def predict(self, items: Sequence[WorkItem]) -> list[dict]:
    if self.delay_s:
      self.sleep(self.delay_s)
    out = []
    for item in items:
      text = self.text_for(item)
      out.append({"text": text, "tokens": {"prompt": len(str(item.prompt)) // 4,
                                           "completion": len(text) // 4 + 1},
                  "finish_reason": "stop", "latency_s": self.delay_s, "trace": {}})
    return out


PREDICTORS: dict[str, Callable[[PredictorSpec], Predictor]] = {
    "engine": EnginePredictor.load,
    "generator": GeneratorPredictor.load,
    "controller": ControllerPredictor.load,
    "fake": FakePredictor.load,
}
PLAIN_MODEL_PREDICTORS = ("engine", "generator")  # what a controller policy replaces


def build_predictor(spec: PredictorSpec) -> Predictor:
  import_modules(spec.imports)  # this may be a process of its own (a model shared across workers)
  if spec.name not in PREDICTORS:
    raise ValueError(f"model.predictor={spec.name!r}: registered predictors are {sorted(PREDICTORS)}")
  return PREDICTORS[spec.name](spec)


def model_fingerprint(spec: PredictorSpec) -> dict:
  """Identity of the model for content hashes: name, source, and the sha256 of what the
  loaders read (a file's content; an orbax checkpoint's tree; an HF directory's own
  files: `content_digest`).

  The whole content, not a head: a GGUF's first MiB is its metadata, so a fine-tune saved
  at the same path with the same size had the old keys, and the store's samples of the old
  weights were resumed as the new model's (a directory was named by file sizes only)."""
  import os
  fp = {"predictor": spec.name, "source": spec.source, "backend": spec.backend}
  # Only what the predictor reads (the summary reports this too): the fake model reads no
  # numerics, the generator keeps an f32 KV cache whatever the engine section says.
  if spec.matmul_dtype != "float32" and spec.name != "fake":
    fp["matmul_dtype"] = spec.matmul_dtype  # other numerics, other results (f32: old hashes)
  kv_dtype = dict(spec.engine).get("kv_dtype", "float32")
  if spec.name not in ("engine", "controller"):
    kv_dtype = "float32"
  if kv_dtype != "float32":  # likewise for a narrower KV cache
    fp["kv_dtype"] = kv_dtype
  if kv_dtype.startswith("float8"):
    # A scale per token (what it stores depends on its own values alone, not on how the
    # writes were grouped); FP8 pools of earlier versions had one per block.
    fp["kv_scales"] = "per_token"
  tp = int(dict(spec.engine).get("tensor_parallel", 1) or 1)
  # All-reduced sums: logits move ~1e-6 (near-ties fork; FP8 pools' codes can round apart).
  if tp > 1 and spec.name in ("engine", "controller"):
    fp["tensor_parallel"] = tp
  budget = dict(spec.budget)
  if budget.get("mode", "fixed") != "fixed":  # a live budget: outputs depend on timing
    from o1jax.engine.budget import BudgetConfig
    # The section's keys in their checked form: 5 and 5.0 are one budget (a section's
    # keys as given: the hashes of existing stores, floats spelled as the configs do, stay).
    checked = BudgetConfig.from_dict(budget)
    fp["budget"] = {key: getattr(checked, key) for key in budget}
  cache = dict(spec.controller)
  if spec.name == "controller" and cache.get("cache", "contiguous") != "contiguous":
    # The paged cache's attention kernels add in another order (contiguous keeps old hashes);
    # the pool size cannot change a result (a pool that runs out raises).
    fp["controller_cache"] = {"cache": cache["cache"],
                              "block_size": int(cache.get("block_size", 16))}
  if spec.name == "fake":
    return fp
  if spec.thinking != "auto":
    # auto follows the checkpoint's template (hashed with it); anything else may change it.
    fp["thinking"] = spec.thinking
  if spec.thinking == "off":  # (since 2026-12-07 a template's enable_thinking renders off:
    fp["chat_template_thinking"] = "off"  # samples stored before thought, recomputed)
  from o1jax.checkpoint.embedded import resolve_source
  try:
    path = str(resolve_source(spec.source))
  except Exception:  # a missing named model fails later, at load time, with a clear message
    return fp
  if os.path.isfile(path):
    fp.update(file=os.path.basename(path), bytes=os.path.getsize(path),
              sha256=content_digest(path))
  elif os.path.isdir(path):
    # What the loaders read: an orbax checkpoint's tree, an HF directory's own files (not
    # a subdirectory such as `original/`); another directory is no checkpoint (the model
    # check refuses it), and hashing it could read gigabytes first.
    from o1jax.checkpoint.orbax_io import is_orbax_checkpoint
    if is_orbax_checkpoint(path):
      fp["sha256"] = content_digest(path)
    elif os.path.isfile(os.path.join(path, "config.json")):
      fp["sha256"] = content_digest(path, recursive=False)
  return fp


DIGEST_CACHE = "file_digests.json"  # under ~/.cache/o1jax: a file's digest by its stat


def content_digest(path: str, recursive: bool = True) -> str:
  """sha256 of a file's bytes, or of a directory's files (relative path, size and digest
  of each, in name order; every level, or its own files only). A file's digest is kept by
  (real path, size, mtime, ctime, inode, device) in ~/.cache/o1jax (1 GB/s here: a 100 MB
  model 0.09 s, an 8B one ~5 s, once per version of the file)."""
  import os
  if os.path.isdir(path):
    entries = []
    for root, dirs, files in os.walk(path):
      if not recursive:
        dirs.clear()
      dirs.sort()
      for name in sorted(files):
        full = os.path.join(root, name)
        entries.append(f"{os.path.relpath(full, path)}\0{os.path.getsize(full)}\0"
                       f"{content_digest(full)}\n")
    return hashlib.sha256("".join(entries).encode("utf-8", "surrogatepass")).hexdigest()
  st = os.stat(path)
  # ctime too: `cp -p`, `rsync -t` and archives restore an mtime over new bytes (and a file
  # made again may get its inode back); no tool sets ctime.
  key = (f"{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}|"
         f"{st.st_ino}|{st.st_dev}")
  cache = _digest_cache()
  if key in cache:
    return cache[key]
  with open(path, "rb") as f:
    digest = hashlib.file_digest(f, "sha256").hexdigest()
  # Timestamps are coarse (a few ms): a file changed within the last seconds could change
  # again under the same stat, so its digest is not kept (git's "racy" files).
  if time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) > 2_000_000_000:
    cache[key] = digest
    _save_digest_cache(cache)
  return digest


_digest_lock = threading.Lock()
_digests: dict[str, str] | None = None


def _digest_cache_path():
  import pathlib
  return pathlib.Path.home() / ".cache" / "o1jax" / DIGEST_CACHE


def _digest_cache() -> dict[str, str]:
  global _digests
  with _digest_lock:
    if _digests is None:
      try:
        loaded = json.loads(_digest_cache_path().read_text())
        _digests = {str(k): str(v) for k, v in loaded.items()} if isinstance(loaded, dict) else {}
      except (OSError, ValueError):  # none yet, or damaged: hashed again
        _digests = {}
    return _digests


def _save_digest_cache(cache: dict[str, str]) -> None:
  import os
  import tempfile
  path = _digest_cache_path()
  try:  # atomic; a cache that cannot be written costs the hash again, nothing else
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".digests-")
    with os.fdopen(fd, "w") as f:
      json.dump(dict(list(cache.items())[-4096:]), f)
    os.replace(tmp, path)
  except OSError:
    pass
