"""Shared fixtures: the compilation cache and the embedded model, loaded once."""

import pytest

from o1jax.compilation_cache import enable_compilation_cache

enable_compilation_cache()


@pytest.fixture(scope="session")
def embedded_checkpoint():
  from o1jax.checkpoint import load_checkpoint

  return load_checkpoint("embedded")


@pytest.fixture(scope="session")
def embedded_generator(embedded_checkpoint):
  from o1jax.model import Generator, Llama

  ck = embedded_checkpoint
  return Generator(Llama(ck.config, ck.params), ck.tokenizer)
