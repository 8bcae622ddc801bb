"""The suite's cache, generated once per test session into a temporary directory."""

import pytest


@pytest.fixture(scope="session")
def suite_cache_dir(tmp_path_factory):
  from pipelines.suite import items
  directory = tmp_path_factory.mktemp("suite_cache")
  items.load_or_create(directory, seed=0)
  return directory
