"""The bound on JAX's in-memory programs (`release_programs_near_map_limit`)."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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


# -- batch-invariant compiler options ---------------------------------------------------------

def _rms_rows(x):
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-5)


def test_model_programs_compute_a_row_alike_in_any_batch():
  """RMSNorm's row reduction, one row alone and among four: bit-identical under
  `compilation_cache.jit` (XLA:CPU's default YNNPACK reduction fusions put them ~2e-6
  apart on jaxlib 0.10-0.11)."""
  x = jax.random.normal(jax.random.key(0), (4, 1024, 576), jnp.float32)
  norm = compilation_cache.jit(_rms_rows)
  assert compilation_cache.compiler_options() == compilation_cache.BATCH_INVARIANT_CPU_OPTIONS
  np.testing.assert_array_equal(np.asarray(norm(x[:1])), np.asarray(norm(x)[:1]))


def test_an_xla_without_the_options_falls_back_to_its_defaults(monkeypatch, caplog):
  monkeypatch.setattr(compilation_cache, "BATCH_INVARIANT_CPU_OPTIONS",
                      {compilation_cache.YNN_FUSION_OPTION: "LIBRARY_FUSION_TYPE_NO_SUCH_TYPE"})
  compilation_cache.compiler_options.cache_clear()
  try:
    with caplog.at_level(logging.WARNING, logger=compilation_cache.__name__):
      assert compilation_cache.compiler_options() is None
    assert "XLA:CPU refused" in caplog.text
    double = compilation_cache.jit(lambda x: 2 * x)
    assert float(double(jnp.float32(3))) == 6.0
  finally:
    compilation_cache.compiler_options.cache_clear()


def test_an_xla_flag_the_user_set_is_kept(monkeypatch, caplog):
  """A user who sets the YNNPACK fusion option in XLA_FLAGS gets it for the model's
  programs too (read by XLA when the backend starts; the per-program options would
  override it)."""
  flags = f"--{compilation_cache.YNN_FUSION_OPTION}=LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"
  monkeypatch.setenv("XLA_FLAGS", flags)
  compilation_cache.compiler_options.cache_clear()
  try:
    with caplog.at_level(logging.WARNING, logger=compilation_cache.__name__):
      assert compilation_cache.compiler_options() is None
    assert "XLA_FLAGS sets xla_cpu_experimental_ynn_fusion_type" in caplog.text
  finally:
    compilation_cache.compiler_options.cache_clear()


class _Scaled:
  def __init__(self, factor):
    self.factor = factor

  @compilation_cache.jit(static_argnames=("self",))
  def apply(self, x):
    return x * self.factor


def test_jit_decorates_functions_and_methods_as_jax_jit_does():
  a, b = _Scaled(2.0), _Scaled(3.0)
  assert float(a.apply(jnp.float32(1))) == 2.0 and float(b.apply(jnp.float32(1))) == 3.0
  assert _Scaled.apply._cache_size() == 2  # static self: one program each
  text = _Scaled.apply.trace(a, jnp.float32(1)).lower().as_text()
  assert "stablehlo.multiply" in text
  with pytest.raises(TypeError):
    a.apply()  # jax.jit's own error for a missing argument
