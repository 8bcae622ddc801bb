"""Code: HumanEval's 164 then 36 generated tasks; canonical solutions pass in the sandbox, wrong fail."""

from pipelines.sandbox import Sandbox, SandboxConfig
from pipelines.suite import code_generation as code


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
  generated = [code.generated_task(0, i) for i in range(code.GENERATED)]
  right = [(ex, ex.metadata["canonical_solution"], ()) for ex in generated]
  wrong = [(ex, "    return None\n", ()) for ex in generated[:4]]
  # The stop sequence cuts what follows the function: a trailing top-level line is ignored.
  cut = [(generated[0], generated[0].metadata["canonical_solution"] + "\nprint(undefined_name)\n", ())]
  sandbox = Sandbox(SandboxConfig(timeout_s=5.0, workers=2))
  scores = code.score_many(right + wrong + cut, sandbox)
  assert [s["correct"] for s in scores] == [True] * 36 + [False] * 4 + [True]
  assert scores[36]["status"] != "passed" and scores[0]["metrics"] == {"pass": 1.0}
