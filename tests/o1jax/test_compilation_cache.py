"""The bound on JAX's in-memory programs (`release_programs_near_map_limit`)."""

import logging

import jax
import jax.numpy as jnp

from o1jax import compilation_cache


def _compile_one(offset: float):
  fn = jax.jit(lambda x: jnp.sin(x) + offset)
  fn(jnp.ones(3)).block_until_ready()
  return fn


def test_releases_past_the_limit_and_only_after_a_new_program(monkeypatch, caplog):
  monkeypatch.setattr(compilation_cache, "map_limit", lambda: 2)  # any process is past it
  compilation_cache.release_programs_near_map_limit()  # whatever came before
  kept = _compile_one(0.25)
  assert kept._cache_size() == 1
  with caplog.at_level(logging.WARNING, logger=compilation_cache.__name__):
    assert compilation_cache.release_programs_near_map_limit()
  assert kept._cache_size() == 0 and "released JAX's compiled programs" in caplog.text
  # Nothing built since: no read of the maps, nothing released.
  monkeypatch.setattr(compilation_cache, "maps_in_use", lambda: 1 / 0)
  assert not compilation_cache.release_programs_near_map_limit()
  assert float(kept(jnp.ones(3))[0]) == float(jnp.sin(1.0) + 0.25)  # compiles again


def test_keeps_programs_below_the_limit_or_without_one(monkeypatch):
  monkeypatch.setattr(compilation_cache, "map_limit",
                      lambda: 4 * compilation_cache.maps_in_use())
  kept = _compile_one(0.5)
  assert not compilation_cache.release_programs_near_map_limit()
  assert kept._cache_size() == 1
  monkeypatch.undo()
  monkeypatch.setattr(compilation_cache, "_MAX_MAP_COUNT",
                      compilation_cache.pathlib.Path("/nonexistent/max_map_count"))
  assert compilation_cache.map_limit() is None
  _compile_one(0.75)
  assert not compilation_cache.release_programs_near_map_limit()
  assert kept._cache_size() == 1


def test_the_process_has_a_limit_and_its_maps_are_counted():
  """On Linux (where this suite runs) the limit is read, and compiling adds maps."""
  limit = compilation_cache.map_limit()
  assert limit is not None and limit > 1000
  assert 0 < compilation_cache.maps_in_use() < limit
