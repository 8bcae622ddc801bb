"""Trusted harness that runs one untrusted program inside the sandbox.

Executed as `python -I -S -B -c <boot> <this source> <payload_fd> <result_fd> <allow_subprocesses>`
in a fresh interpreter, with globals that no module references, so that untrusted
code cannot reach (or patch) the harness's own functions and builtins.

Proof of a pass: the host sends a random sentinel on the payload pipe; it lives only
in a local of `main()` and is written to the result pipe after `check()` returned
normally, called the candidate, and every candidate result was plain data (types
compared by identity). Before any untrusted code runs, an audit hook removes the
ways Python code can look at other frames or at raw memory (frames, tracebacks'
frames, gc, signal handlers, tracing, crafted code objects), and the import policy
admits native code only from the interpreter's own extension directory, by file
and by every part of the module's name, including modules made through `_imp`.
The test runs on private instances of the modules it imports (its randomness
included), made before the untrusted code runs.
"""
import builtins
import importlib.machinery
import importlib.util
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
# Types are compared by identity (id of the real type), never with ==: a metaclass
# decides what == means for its classes.
_PLAIN_SCALAR_IDS = frozenset(map(id, (_type(None), bool, int, float, complex, str, bytes)))
_PLAIN_CONTAINER_IDS = frozenset(map(id, (list, tuple, set, frozenset)))
_DICT_ID = id(dict)
_MEMORY_ERROR_LINE = b'error MemoryError: memory limit reached\n'
_FRAME_ATTRIBUTES = frozenset({'tb_frame', 'gi_frame', 'cr_frame', 'ag_frame'})
_BLOCKED_EVENTS = frozenset({
  'sys._current_frames', 'sys._current_exceptions', 'sys.settrace', 'sys.setprofile',
  'sys.addaudithook', 'gc.get_objects', 'gc.get_referrers', 'gc.get_referents',
  'code.__new__', 'marshal.loads', 'marshal.load', 'sys.remote_exec',
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
_SPAWN_MODULES = frozenset({'_posixsubprocess', 'signal', '_signal'})
# Modules the harness imports before the guard so the untrusted code need not.
_PRELOAD = ('typing',)


class _Refused(Exception):
  pass


def _blocked_modules(allow_subprocesses):
  return _BLOCKED_MODULES if allow_subprocesses else _BLOCKED_MODULES | _SPAWN_MODULES


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


def _imported_modules(source):
  """Top-level module names of `import x` / `from x import y` lines of trusted text."""
  names = []
  for line in source.splitlines():
    words = line.replace(',', ' ').split()
    if _len(words) >= 2 and words[0] == 'from' and not words[1].startswith('.'):
      names.append(words[1].partition('.')[0])
    elif words and words[0] == 'import':
      names.extend(w.partition('.')[0] for w in words[1:] if w != 'as' and w.isidentifier())
  return names


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


def _private_modules(names, pristine):
  """The test's own instances of the modules it and the prompt import, made now.

  The untrusted code shares sys.modules and every class in it; the test must not
  share anything it can steer: `random`'s hidden generator (seed, setstate), its
  classes (random.Random.randrange) and their C bases (_random.Random.getrandbits).
  The extension modules these modules import directly get new instances too.
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
  return modules


def _guard_builtin_modules(blocked_modules):
  """`_imp.create_builtin` makes a built-in module from a name and raises no audit event.

  Through it (or BuiltinImporter, which calls it) `_signal` could be made although its
  import is refused, and a signal handler receives frames. It is replaced by a checked
  version; the original lives only in the frame of a suspended generator, which
  untrusted code cannot open (gi_frame is refused), so it cannot be called directly.
  """
  import _imp
  refused_names = blocked_modules | {'_imp'}  # a new _imp would carry the original

  def serve(original):
    outcome = None
    while True:
      name = yield outcome
      try:
        outcome = (True, original(types.SimpleNamespace(name=name)))
      except BaseException as exc:
        outcome = (False, exc)

  server = serve(_imp.create_builtin)
  next(server)
  send = server.send

  def create_builtin(spec):
    name = spec.name  # read once: a property could answer differently the second time
    refused = _refused_name(name, refused_names)
    if refused is not None:
      raise ImportError(refused)
    made, value = send(name)
    if made:
      return value
    raise value

  _imp.create_builtin = create_builtin


def _native_files(paths):
  """{path: module name} of the extension files the host allows (newline-separated)."""
  return {path: path.rpartition('/')[2].partition('.')[0] for path in paths.split('\n') if path}


def _assert_plain(value):
  """Candidate results must be built-in data: an object with a forged __eq__ fails."""
  stack, seen = [value], set()
  while stack:
    item = stack.pop()
    kind = _type(item)
    kind_id = _id(kind)
    if kind_id in _PLAIN_SCALAR_IDS:
      continue
    if _id(item) in seen:
      continue
    if kind_id in _PLAIN_CONTAINER_IDS:
      seen.add(_id(item))
      stack.extend(item)
    elif kind_id == _DICT_ID:
      seen.add(_id(item))
      stack.extend(dict.keys(item))
      stack.extend(dict.values(item))
    else:
      raise _Refused(f'candidate returned {kind.__name__!r}, not plain built-in data')


def _run_humaneval(prompt, completion, test, entry_point, strict, snapshot, pristine):
  """Untrusted module first, then the trusted test text in its own namespace."""
  untrusted_ns = {'__name__': '__main__', '__builtins__': builtins}
  code = compile(prompt + completion, '<completion>', 'exec', dont_inherit=True, optimize=0)
  exec(code, untrusted_ns)
  function = dict.get(untrusted_ns, entry_point)
  if function is None or not callable(function):
    raise _Refused(f'{entry_point} is not defined by the completion')

  real_import = pristine['__import__']

  def trusted_import(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0:
      wanted = name if fromlist else name.partition('.')[0]
      if wanted in snapshot:
        return snapshot[wanted]
    return real_import(name, globals, locals, fromlist, level)

  test_builtins = dict(pristine)
  test_builtins['__import__'] = trusted_import
  test_ns = {'__name__': '__sandbox_test__', '__builtins__': test_builtins}
  try:  # helpers the tests use (e.g. encode_cyclic) come from the trusted prompt
    exec(compile(prompt, '<prompt>', 'exec', dont_inherit=True, optimize=0), test_ns)
  except SyntaxError:
    for key, value in list(dict.items(untrusted_ns)):
      if _type(key) is _str and not key.startswith('__') and key != 'check':
        test_ns[key] = value
  calls = [0]

  def candidate(*args, **kwargs):
    calls[0] += 1
    result = function(*args, **kwargs)
    if strict:
      _assert_plain(result)
    return result

  test_ns[entry_point] = candidate  # some tests call the function by its own name
  exec(compile(test, '<test>', 'exec', dont_inherit=True, optimize=0), test_ns)
  check = test_ns.get('check')
  if _type(check) is not types.FunctionType or check.__code__.co_filename != '<test>':
    raise _Refused('the test text defines no check()')
  check(candidate)
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
  _write(result_fd, b'started\n')  # before any untrusted code: absent means a sandbox fault
  data = _read_payload(payload_fd)
  sentinel, _, data = data.partition(b'\n')
  kind, strict, native, prompt, completion, test, entry_point = _decode_fields(data)
  del data

  trusted_modules = tuple(_imported_modules(prompt + '\n' + test))
  for name in _PRELOAD + trusted_modules:
    try:
      __import__(name)
    except Exception:  # a missing or broken module fails the test later, in the open
      pass
  pristine = dict(builtins.__dict__)
  snapshot = _private_modules(trusted_modules, pristine)
  real_streams = (sys.stdout, sys.stderr)
  if not allow_subprocesses:
    for name in ('signal', '_signal'):
      sys.modules.pop(name, None)
  native_files = _native_files(native)
  _guard_builtin_modules(_blocked_modules(allow_subprocesses))
  # Later imports compile from source: loading .pyc needs marshal.loads, which is refused.
  sys.pycache_prefix = '/nonexistent-pycache'
  sys.addaudithook(_make_guard(allow_subprocesses, native_files))

  try:
    if kind == 'humaneval':
      _run_humaneval(prompt, completion, test, entry_point, strict == '1', snapshot, pristine)
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
