"""Data parallelism inside one process: `EngineReplicas`, one `Engine` per device group.

A worker with several devices serves them all: `make_mesh(model=tp, data=replicas)` places
the groups by topology (o1jax/sharding/topology.py), each group holds the whole model
(split over its `model` axis when tp > 1) and runs its own continuous batching. A
`generate` call deals its requests out in turn (request i to replica i mod N), runs the
replicas in threads (a device call releases the GIL) and returns the results in request
order. A request's tokens do not depend on its replica: its random stream is keyed by its
seed and id, and every replica holds the same weights.

  engines = EngineReplicas(model, tokenizer, EngineConfig(data_parallel=2, tensor_parallel=2))
  results = engines.generate(requests)  # as Engine.generate
"""

from __future__ import annotations

import collections
import collections.abc
import concurrent.futures
import dataclasses
from typing import Sequence

import jax
from jax.sharding import Mesh

from o1jax.engine.engine import Engine, EngineConfig, Request, RequestResult
from o1jax.sharding import tensor_parallel, topology


def replica_meshes(replicas: int, tp: int = 1, devices=None, topo="auto") -> list[Mesh]:
  """One (data=1, model=tp) mesh per replica, the groups placed by topology (`topo`: as
  `topology.make_mesh` takes it)."""
  if isinstance(devices, jax.Device):  # one device given bare (list() of it: a TypeError)
    devices = [devices]
  devices = list(jax.devices() if devices is None else devices)
  if replicas * tp > len(devices):
    raise topology.TopologyError(f"data_parallel={replicas} x tensor_parallel={tp} needs "
                                 f"{replicas * tp} devices; this process has {len(devices)}")
  # Groups placed over every device, then the first `replicas` taken: cutting the device
  # list first could leave out a group's NVLink partners (3 x TP=2 on a box of interleaved
  # islands paired GPUs 0 and 1 over SYS).
  return tensor_parallel.group_meshes(tp, devices, topo)[:replicas]


class EngineReplicas:
  """`config.data_parallel` engines over `config.data_parallel * config.tensor_parallel`
  devices (see the module doc). Each replica has the config's slots and KV pool."""

  def __init__(self, model, tokenizer, config: EngineConfig = EngineConfig(), *, devices=None,
               **engine_kwargs):
    if engine_kwargs.get("mesh") is not None:  # (was a TypeError: mesh given twice)
      raise ValueError(f"data_parallel={config.data_parallel} places a mesh per replica: give "
                       f"devices=, not mesh=")
    if engine_kwargs.get("budget") is not None and config.data_parallel > 1:
      raise ValueError("a live budget with engine.data_parallel > 1 is not supported: each "
                       "replica would need its own (use budget.mode=fixed, or one replica)")
    meshes = replica_meshes(config.data_parallel, config.tensor_parallel, devices)
    self.config = config
    one = dataclasses.replace(config, data_parallel=1)
    self.engines = [Engine(model, tokenizer, one, mesh=mesh, **engine_kwargs) for mesh in meshes]
    self.tokenizer = tokenizer
    self.budget = None
    self._pool = concurrent.futures.ThreadPoolExecutor(len(self.engines),
                                                       thread_name_prefix="replica")

  @property
  def trace_counts(self) -> collections.Counter:
    """Programs compiled, by name, over every replica (as `Engine.trace_counts`)."""
    return sum((e.trace_counts for e in self.engines), collections.Counter())

  def generate(self, requests: Sequence[Request | dict | str]) -> list[RequestResult]:
    """Engine.generate over the replicas: every request checked before any work starts,
    one without request_id keyed by its position in `requests` (as Engine.generate),
    results in request order."""
    if (isinstance(requests, collections.abc.Iterable)
        and not isinstance(requests, (str, bytes, dict, Request))):  # (the check's errors)
      requests = list(requests)  # once: the check read an iterator, and nothing ran
    self.engines[0].check_requests(requests)  # first: `_with_id` reads a Request's fields
    requests = [_with_id(r, i) for i, r in enumerate(requests)]
    n = len(self.engines)
    shares = [list(range(r, len(requests), n)) for r in range(n)]
    runs = [self._pool.submit(self.engines[r].generate, [requests[i] for i in share])
            for r, share in enumerate(shares) if share]
    out: list[RequestResult | None] = [None] * len(requests)
    for share, run in zip([s for s in shares if s], runs):
      for i, result in zip(share, run.result()):
        out[i] = result
    return out


def _with_id(request: Request | dict | str, index: int) -> Request | dict:
  """The request with its position as id where it has none (its sampling keys)."""
  if isinstance(request, str):
    return Request(prompt=request, request_id=index)
  if isinstance(request, dict):
    return request if request.get("request_id") is not None else {**request, "request_id": index}
  if request.request_id is None:
    return dataclasses.replace(request, request_id=index)
  return request


def build_engine(model, tokenizer, config: EngineConfig = EngineConfig(), *, devices=None,
                 **engine_kwargs):
  """An `Engine`, or `EngineReplicas` when config.data_parallel > 1; `devices`: the
  devices to place the replicas (or the one engine's tensor-parallel group) on."""
  if config.data_parallel > 1:
    return EngineReplicas(model, tokenizer, config, devices=devices, **engine_kwargs)
  if devices is not None:  # (Engine takes no devices=: a TypeError when data_parallel was 1)
    if engine_kwargs.get("mesh") is not None:
      raise ValueError("give devices= or mesh=, not both")
    engine_kwargs["mesh"] = replica_meshes(1, config.tensor_parallel, devices)[0]
  return Engine(model, tokenizer, config, **engine_kwargs)
