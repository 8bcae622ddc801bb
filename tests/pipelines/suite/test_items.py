"""The versioned cache: deterministic content (same hash twice and in another process), bad files."""

import json
import os
import subprocess
import sys

import pytest

from pipelines.suite import items

HASH_SCRIPT = "from pipelines.suite import items; print(items.items_sha256(items.generate_items(0, 20)))"


def test_same_hash_twice_and_in_a_subprocess_with_another_hash_seed(suite_cache_dir):
  first, info = items.load_or_create(suite_cache_dir, seed=0)
  again = items.generate_items(seed=0)
  assert items.items_sha256(again) == items.items_sha256(first) == info["content_sha256"]
  env = {**os.environ, "PYTHONHASHSEED": "12345"}  # str hashing differs there; generation must not
  out = subprocess.run([sys.executable, "-c", HASH_SCRIPT], capture_output=True, text=True, env=env,
                       timeout=120, check=True)
  assert out.stdout.strip() == items.items_sha256(items.generate_items(0, 20))
  # Another seed is another suite.
  assert items.items_sha256(items.generate_items(seed=1, per_category=3)) != items.items_sha256(
      items.select(first, per_category=3))


def test_cache_holds_200_items_per_category_and_reads_back_identically(suite_cache_dir):
  path = items.cache_path(suite_cache_dir, 0)
  header = json.loads(path.read_text().split("\n", 1)[0])
  assert header["suite_version"] == items.SUITE_VERSION and header["items_per_category"] == 200
  loaded, digest = items.read_cache(path, seed=0)
  assert len(loaded) == 1000 and digest == header["content_sha256"]
  assert len({ex.id for ex in loaded}) == 1000
  smoke = items.select(loaded, per_category=3)
  assert [ex.metadata["category"] for ex in smoke] == [c for c in items.CATEGORIES for _ in range(3)]
  assert [ex.id for ex in items.select(loaded, "qa", 2)] == ["suite/qa/0", "suite/qa/1"]


def test_unknown_category_names_it_and_the_valid_ones():
  with pytest.raises(ValueError, match=r"unknown suite category 'poetry': valid categories are "
                                       r"code, math, qa, instructions, summarization \(or all\)"):
    items.select([], "poetry")


@pytest.mark.parametrize("damage, why", [
    (lambda lines: lines[:5] + ["{not json"] + lines[6:], "line 6: not an item"),
    (lambda lines: lines[:1] + lines[2:], "content sha256"),  # an item lost
    (lambda lines: ["{}"] + lines[1:], "line 1: header"),
    (lambda lines: [], "empty file"),
])
def test_malformed_cache_is_an_error_naming_the_file(suite_cache_dir, tmp_path, damage, why):
  good = items.cache_path(suite_cache_dir, 0).read_text().split("\n")[:-1]
  bad = items.cache_path(tmp_path, 0)
  bad.write_text("\n".join(damage(good)) + "\n")
  with pytest.raises(items.SuiteCacheError, match=why) as err:
    items.load_or_create(tmp_path, seed=0)
  assert str(bad) in str(err.value) and "delete it to regenerate it" in str(err.value)
  bad.unlink()  # deleting it regenerates the same file
  assert items.load_or_create(tmp_path, seed=0)[1]["content_sha256"] == json.loads(good[0])["content_sha256"]


@pytest.mark.parametrize("under", ["", "cache"])
def test_a_cache_directory_that_is_a_file_is_one_error_naming_it(tmp_path, under):
  # Before: FileExistsError's traceback from the launcher's dataset scan; then mkdir's
  # "File exists" / "Not a directory", naming the directory asked for.
  blocker = tmp_path / "afile"
  blocker.write_text("not a directory\n")
  with pytest.raises(items.SuiteCacheError) as e:
    items.load_or_create(blocker / under, seed=0)
  path = items.cache_path(blocker / under, 0)
  assert str(e.value) == (f"cannot write the suite cache {path}: {blocker} is a file, not a "
                          f"directory (set dataset.cache_dir to a writable directory)")
  assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_a_cache_directory_under_home_is_read_as_a_shell_would(monkeypatch, tmp_path):
  # Before: a quoted '~/cache' made a directory named "~" in the working directory.
  monkeypatch.setenv("HOME", str(tmp_path))
  assert items.cache_path("~/suite", 3) == tmp_path / "suite" / f"suite-v{items.SUITE_VERSION}-seed3.jsonl"
  monkeypatch.setenv("O1JAX_SUITE_CACHE", "~/env")
  assert items.cache_path("", 0) == tmp_path / "env" / f"suite-v{items.SUITE_VERSION}-seed0.jsonl"
