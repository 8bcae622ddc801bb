"""Trusted harness that runs one untrusted program inside the sandbox.

Executed as `python -I -S -B -c <boot> <this source> <payload_fd> <result_fd> <allow_subprocesses>`
in a fresh interpreter, with globals that no module references, so that untrusted
code cannot reach (or patch) the harness's own functions and builtins.

Proof of a pass: the host sends a random sentinel on the payload pipe; it lives only
in a local of `main()` and is written to the result pipe after `check()` returned
normally, called the candidate, and every candidate result was plain data. Before
any untrusted code runs, an audit hook removes the ways Python code can look at
other frames or at raw memory (frames, tracebacks' frames, gc, ctypes, signal
handlers, tracing, crafted code objects), so the sentinel cannot be read early.
"""
import builtins
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
_PLAIN_SCALARS = (_type(None), bool, int, float, complex, str, bytes)
_PLAIN_CONTAINERS = (list, tuple, set, frozenset)
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
_BLOCKED_MODULES = frozenset({
  'ctypes', '_ctypes', '_testcapi', '_testinternalcapi', '_testbuffer',
  '_testmultiphase', '_testsinglephase', '_testclinic', '_xxsubinterpreters',
  '_xxinterpchannels', '_posixshmem',
})
# Signal handlers receive the interrupted frame; subprocess needs the module, so it is
# only allowed together with subprocesses (which weaken the guarantee anyway, see docs).
_SPAWN_MODULES = frozenset({'_posixsubprocess', 'signal', '_signal'})
# Modules the harness imports before the guard so the untrusted code need not.
_PRELOAD = ('typing',)


class _Refused(Exception):
  pass


def _make_guard(allow_subprocesses):
  """Audit hook; it cannot be removed, and it refuses any later hook."""
  blocked_modules = _BLOCKED_MODULES if allow_subprocesses else _BLOCKED_MODULES | _SPAWN_MODULES
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
      name = args[0]
      if _type(name) is not _str:
        raise ImportError('sandbox: module names must be str')
      if name.partition('.')[0] in blocked_modules:
        raise ImportError(f'sandbox: import of {name} is disabled')
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
    fields.append(data[newline + 1:newline + 1 + size].decode('utf-8'))
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


def _assert_plain(value):
  """Candidate results must be built-in data: an object with a forged __eq__ fails."""
  stack, seen = [value], set()
  while stack:
    item = stack.pop()
    kind = _type(item)
    if kind in _PLAIN_SCALARS:
      continue
    if id(item) in seen:
      continue
    if kind in _PLAIN_CONTAINERS:
      seen.add(id(item))
      stack.extend(item)
    elif kind is dict:
      seen.add(id(item))
      stack.extend(item.keys())
      stack.extend(item.values())
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
  kind, strict, prompt, completion, test, entry_point = _decode_fields(data)
  del data

  for name in _PRELOAD + tuple(_imported_modules(prompt + '\n' + test)):
    try:
      __import__(name)
    except ImportError:
      pass
  snapshot = {name: _module_copy(sys.modules[name])
              for name in _imported_modules(prompt + '\n' + test) if name in sys.modules}
  pristine = dict(builtins.__dict__)
  real_streams = (sys.stdout, sys.stderr)
  if not allow_subprocesses:
    for name in ('signal', '_signal'):
      sys.modules.pop(name, None)
  # Later imports compile from source: loading .pyc needs marshal.loads, which is refused.
  sys.pycache_prefix = '/nonexistent-pycache'
  sys.addaudithook(_make_guard(allow_subprocesses))

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
