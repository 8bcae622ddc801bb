"""Integrity: wrong completions must never score as passed (one class of cheat per section).

Each payload below is a *wrong* completion plus a cheat; without the defence it
targets, the cheat turns it into a pass. The classes:

- native code: a forbidden extension module loaded under another name, from another
  path, or through `_imp` directly (then: raw memory, frames, subprocesses);
- forged types: a metaclass that decides how its classes compare;
- steered randomness: a test that draws its inputs from `random` must not be
  reachable by the candidate (seed, state, class or C-base patches);
- text the host cannot encode (lone surrogates) must fail that sample only.
"""
import os
import textwrap

import pytest

from tests.pipelines.sandbox.add_problem import PROMPT, RIGHT, TEST, WRONG, program
from pipelines.sandbox import HumanEvalProgram, Sandbox, SandboxConfig, Status

# A randomized test in the style of HumanEval/53: inputs come from the module-level
# generator, so a candidate that could steer it would only need to be right there.
RANDOM_PROMPT = 'def double(n):\n    """Return 2 * n."""\n'
RANDOM_TEST = textwrap.dedent('''\
  import random


  def check(candidate):
      from random import randint
      for _ in range(40):
          n = random.randint(1, 10 ** 9)
          assert candidate(n) == 2 * n
      for _ in range(10):
          m = randint(1, 10 ** 9)
          assert candidate(m) == 2 * m
''')
RANDOM_RIGHT = '    return 2 * n\n'

# Reads the harness's pass marker out of its frames, then forges the pass itself.
_FORGE = '''
def _forge(frame):
    import os, sys
    while frame is not None:
        local = frame.f_locals
        if isinstance(local.get('sentinel'), bytes):
            os.write(int(sys.argv[2]), b'pass ' + local['sentinel'] + b'\\n')
            os._exit(0)
        frame = frame.f_back
'''

_LIB_DYNLOAD = '''
import os, sys
_dynload = next(p for p in sys.path if p.endswith('lib-dynload'))
def _native(stem):
    names = [n for n in os.listdir(_dynload) if n.split('.')[0] == stem]
    if not names:
        raise FileNotFoundError(f'{stem} is absent')
    return os.path.join(_dynload, names[0])
'''


NATIVE_CASES = {
  # _ctypes under a harmless dotted name, then PyEval_GetFrame -> the harness's frames.
  'ctypes_aliased_name': program(WRONG, helpers=(_LIB_DYNLOAD, _FORGE,), module_code='''
    import importlib.util
    spec = importlib.util.spec_from_file_location('innocent._ctypes', _native('_ctypes'))
    c = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(c)
    class _Lib:
        _handle = c.dlopen(None)
    class _PyObject(c._SimpleCData):
        _type_ = 'O'
    class _PyFunction(c.CFuncPtr):
        _flags_ = c.FUNCFLAG_CDECL | c.FUNCFLAG_PYTHONAPI
        _restype_ = _PyObject
    _current_frame = _PyFunction(('PyEval_GetFrame', _Lib()))
    def add(a, b):
        _forge(_current_frame())
    '''),
  # The same module through _imp with a hand-made spec (no importlib machinery).
  'ctypes_via_imp': program(WRONG, helpers=(_LIB_DYNLOAD,), module_code='''
    import _imp
    class Spec:
        name = 'helpers._ctypes'
        origin = _native('_ctypes')
    c = _imp.create_dynamic(Spec())
    _imp.exec_dynamic(c)
    assert c.dlopen(None)
    '''),
  # Subprocesses are disabled: _posixsubprocess under another name would start one.
  'posixsubprocess_aliased': program(WRONG, helpers=(_LIB_DYNLOAD,), module_code='''
    import importlib.util
    spec = importlib.util.spec_from_file_location('my.tools._posixsubprocess',
                                                  _native('_posixsubprocess'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    '''),
  # A copy of a forbidden module from some other tree of the file system.
  'ctypes_other_tree': program(WRONG, '''
    import os, importlib.util
    found = None
    for root in ('/usr/lib', '/usr/local/lib', '/usr/lib64'):
        for top, dirs, files in os.walk(root):
            for name in files:
                if name.startswith(('_ctypes.', '_cffi_backend.')) and name.endswith('.so'):
                    found = found or os.path.join(top, name)
    assert found, 'every copy is absent'
    spec = importlib.util.spec_from_file_location('x.' + os.path.basename(found).split('.')[0], found)
    importlib.util.module_from_spec(spec)
    '''),
  # A built-in module needs no file: _signal's handlers receive the harness's frames.
  'signal_via_create_builtin': program(WRONG, helpers=(_FORGE,), module_code='''
    import _imp
    class Spec:
        name = '_signal'
        origin = 'built-in'
    s = _imp.create_builtin(Spec())
    _imp.exec_builtin(s)
    def add(a, b):
        s.signal(s.SIGUSR1, lambda signum, frame: _forge(frame))
        s.raise_signal(s.SIGUSR1)
    '''),
  'signal_via_builtin_importer': program(WRONG, helpers=(_FORGE,), module_code='''
    import importlib.machinery
    spec = importlib.machinery.ModuleSpec('_signal', importlib.machinery.BuiltinImporter)
    s = importlib.machinery.BuiltinImporter.create_module(spec)
    importlib.machinery.BuiltinImporter.exec_module(s)
    def add(a, b):
        s.signal(s.SIGUSR1, lambda signum, frame: _forge(frame))
        s.raise_signal(s.SIGUSR1)
    '''),
  # The import statement, with the forbidden name in a later part.
  'dotted_import_name': program(WRONG, helpers=(_LIB_DYNLOAD,), module_code='''
    import types
    sys.modules['pkg'] = types.ModuleType('pkg')
    sys.modules['pkg'].__path__ = [_dynload]
    import pkg._ctypes
    '''),
}

_META = '''
class _Meta(type):
    def __eq__(cls, other):
        return True
    def __hash__(cls):
        return 0
class Fake(metaclass=_Meta):
    def __eq__(self, other):
        return True
    def __float__(self):
        return 0.3
    def __sub__(self, other):
        return 0
'''

PAIR_PROMPT = 'def pair(a, b):\n    """Return [a, b]."""\n'
PAIR_TEST = textwrap.dedent('''\
  def check(candidate):
      assert candidate(1, 2) == [1, 2]
      assert candidate('x', None) == ['x', None]
''')
INVERT_PROMPT = 'def invert(d):\n    """Swap keys and values."""\n'
INVERT_TEST = textwrap.dedent('''\
  def check(candidate):
      assert candidate({1: 'a', 2: 'b'}) == {'a': 1, 'b': 2}
''')

FORGED_TYPE_CASES = {
  'metaclass_scalar': program('    return Fake()\n', _META),
  'metaclass_inside_list': program('    return [Fake(), Fake()]\n', _META,
                                   prompt=PAIR_PROMPT, test=PAIR_TEST, entry='pair'),
  'metaclass_nested_in_tuple_list': program('    return [Fake(), (Fake(),)][:1] * 2\n', _META,
                                            prompt=PAIR_PROMPT, test=PAIR_TEST, entry='pair'),
  'metaclass_dict_values': program('    return {v: Fake() for v in d.values()}\n', _META,
                                   prompt=INVERT_PROMPT, test=INVERT_TEST, entry='invert'),
  'metaclass_int_subclass': program('    return Liar(0)\n', '''
    class _Meta(type):
        def __eq__(cls, other):
            return True
        def __hash__(cls):
            return 0
    class Liar(int, metaclass=_Meta):
        def __eq__(self, other):
            return True
        def __sub__(self, other):
            return 0
        def __float__(self):
            return 0.3
    '''),
}


def random_program(module_code, body='    return 10\n'):
  return program(body, module_code, prompt=RANDOM_PROMPT, test=RANDOM_TEST, entry='double')


STEERED_RANDOM_CASES = {
  'class_patch_randrange': random_program('''
    import random
    random.Random.randrange = lambda self, *args, **kwargs: 5
    '''),
  'c_base_patch_getrandbits': random_program('''
    import _random
    _random.Random.getrandbits = lambda self, k: 4
    _random.Random.random = lambda self: 0.0
    ''', body='    return 2 * n if n == 5 else 10\n'),
  'reseed_and_replay': random_program('''
    import random
    random.seed(1234)
    _replay = random.Random(1234)
    _expected = iter([2 * _replay.randint(1, 10 ** 9) for _ in range(50)])
    ''', body='    return next(_expected)\n'),
  'setstate_and_replay': random_program('''
    import random
    _state = random.Random(99).getstate()
    random.setstate(_state)
    _replay = random.Random()
    _replay.setstate(_state)
    _expected = iter([2 * _replay.randint(1, 10 ** 9) for _ in range(50)])
    ''', body='    return next(_expected)\n'),
  'reseed_inside_candidate': random_program('''
    import random
    random.seed(7)
    _answer = 2 * random.Random(7).randint(1, 10 ** 9)
    ''', body='    random.seed(7)\n    return _answer\n'),
}


# The same class beyond randomness: a package the test uses must not run on the
# untrusted side's builtins (Counter.most_common calls sorted()).
COUNT_PROMPT = 'def most_common(text):\n    """Letters with their counts, most common first."""\n'
COUNT_TEST = textwrap.dedent('''\
  import collections


  def check(candidate):
      assert candidate('abbccc') == collections.Counter('abbccc').most_common()
''')
STEERED_RANDOM_CASES['builtins_under_a_package'] = program('    return []\n', '''
    import builtins
    builtins.sorted = lambda *args, **kwargs: []
    ''', prompt=COUNT_PROMPT, test=COUNT_TEST, entry='most_common')


SURROGATE_COMPLETIONS = {
  'string_literal': "    return a + b  # ok\n    s = '\ud800'\n",
  'comment': '    return a + b  # \udcff\n',
  'low_surrogate_identifier_position': '    \udc80 = 1\n    return a + b\n',
}


@pytest.fixture(scope='module')
def sandbox():
  return Sandbox(SandboxConfig(timeout_s=5.0, workers=2))


@pytest.fixture(scope='module')
def results(sandbox):
  # The import policy alone: every extension module of the host is visible.
  # The payloads are harmless there: they load modules and read their own frames.
  bare = Sandbox(SandboxConfig(timeout_s=5.0, workers=2))
  bare._native_files = sorted(os.listdir(bare._native_dir))
  bare._masked = []
  bare_results = bare.run_many(NATIVE_CASES.values())
  cases = {**{f'native/{k}': v for k, v in NATIVE_CASES.items()},
           **{f'type/{k}': v for k, v in FORGED_TYPE_CASES.items()},
           **{f'random/{k}': v for k, v in STEERED_RANDOM_CASES.items()},
           'control/right': program(RIGHT),
           'control/random_right': random_program('', body=RANDOM_RIGHT),
           'control/count_right': program('    return collections.Counter(text).most_common()\n',
                                          'import collections\n', prompt=COUNT_PROMPT,
                                          test=COUNT_TEST, entry='most_common')}
  names = list(cases)
  results = dict(zip(names, sandbox.run_many(cases[n] for n in names)))
  results.update({f'bare/{k}': r for k, r in zip(NATIVE_CASES, bare_results)})
  return results



@pytest.mark.parametrize('name', sorted(NATIVE_CASES))
def test_forbidden_native_code_is_absent_or_refused(results, name):
  result = results[f'native/{name}']
  assert result.status is Status.FAILED, (result.status, result.detail, result.stderr_tail[-600:])
  # Not there, or refused by the import policy; not an unrelated error on the way.
  assert any(word in result.detail for word in ('absent', 'disabled', 'not allowed')), result.detail


@pytest.mark.parametrize('name', sorted(NATIVE_CASES))
def test_import_policy_refuses_native_code_that_is_present(results, name):
  result = results[f'bare/{name}']
  assert result.status is Status.FAILED, (result.status, result.detail, result.stderr_tail[-600:])
  assert 'disabled' in result.detail or 'not allowed' in result.detail, result.detail


def test_extension_directory_holds_only_allowed_modules(sandbox):
  result = sandbox.run(textwrap.dedent('''
    import os, sys
    dynload = next(p for p in sys.path if p.endswith('lib-dynload'))
    stems = {name.split('.')[0] for name in os.listdir(dynload)}
    assert {'math', '_random', '_json'} <= stems, stems
    assert not stems & {'_ctypes', '_testcapi', '_posixsubprocess', '_sqlite3'}, stems
    '''))
  assert result.status is Status.PASSED, result.detail


@pytest.mark.parametrize('name', sorted(FORGED_TYPE_CASES))
def test_types_are_compared_by_identity(results, name):
  result = results[f'type/{name}']
  assert result.status is Status.FAILED, (result.status, result.detail)
  assert 'not plain built-in data' in result.detail, result.detail


@pytest.mark.parametrize('name', sorted(STEERED_RANDOM_CASES))
def test_the_tests_randomness_is_private(results, name):
  result = results[f'random/{name}']
  assert result.status is Status.FAILED, (result.status, result.detail)
  assert 'AssertionError' in result.detail or 'StopIteration' in result.detail, result.detail


def test_controls_pass(results):
  assert results['control/right'].status is Status.PASSED, results['control/right']
  for name in ('control/random_right', 'control/count_right'):
    assert results[name].status is Status.PASSED, results[name]


@pytest.mark.parametrize('where', sorted(SURROGATE_COMPLETIONS))
def test_lone_surrogate_fails_only_its_own_sample(sandbox, where):
  programs = [program(RIGHT), program(SURROGATE_COMPLETIONS[where]), program(WRONG)]
  right, bad, wrong = sandbox.run_many(programs)
  assert right.status is Status.PASSED
  assert bad.status is Status.FAILED, (bad.status, bad.detail)
  assert 'surrogate' in bad.detail
  assert wrong.status is Status.FAILED


def test_lone_surrogate_in_plain_program_and_trusted_text(sandbox):
  assert sandbox.run('x = "\ud800"').status is Status.FAILED
  # Broken trusted text (a test with a surrogate) is the harness's input, still one sample.
  bad_test = HumanEvalProgram(PROMPT, RIGHT, TEST + '# \ud800\n', 'add')
  results = sandbox.run_many([bad_test, program(RIGHT)])
  assert results[0].status is not Status.PASSED
  assert results[1].status is Status.PASSED
