"""Shared fixtures: the compilation cache and the embedded model, loaded once."""

import pytest

from o1jax.compilation_cache import enable_compilation_cache

enable_compilation_cache()


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
  """Drops JAX's compiled programs after each test module. Every XLA:CPU executable
  maps its code into many memory regions; the suite compiles thousands of programs
  (each controller or engine a test builds compiles its own) and one process
  reached the kernel's limit of 65530 mappings, where the next compile crashed."""
  yield
  import gc

  import jax

  jax.clear_caches()
  gc.collect()


@pytest.fixture(scope="session")
def embedded_checkpoint():
  from o1jax.checkpoint import load_checkpoint

  return load_checkpoint("embedded")


@pytest.fixture(scope="session")
def embedded_generator(embedded_checkpoint):
  from o1jax.model import Generator, Llama

  ck = embedded_checkpoint
  return Generator(Llama(ck.config, ck.params), ck.tokenizer)
