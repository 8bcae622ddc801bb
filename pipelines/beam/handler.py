"""RunInference `ModelHandler` that wraps any `Predictor` (Generator today, engine tomorrow).

  handler = PredictorModelHandler(PredictorSpec(name="fake"), batch_size=8)
  results, dlq = work_items | RunInference(handler).with_exception_handling()

Data flow per worker: 1. `load_model` builds the predictor once from its picklable
spec (with `share_model_across_processes`, once per machine, and the worker
processes call it through a proxy); 2. Beam's `BatchElements` groups work items
into batches of `batch_size` (the engine's slots once it lands); 3.
`run_inference` stamps the batch with the injected clock, calls
`predictor.predict`, and emits one `PredictionResult(item, prediction)` per item,
with `timing` added to the prediction: the batch's stamps, overlaid by the
predictor's own per-request `metrics` when it measures them (the engine: its
request latency, TTFT and per-token latencies); 4. a `ValueError` (the predictor refused a
request) reruns the batch's items one by one: a refused item's prediction is
{"error": reason}, a dead letter of its own; any other exception fails the whole batch,
which `with_exception_handling()` routes to the dead-letter output.
"""

from __future__ import annotations

import glob
import os
import pathlib
import tempfile
import time
import traceback
from typing import Any, Callable, Optional, Sequence

from apache_beam.ml.inference.base import ModelHandler, PredictionResult

from pipelines.predictors import ERROR_KEY, Predictor, PredictorSpec, WorkItem, build_predictor



class ModelLoadError(ValueError):
  """A worker could not build its predictor from the spec, for a reason the launcher could
  not check (the worker's devices, a checkpoint only the workers read, weights whose values
  are bad): the run stops with this one line (what other workers stored stays stored)."""


class PredictorModelHandler(ModelHandler[WorkItem, PredictionResult, Predictor]):
  """Loads a predictor by spec; batches of work items in, `PredictionResult`s out.

  Args:
    spec: which predictor to build (registry name + model source).
    batch_size: fixed batch size for `BatchElements` (min = max, so compiled
      shapes repeat; the last batch of a bundle may be smaller).
    share_model: one predictor per machine shared by worker processes.
    clock: object with `time_ns()` (the `time` module, or a fake in tests).
    loader: builds the predictor from the spec (tests inject fakes).
  """

  def __init__(self, spec: PredictorSpec, batch_size: int = 8, *, share_model: bool = True,
               clock: Any = time, loader: Optional[Callable[[PredictorSpec], Predictor]] = None):
    super().__init__(min_batch_size=batch_size, max_batch_size=batch_size)
    if batch_size < 1:
      raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    self.spec = spec
    self.batch_size = batch_size
    self._share = share_model
    self._clock = clock
    self._loader = loader or build_predictor

  def load_model(self) -> Predictor:
    try:
      return self._loader(self.spec)
    except ValueError as e:  # the spec asks for what this worker cannot give (e.g. devices)
      raise ModelLoadError(f"a worker could not load the model: {e}") from e

  def run_inference(self, batch: Sequence[WorkItem], model: Predictor,
                    inference_args: Optional[dict[str, Any]] = None) -> list[PredictionResult]:
    del inference_args
    start_ns = self._clock.time_ns()
    try:
      predictions = model.predict(list(batch))
    except ValueError as e:
      # A request the predictor refuses (a prompt longer than the model's context, bad
      # metadata) fails the whole batch: run the items alone, so only those refused become
      # dead letters and their neighbours are computed. Alone already, it is refused as it
      # would be in a batch (its dead letter's text must not depend on its batch).
      predictions = ([_refusal(e)] if len(batch) == 1 else
                     [_predict_alone(model, item) for item in batch])
    end_ns = self._clock.time_ns()
    if len(predictions) != len(batch):
      raise RuntimeError(f"predictor returned {len(predictions)} predictions for {len(batch)} items")
    timing = {"start_ms": start_ns / 1e6, "end_ms": end_ns / 1e6,
              "latency_ms": (end_ns - start_ns) / 1e6, "batch_size": len(batch), "worker_pid": os.getpid()}
    return [PredictionResult(item, {**pred, "timing": _timing(timing, pred.get("metrics"))},
                             model_id=self.spec.name)
            for item, pred in zip(batch, predictions)]

  def batch_elements_kwargs(self):
    return {"min_batch_size": self.batch_size, "max_batch_size": self.batch_size}

  def share_model_across_processes(self) -> bool:
    return self._share

  def get_num_bytes(self, batch: Sequence[WorkItem]) -> int:
    return sum(len(str(item.prompt)) for item in batch)

  def get_metrics_namespace(self) -> str:
    return "o1jax_eval"


def _predict_alone(model: Predictor, item: WorkItem) -> dict:
  """One item's prediction, or {"error": reason} when the predictor refuses it (it becomes
  an inference dead letter in `Score`)."""
  try:
    return model.predict([item])[0]
  except ValueError as e:
    return _refusal(e)


def _refusal(e: ValueError) -> dict:
  return {ERROR_KEY: "".join(traceback.format_exception_only(type(e), e)).strip()}


def _timing(batch_timing: dict, metrics: Optional[dict]) -> dict:
  """Batch stamps + the predictor's measured numbers (None values keep the batch's)."""
  out = dict(batch_timing)
  for k, v in (metrics or {}).items():
    if v is not None:
      out[k] = v
  return out


def remove_shared_model_files(model_tag: str) -> None:
  """Deletes the files Beam's cross-process model sharing leaves in this machine's temp
  directory (`<tag>….lock`, `<tag>….address`) once the job that used them is over: the
  launcher's for a run here, each Dask worker's when the job is released there."""
  for path in pathlib.Path(tempfile.gettempdir()).glob(f"{glob.escape(model_tag)}*"):
    try:
      path.unlink()
    except OSError:  # another process removed it, or it is not ours to remove
      pass
