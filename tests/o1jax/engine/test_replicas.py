"""Engine replicas (data parallelism in one process) on this process's one device: one
replica runs through the mesh code (TP=1) and gives the plain engine's tokens; bad
settings are one-line errors. Two replicas on 8 devices: tests/o1jax/sharding."""

import pytest

from o1jax.engine import (BudgetConfig, BudgetLoop, Engine, EngineConfig, EngineReplicas,
                          GenerationParams, Request, build_engine)
from o1jax.sharding import TopologyError


def test_one_replica_through_the_mesh_code_gives_the_engine_tokens(tiny, engine32, make_prompts):
  prompts = make_prompts(6, seed=11)
  requests = [Request(p, GenerationParams(max_new_tokens=12, temperature=t))  # ids: positions
              for p in prompts for t in (0.0, 0.9)]
  replicas = EngineReplicas(tiny.model, tiny.tokenizer,
                            EngineConfig(max_slots=32, num_blocks=512, prefill_chunk=64))
  assert replicas.engines[0].mesh is not None  # a (1, 1) mesh: the sharded path, TP=1
  got = [r.samples[0].token_ids for r in replicas.generate(requests)]
  want = [r.samples[0].token_ids for r in engine32.generate(requests)]
  assert got == want
  assert replicas.trace_counts == replicas.engines[0].trace_counts  # summed over replicas
  # Any iterable, as Engine.generate (a generator gave [] here: the check had read it).
  from_generator = replicas.generate(r for r in requests)
  assert [r.samples[0].token_ids for r in from_generator] == want
  with pytest.raises(ValueError, match="requests must be a list of requests, got one Request"):
    replicas.generate(requests[0])


def test_build_engine_and_one_line_errors(tiny):
  cfg = EngineConfig(max_slots=4, num_blocks=64)
  assert type(build_engine(tiny.model, tiny.tokenizer, cfg)) is Engine
  two = EngineConfig(max_slots=4, num_blocks=64, data_parallel=2)
  with pytest.raises(ValueError, match="data_parallel=2: one Engine is one replica"):
    Engine(tiny.model, tiny.tokenizer, two)
  with pytest.raises(TopologyError, match="data_parallel=2 x tensor_parallel=1 needs 2 devices; "
                                          "this process has 1"):
    build_engine(tiny.model, tiny.tokenizer, two)
  with pytest.raises(ValueError, match="data_parallel must be an int >= 1, got 0"):
    EngineConfig(data_parallel=0)
  # devices= with one replica: its engine on them (before: a TypeError from Engine).
  import jax
  placed = build_engine(tiny.model, tiny.tokenizer, cfg, devices=jax.devices()[:1])
  assert type(placed) is Engine and placed.mesh.devices.ravel().tolist() == jax.devices()[:1]
  one = build_engine(tiny.model, tiny.tokenizer, cfg, devices=jax.devices()[0])  # a bare Device
  assert one.mesh.devices.ravel().tolist() == jax.devices()[:1]
  with pytest.raises(ValueError, match="^give devices= or mesh=, not both$"):
    build_engine(tiny.model, tiny.tokenizer, cfg, devices=jax.devices(), mesh=placed.mesh)
  with pytest.raises(ValueError, match="a live budget with engine.data_parallel > 1"):
    EngineReplicas(tiny.model, tiny.tokenizer, two,
                   budget=BudgetLoop(BudgetConfig(mode="adaptive")))


def test_bad_request_is_refused_before_any_replica_starts(tiny):
  replicas = EngineReplicas(tiny.model, tiny.tokenizer, EngineConfig(max_slots=4, num_blocks=64))
  with pytest.raises(ValueError, match="unknown request field"):
    replicas.generate([{"prompt": [5, 6, 7]}, {"prompt": [5], "temprature": 0.5}])
  assert replicas.engines[0].metrics.summary()["requests"] == 0
