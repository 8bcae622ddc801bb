"""HumanEval task: stop-sequence truncation and the program text for the sandbox."""

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
  assert task.completion_prompt(ex0) == ex0.question
  assert _runs_ok(task.program_for(ex0, ex0.reference))
  # A wrong body fails the check; trailing junk after a stop sequence is dropped.
  assert not _runs_ok(task.program_for(ex0, "    return False\n"))
  noisy = ex0.reference + "\nprint('junk')\nraise SystemExit(3)\n"
  assert "junk" not in task.program_for(ex0, noisy)
  assert "junk" in task.program_for(ex0, noisy, truncate=False)
  assert _runs_ok(task.program_for(ex0, noisy))
