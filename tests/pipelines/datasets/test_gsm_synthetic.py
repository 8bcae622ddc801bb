"""Synthetic GSM generator: determinism, correct answers, difficulty levels, CLI."""

import ast
import json
import operator
import re
import pathlib
import subprocess
import sys
from fractions import Fraction

import pytest

from pipelines.datasets import gsm_synthetic as gs
from pipelines.datasets.gsm8k import read_gsm8k_jsonl
from pipelines.datasets.records import Example

_ANNOT = re.compile(r"<<([^=<>]+)=([^<>]+)>>")
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub,
           ast.Mult: operator.mul, ast.Div: operator.truediv}
# Numbers a solution may use without them appearing as digits in the question:
# "twice"/"half" (2), "dozen" (12), hours (60), percent (100).
_IMPLICIT = {2, 12, 60, 100}


def _safe_eval(expr):
  """Tiny exact evaluator for + - * / over integer literals; nothing else allowed."""
  def ev(node):
    if isinstance(node, ast.Expression):
      return ev(node.body)
    if isinstance(node, ast.Constant) and type(node.value) is int:
      return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
      return _BINOPS[type(node.op)](ev(node.left), ev(node.right))
    raise ValueError(f"unsupported syntax in {expr!r}")
  return ev(ast.parse(expr, mode="eval"))


def _operands(expr):
  return [n.value for n in ast.walk(ast.parse(expr, mode="eval"))
          if isinstance(n, ast.Constant)]


def _n_ops(expr):
  return sum(isinstance(n, ast.BinOp) for n in ast.walk(ast.parse(expr, mode="eval")))


def _question_numbers(q):
  return {int(x) for x in re.findall(r"\d+", q)}


PROBLEMS = list(gs.generate(400, seed=7))


def test_same_seed_same_problems_and_prefix_stability():
  assert list(gs.generate(60, seed=0)) == list(gs.generate(60, seed=0))
  # The first n do not depend on how many are requested.
  assert list(gs.generate(25, seed=0)) == list(gs.generate(200, seed=0))[:25]
  assert gs.generate_one(0, 13, 2) == list(gs.generate(20, 0))[13]
  a = [p.question for p in gs.generate(40, seed=0)]
  b = [p.question for p in gs.generate(40, seed=1)]
  assert sum(x != y for x, y in zip(a, b)) > 30


def test_levels_cycle_and_ids():
  probs = list(gs.generate(8, seed=3))
  assert [p.level for p in probs] == [1, 2, 3, 4, 1, 2, 3, 4]
  assert [p.id for p in probs[:2]] == ["gsm_synthetic/s3/0", "gsm_synthetic/s3/1"]
  assert {p.level for p in gs.generate(10, seed=3, levels=[2])} == {2}
  with pytest.raises(ValueError):
    list(gs.generate(1, levels=[9]))


@pytest.mark.parametrize("prob", PROBLEMS, ids=lambda p: p.id)
def test_worked_solution_arithmetic_and_final_answer(prob):
  steps = _ANNOT.findall(prob.answer)
  assert steps, prob.answer
  known = _question_numbers(prob.question) | _IMPLICIT
  for expr, shown in steps:
    value = _safe_eval(expr)
    assert value == Fraction(shown), (expr, shown)  # each step's arithmetic is right
    assert value.denominator == 1 and value >= 0
    # Every operand comes from the question, an earlier step, or a unit constant.
    for x in _operands(expr):
      assert x in known, (x, expr, prob.question)
    known.add(int(value))
  # The final answer is the last step's result, in GSM8K's "#### N" form.
  assert prob.answer.endswith(f"\n#### {prob.final}")
  assert int(steps[-1][1]) == prob.final
  assert prob.question.endswith("?")


@pytest.mark.parametrize("level, n_steps", [(1, 1), (2, 2), (3, 3)])
def test_step_counts_per_level(level, n_steps):
  for p in (p for p in PROBLEMS if p.level == level):
    assert len(_ANNOT.findall(p.answer)) == n_steps, p.answer
  level4 = [p for p in PROBLEMS if p.level == 4]
  assert all(len(_ANNOT.findall(p.answer)) >= 4 for p in level4)


def test_level1_is_genuinely_easy():
  level1 = [p for p in PROBLEMS if p.level == 1]
  assert len(level1) == 100
  for p in level1:
    ((expr, _),) = _ANNOT.findall(p.answer)
    assert _n_ops(expr) == 1  # exactly one arithmetic operation
    nums = _question_numbers(p.question)
    assert max(nums) <= 30 and len(nums) <= 2, p.question
    assert p.final <= 50
    assert set(_operands(expr)) == nums  # both numbers come straight from the text


def test_template_diversity():
  for level in gs.LEVELS:
    names = gs.template_names(level)
    assert len(names) >= 7
    seen = {p.template for p in gs.generate(600, seed=11, levels=[level])}
    assert seen == set(names)  # every template is reachable
  assert len({p.question for p in PROBLEMS}) == len(PROBLEMS)
  # Operations at higher levels include multiplication, division and percent.
  text = " ".join(p.answer for p in PROBLEMS if p.level >= 3)
  assert "*" in text and "/100" in text and "/" in text.replace("/100", "")


def test_to_example_and_record():
  p = PROBLEMS[5]
  ex = p.to_example()
  assert isinstance(ex, Example)
  assert ex.reference == str(p.final) and ex.metadata["level"] == p.level
  assert set(p.to_record()) == {"id", "level", "template", "question", "answer"}


def test_cli_writes_readable_gsm8k_jsonl(tmp_path):
  out = tmp_path / "syn.jsonl"
  assert gs.main(["--n", "12", "--seed", "0", "--out", str(out)]) == 0
  lines = out.read_text().splitlines()
  assert [json.loads(l) for l in lines] == [p.to_record() for p in gs.generate(12, 0)]
  examples = list(read_gsm8k_jsonl(str(out)))
  assert all(isinstance(e, Example) for e in examples)
  assert [e.id for e in examples] == [f"gsm_synthetic/s0/{i}" for i in range(12)]
  assert [e.reference for e in examples] == [str(p.final) for p in gs.generate(12, 0)]
  assert examples[3].metadata["level"] == 4


def test_cli_as_module(tmp_path):
  out = tmp_path / "m.jsonl"
  proc = subprocess.run([sys.executable, "-m", "pipelines.datasets.gsm_synthetic", "--n", "5",
                         "--seed", "2", "--levels", "1", "--out", str(out)], check=True,
                        capture_output=True, text=True, timeout=120,
                        cwd=pathlib.Path(__file__).resolve().parents[3])  # repo root
  recs = [json.loads(l) for l in out.read_text().splitlines()]
  assert len(recs) == 5 and {r["level"] for r in recs} == {1}
  # (runpy's "found in sys.modules after import of package" warning, every run before)
  assert proc.stderr == f"wrote 5 problems to {out}\n"


@pytest.mark.parametrize("args, message", [
    (["--levels", "1,2,5"], r"--levels '1,2,5': expected comma-separated levels from \(1, 2, 3, 4\)"),
    (["--levels", "1,x"], r"--levels '1,x': expected"),
    (["--levels", ","], r"--levels ',': expected"),
    (["--n", "-3"], r"--n -3: expected a count >= 1"),
])
def test_cli_bad_input_is_one_line_and_leaves_the_file(tmp_path, capsys, args, message):
  """Before: a traceback after the file had been replaced by a partial one (--levels 5:
  200 problems became 2), or 'wrote 0 problems' (--n -3)."""
  out = tmp_path / "keep.jsonl"
  out.write_text("the user's file\n")
  with pytest.raises(SystemExit) as e:
    gs.main([*args, "--out", str(out)])
  assert e.value.code == 2 and re.search(message, capsys.readouterr().err)
  assert out.read_text() == "the user's file\n"
  with pytest.raises(SystemExit):
    gs.main(["--out", str(tmp_path / "nowhere" / "x.jsonl")])


def test_no_question_is_asked_twice_and_more_problems_keep_the_first():
  """Level 1 repeated 10-19 of 1,000 questions a seed (counted twice in an accuracy)."""
  for seed in (0, 1):
    problems = list(gs.generate(1000, seed, levels=(1,)))
    assert len({p.question for p in problems}) == 1000
    assert list(gs.generate(300, seed, levels=(1,))) == problems[:300]
  assert gs.generate_one(0, 5, 1, redraw=1).question != gs.generate_one(0, 5, 1).question


def test_a_count_of_one_reads_singular():
  """'1 miles', '1 boys', '1 girls' in the questions (87 + 31 of 10,000)."""
  questions = [p.question for seed in (0, 1) for p in gs.generate(2000, seed)]
  assert not [q for q in questions if re.search(r"\b1 (miles|boys|girls|hours)\b", q)]
  assert any(re.search(r"\b1 mile\b", q) for q in questions)
  assert any(re.search(r"\b1 (boy|girl)\b", q) for q in questions)


@pytest.mark.parametrize("level", [True, 1.0, "1", 0])
def test_a_level_is_an_int_of_the_generator(level):
  # Before: True and 1.0 were level 1, written into the records as true / 1.0.
  with pytest.raises(ValueError, match=r"level must be one of \(1, 2, 3, 4\), got "):
    list(gs.generate(2, 0, levels=(level,)))
