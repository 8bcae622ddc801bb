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
  subprocess.run([sys.executable, "-m", "pipelines.datasets.gsm_synthetic", "--n", "5",
                  "--seed", "2", "--levels", "1", "--out", str(out)], check=True,
                 capture_output=True, timeout=120,
                 cwd=pathlib.Path(__file__).resolve().parents[3])  # repo root
  recs = [json.loads(l) for l in out.read_text().splitlines()]
  assert len(recs) == 5 and {r["level"] for r in recs} == {1}
