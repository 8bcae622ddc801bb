"""GSM8K JSONL loading: good lines, dead letters with line numbers, optional routes."""

import gzip
import json
import sys
import types

import pytest

from pipelines.datasets import gsm8k
from pipelines.datasets.records import DeadLetter, Example

GOOD_1 = {"question": "Ann has 2 cats and gets 3 more. How many cats? ",
          "answer": "She has 2+3=<<2+3=5>>5 cats.\n#### 5"}
GOOD_2 = {"question": "A car costs $1,234 more than $1. What is the total?",
          "answer": "1234 + 1 = 1235... plus change\n#### 1,235"}

LINES = [
    json.dumps(GOOD_1),                                   # 1 ok
    "",                                                   # 2 blank: skipped silently
    '{"question": "broken", "answer": ',                  # 3 bad JSON
    json.dumps({"question": "no answer here"}),           # 4 missing field
    json.dumps({"question": "Q?", "answer": "just 5"}),   # 5 no #### marker
    json.dumps({"question": "Q?", "answer": "x\n#### five"}),  # 6 non-numeric final
    json.dumps([1, 2, 3]),                                # 7 not an object
    json.dumps(GOOD_2),                                   # 8 ok
    json.dumps({"question": "", "answer": "#### 1"}),     # 9 empty question
    json.dumps({"question": 7.5, "answer": ["#### 1"]}),  # 10 wrong type
]


@pytest.fixture
def gsm_file(tmp_path):
  path = tmp_path / "test.jsonl"
  path.write_text("\n".join(LINES) + "\n", encoding="utf-8")
  return str(path)


def test_good_lines_become_examples(gsm_file):
  out = list(gsm8k.read_gsm8k_jsonl(gsm_file))
  examples = [r for r in out if isinstance(r, Example)]
  assert [e.id for e in examples] == ["gsm8k/test/0", "gsm8k/test/7"]
  first, second = examples
  assert first.dataset == "gsm8k"
  assert first.question == "Ann has 2 cats and gets 3 more. How many cats?"
  assert first.reference == "5"
  assert first.metadata["solution"] == "She has 2+3=<<2+3=5>>5 cats."
  assert first.metadata["split"] == "test"
  assert second.reference == "1235"  # comma stripped


def test_a_file_url_is_the_local_file(gsm_file):
  # It failed in Beam's file systems, which know no "file" scheme ("pip install
  # apache-beam[gcp]"), where the output directory's file:// was read as the local path.
  ids = lambda path: [r.id for r in gsm8k.read_gsm8k_jsonl(path) if isinstance(r, Example)]
  assert ids(f"file://{gsm_file}") == ids(gsm_file) == ["gsm8k/test/0", "gsm8k/test/7"]


def test_malformed_lines_become_dead_letters_with_line_numbers(gsm_file):
  out = list(gsm8k.read_gsm8k_jsonl(gsm_file))
  dead = [r for r in out if isinstance(r, DeadLetter)]
  assert [d.line_number for d in dead] == [3, 4, 5, 6, 7, 9, 10]
  assert all(d.source == gsm_file for d in dead)
  reasons = {d.line_number: d.reason for d in dead}
  assert reasons[3].startswith("invalid JSON")
  assert "missing field 'answer'" in reasons[4]
  assert "####" in reasons[5]
  assert "not a number" in reasons[6]
  assert "JSON object" in reasons[7]
  assert "empty" in reasons[9]
  assert "must be a string" in reasons[10]
  assert dead[0].raw == LINES[2]
  # Reading continued past every bad line, in file order.
  kinds = [type(r).__name__ for r in out]
  assert kinds == ["Example"] + ["DeadLetter"] * 5 + ["Example"] + ["DeadLetter"] * 2


def test_split_and_dataset_names_go_into_ids(gsm_file):
  out = list(gsm8k.read_gsm8k_jsonl(gsm_file, dataset="mygsm", split="train"))
  ids = [r.id for r in out if isinstance(r, Example)]
  assert ids == ["mygsm/train/0", "mygsm/train/7"]


def test_gzip_and_bad_utf8(tmp_path):
  path = tmp_path / "test.jsonl.gz"
  payload = (json.dumps(GOOD_1).encode() + b"\n" + b'{"question": "\xff\xfe"}\n'
             + json.dumps(GOOD_2).encode() + b"\n")
  with gzip.open(path, "wb") as f:
    f.write(payload)
  out = list(gsm8k.read_gsm8k_jsonl(str(path)))
  assert [type(r) for r in out] == [Example, DeadLetter, Example]
  assert out[1].line_number == 2 and "UTF-8" in out[1].reason


def test_an_id_that_is_a_bool_or_empty_is_a_dead_letter(tmp_path):
  # Before: {"id": true} became the example id "True", {"id": ""} an empty id.
  path = tmp_path / "ids.jsonl"
  path.write_text("".join(json.dumps({"id": v, **GOOD_1}) + "\n" for v in (True, "", " ", 7)))
  out = list(gsm8k.read_gsm8k_jsonl(str(path)))
  assert [getattr(r, "reason", None) for r in out] == [
      "field 'id' must be a string, got bool", "field 'id' is empty", "field 'id' is empty", None]
  assert out[3].id == "7"


def test_record_id_field_is_kept_and_extra_fields_go_to_metadata(tmp_path):
  path = tmp_path / "x.jsonl"
  path.write_text(json.dumps({"id": "abc/1", "level": 3, **GOOD_1}) + "\n")
  (ex,) = gsm8k.read_gsm8k_jsonl(str(path))
  assert ex.id == "abc/1"
  assert ex.metadata["level"] == 3


def test_an_examples_step_limit_is_checked_where_its_line_is_known(tmp_path):
  """metadata.max_steps was checked at inference: a bad one took its whole batch to dead
  letters, named with no file or line. An integral float (a Parquet int column with
  nulls) and a CSV cell of digits are ints; null is no limit."""
  path = tmp_path / "steps.jsonl"
  values = ["abc", 0, 2.0, "3", None, True, 2.5, 4, "\u00b2"]  # ("²".isdigit(): int() raised)
  path.write_text("".join(json.dumps({"id": f"e{i}", "max_steps": v, **GOOD_1}) + "\n"
                          for i, v in enumerate(values)))
  out = list(gsm8k.read_gsm8k_jsonl(str(path)))
  bad = {d.line_number: d.reason for d in out if isinstance(d, DeadLetter)}
  assert bad == {n: f"field 'max_steps' (the example's step limit) must be an int >= 1, got {v!r}"
                 for n, v in ((1, "abc"), (2, 0), (6, True), (7, 2.5), (9, "\u00b2"))}
  steps = [e.metadata["max_steps"] for e in out if isinstance(e, Example)]
  assert steps == [2, 3, None, 4] and type(steps[0]) is int


class _FakeTfds(types.ModuleType):
  """Stands in for tensorflow_datasets: records bytes fields, like as_numpy."""

  def __init__(self, fail=False):
    super().__init__("tensorflow_datasets")
    self.fail = fail
    self.calls = []

  def load(self, name, split, data_dir, download):
    self.calls.append((name, split, data_dir, download))
    if self.fail:
      raise FileNotFoundError("no prepared gsm8k in data_dir")
    return [{"question": b"What is 2 plus 2?", "answer": b"2+2=4\n#### 4"},
            {"question": b"Broken", "answer": b"no marker"}]

  def as_numpy(self, ds):
    return iter(ds)


def test_tfds_loader_with_fake_module(monkeypatch):
  fake = _FakeTfds()
  monkeypatch.setitem(sys.modules, "tensorflow_datasets", fake)
  out = list(gsm8k.load_gsm8k_tfds("test"))
  assert fake.calls == [("gsm8k", "test", None, False)]  # never downloads by default
  assert isinstance(out[0], Example)
  assert out[0].question == "What is 2 plus 2?" and out[0].reference == "4"
  assert out[0].id == "gsm8k/test/0"
  assert isinstance(out[1], DeadLetter) and out[1].line_number == 2


def test_tfds_loader_missing_data_is_a_clear_error(monkeypatch):
  monkeypatch.setitem(sys.modules, "tensorflow_datasets", _FakeTfds(fail=True))
  with pytest.raises(gsm8k.DatasetUnavailableError, match="could not provide gsm8k/test"):
    gsm8k.load_gsm8k_tfds("test")


def test_missing_optional_packages_are_a_clear_error(monkeypatch):
  # A None entry in sys.modules makes `import` raise ImportError.
  monkeypatch.setitem(sys.modules, "datasets", None)
  monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)
  with pytest.raises(gsm8k.DatasetUnavailableError, match="pip install datasets"):
    gsm8k.load_gsm8k_hf()
  with pytest.raises(gsm8k.DatasetUnavailableError, match="read_gsm8k_jsonl"):
    gsm8k.load_gsm8k_tfds()


def test_hf_loader_with_fake_module(monkeypatch):
  fake = types.ModuleType("datasets")
  fake.load_dataset = lambda name, config, split: [
      {"question": "Q1?", "answer": "#### -3"}]
  monkeypatch.setitem(sys.modules, "datasets", fake)
  (ex,) = gsm8k.load_gsm8k_hf("train")
  assert ex.id == "gsm8k/train/0" and ex.reference == "-3"

  def offline(*a, **k):
    raise ConnectionError("offline")
  fake.load_dataset = offline
  with pytest.raises(gsm8k.DatasetUnavailableError, match="offline"):
    gsm8k.load_gsm8k_hf()
