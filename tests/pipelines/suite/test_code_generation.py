"""Code: HumanEval's 164 then 36 generated tasks; canonical solutions pass in the sandbox, wrong fail."""

import pytest

from pipelines.sandbox import Sandbox, SandboxConfig
from pipelines.suite import code_generation as code
from pipelines.tasks import humaneval

GENERATED = 200 - 164  # a category's items after HumanEval's problems


def test_humaneval_first_then_generated_tasks_with_hidden_tests():
  items = code.generate(200, seed=0)
  assert [ex.metadata["source"] for ex in items] == ["humaneval"] * 164 + ["generated"] * 36
  assert items[0].id == "suite/code/HumanEval/0"
  templates = {ex.metadata["template"].split("_")[0] for ex in items[164:]}
  assert len(templates) >= 10
  for ex in items[164:]:
    assert ex.metadata["test"].count("assert candidate(") == code.HIDDEN_TESTS
    assert ex.question.count(">>> ") == 2


def test_generated_canonical_solutions_pass_and_wrong_ones_fail_in_the_sandbox():
  generated = [code.generated_task(0, i) for i in range(GENERATED)]
  right = [(ex, ex.metadata["canonical_solution"], ()) for ex in generated]
  wrong = [(ex, "    return None\n", ()) for ex in generated[:4]]
  # The stop sequence cuts what follows the function: a trailing top-level line is ignored.
  cut = [(generated[0], generated[0].metadata["canonical_solution"] + "\nprint(undefined_name)\n", ())]
  sandbox = Sandbox(SandboxConfig(timeout_s=5.0, workers=2))
  scores = code.score_many(right + wrong + cut, sandbox, "completion")
  assert [s["correct"] for s in scores] == [True] * 36 + [False] * 4 + [True]
  assert scores[36]["status"] != "passed" and scores[0]["metrics"] == {"pass": 1.0}


def test_chat_replies_pass_with_the_function_in_a_code_block_and_fail_without_it():
  """Chat style: the reply's first fenced block follows the prompt. A whole function in a
  fence (prose around it), a bare body, an unclosed fence and a reply with no fence but
  only code pass; prose, a wrong body and a function under another name fail."""
  ex = code.generated_task(0, 3)
  body = ex.metadata["canonical_solution"]
  whole = ex.question + body
  messages, stop = code.prompt(ex)
  assert stop == (humaneval.CLOSING_FENCE,) and messages[0]["role"] == "user"
  assert messages[0]["content"].endswith(f"```python\n{ex.question}```")
  assert code.prompt(ex, "completion")[0] == ex.question
  replies = {
      "fenced whole function": f"Here it is:\n```python\n{whole}```\nIt loops once.",
      "fenced body": f"```python\n{body}```",
      "unclosed fence": f"```py\n{whole}",
      "no fence, code": body,
      "prose": "The function returns the answer.",
      "wrong body": "```python\n    return None\n```",
      "other name": f"```python\n{whole.replace(ex.metadata['entry_point'], 'helper')}```",
  }
  sandbox = Sandbox(SandboxConfig(timeout_s=5.0, workers=2))
  scores = code.score_many([(ex, r, stop) for r in replies.values()], sandbox)
  assert dict(zip(replies, (s["correct"] for s in scores))) == {
      "fenced whole function": True, "fenced body": True, "unclosed fence": True,
      "no fence, code": True, "prose": False, "wrong body": False, "other name": False}
  with pytest.raises(ValueError, match="prompt.code_style='diff': valid styles are"):
    code.prompt(ex, "diff")


def test_no_generated_test_is_passed_by_a_constant():
  """Before: 30 of 1,200 items of seeds 0-199 expected one output in all 6 hidden cases
  (seed 7's `words_longer_than_5` always `[]`: `return []` passed)."""
  import ast
  for seed in range(60):
    for index in range(GENERATED):
      test = code.generated_task(seed, index).metadata["test"]
      expected = {repr(ast.literal_eval(line.split(") == ", 1)[1]))
                  for line in test.splitlines() if ") == " in line}
      assert len(expected) > 1, (seed, index, test)


def test_no_generated_function_is_asked_for_twice():
  """Seed 0 asked for words_longer_than_4 and chunk_sums_of_3 twice each (34 distinct
  tasks of 36); a template whose parameters run out (more tasks than specs) repeats."""
  for seed in range(4):
    generated = [e for e in code.generate(200, seed) if e.metadata["source"] == "generated"]
    names = [e.metadata["entry_point"] for e in generated]
    assert len(generated) == 36 and len(set(names)) == 36, seed
    # A task drawn first is the pure function's; a redrawn one is its own draw.
    assert all(e == code.generated_task(seed, i) for i, e in enumerate(generated)
               if e.metadata["entry_point"] == code.generated_task(seed, i).metadata["entry_point"])
  many = [e for e in code.generate(164 + 120, 0) if e.metadata["source"] == "generated"]
  assert len(many) == 120 and len({e.metadata["entry_point"] for e in many}) < 120
