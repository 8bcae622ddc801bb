"""The inference step behind one small interface, so the engine/controller is a one-class swap.

  predictor = build_predictor(PredictorSpec(name="generator", source="embedded"))
  predictions = predictor.predict(work_items)   # one dict per item, same order

A prediction dict holds:
  text: the generated text (stop sequences not yet cut; scoring cuts them)
  tokens: {"prompt": n, "completion": n}  (the controller adds kinds: "thinking", ...)
  finish_reason: "stop" | "length"
  latency_s: seconds from submit to the last token of this item
  trace: policy trace (steps, backtracks, early_exit, ...; {} for plain sampling)

Implementations: `GeneratorPredictor` over today's `o1jax.model.Generator`, and
`FakePredictor`, whose outputs are worked out on paper (see its docstring).
Register an engine- or controller-backed class in `PREDICTORS` under a new name.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import time
from typing import Any, Callable, Protocol, Sequence

from pipelines.policies import SamplingSpec


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
    request_id: 31-bit int from (example id, sample index): the sampler's random stream,
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


def request_id_for(example_id: str, sample_index: int) -> int:
  digest = hashlib.sha256(f"{example_id}\x00{sample_index}".encode()).digest()
  return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


class Predictor(Protocol):
  """Turns a batch of work items into prediction dicts (same order, same length)."""

  def predict(self, items: Sequence[WorkItem]) -> list[dict]:
    ...


@dataclasses.dataclass(frozen=True)
class PredictorSpec:
  """What a worker needs to build its predictor (picklable; no model inside)."""
  name: str = "generator"
  source: str = "embedded"
  backend: str = "auto"
  fake_delay_s: float = 0.0

  @classmethod
  def from_config(cls, model_cfg) -> "PredictorSpec":
    return cls(name=model_cfg.predictor, source=model_cfg.source, backend=model_cfg.backend,
               fake_delay_s=float(model_cfg.fake_delay_s))


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
    from o1jax.compilation_cache import enable_compilation_cache
    from o1jax.generate import build_generator
    enable_compilation_cache()
    return cls(build_generator(spec.source, spec.backend))

  def predict(self, items: Sequence[WorkItem]) -> list[dict]:
    from o1jax.model import SamplingParams
    out: list[dict | None] = [None] * len(items)
    order = sorted(range(len(items)), key=lambda i: (items[i].stop, items[i].sampling.max_new_tokens))
    for (stop, max_new), group in itertools.groupby(
        order, key=lambda i: (items[i].stop, items[i].sampling.max_new_tokens)):
      idx = list(group)
      params = [SamplingParams(temperature=items[i].sampling.temperature, top_p=items[i].sampling.top_p,
                               top_k=items[i].sampling.top_k, seed=items[i].sampling.seed) for i in idx]
      t0 = self.clock()
      outputs = self.generator.generate([items[i].prompt for i in idx], max_new, params,
                                        request_ids=[items[i].request_id for i in idx], stop=stop)
      elapsed = self.clock() - t0
      for i, o in zip(idx, outputs):
        out[i] = {"text": o.text, "tokens": {"prompt": o.prompt_tokens, "completion": len(o.token_ids)},
                  "finish_reason": o.finish_reason, "latency_s": elapsed, "trace": {}}
    return out  # type: ignore[return-value]


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
    if h % 4 == 0:
      value += 1
    return f"The answer is {int(value) if value.is_integer() else value}."

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
    "generator": GeneratorPredictor.load,
    "fake": FakePredictor.load,
}


def build_predictor(spec: PredictorSpec) -> Predictor:
  if spec.name not in PREDICTORS:
    raise ValueError(f"model.predictor={spec.name!r}: registered predictors are {sorted(PREDICTORS)}")
  return PREDICTORS[spec.name](spec)


def model_fingerprint(spec: PredictorSpec) -> dict:
  """Identity of the model for content hashes: name, source, and the weights file's size + head hash.

  Hashing the first MiB (not all of it) keeps this instant for big checkpoints
  while still telling re-quantized or retrained files apart in practice.
  """
  import os
  fp = {"predictor": spec.name, "source": spec.source, "backend": spec.backend}
  if spec.name == "fake":
    return fp
  path = spec.source
  if spec.source == "embedded":
    try:
      from o1jax.checkpoint.embedded import embedded_model_path
      path = str(embedded_model_path())
    except Exception:  # a missing model fails later, at load time, with a clear message
      return fp
  if os.path.isfile(path):
    with open(path, "rb") as f:
      head = hashlib.sha256(f.read(1 << 20)).hexdigest()
    fp.update(file=os.path.basename(path), bytes=os.path.getsize(path), head_sha256=head)
  elif os.path.isdir(path):
    fp["files"] = sorted((n, os.path.getsize(os.path.join(path, n))) for n in os.listdir(path)
                         if os.path.isfile(os.path.join(path, n)))
  return fp
