"""Value types of the sandbox API: configuration, programs and results."""
from __future__ import annotations

import dataclasses
import enum
import math
import os


class Status(str, enum.Enum):
  """How one execution ended. Only PASSED counts as a pass; SANDBOX_ERROR is never the model's fault."""
  PASSED = 'passed'
  FAILED = 'failed'
  TIMED_OUT = 'timed_out'
  MEMORY_EXCEEDED = 'memory_exceeded'
  CRASHED = 'crashed'
  SANDBOX_ERROR = 'sandbox_error'


# The extension modules (lib-dynload) a program may load: computation, text, data
# formats, hashing, compression. Absent from the sandbox's file system and refused by
# the import policy: ctypes and cffi (raw memory), the _test* modules, subinterpreters,
# shared memory, process spawning (_posixsubprocess, unless allow_subprocesses),
# profilers, sqlite (loads shared libraries), terminal, GUI and system-database modules.
NATIVE_MODULES = (
  '_bisect', '_heapq', '_random', 'math', 'cmath', '_struct', 'array', 'binascii', '_json',
  '_datetime', '_decimal', '_statistics', '_contextvars', '_typing', '_zoneinfo', '_csv',
  '_pickle', '_queue', '_asyncio', 'select', '_socket', '_opcode', '_elementtree', 'pyexpat',
  'unicodedata', '_multibytecodec', '_codecs_cn', '_codecs_hk', '_codecs_iso2022', '_codecs_jp',
  '_codecs_kr', '_codecs_tw', '_md5', '_sha1', '_sha2', '_sha256', '_sha512', '_sha3', '_blake2',
  '_hashlib', 'zlib', '_bz2', '_lzma', '_uuid', 'fcntl', 'grp', 'resource',
)
SUBPROCESS_NATIVE_MODULES = ('_posixsubprocess',)
# Below ~16 MB of address space the sandboxed interpreter does not start, which the
# sandbox would report as missing isolation (measured: 8 MB fails, 16 MB runs HumanEval/0).
MIN_MEMORY_MB = 16
# Open files the sandboxed interpreter needs to start (measured: 6 runs a one-function
# program, 4 fails to load libpython); 8 leaves the harness room for its imports.
MIN_OPEN_FILES = 8
# A day per program: beyond it a limit is a typo, and far beyond it the waits and
# rlimits it sets overflow (1e300 s stopped every program with an OverflowError).
MAX_TIMEOUT_S = 86_400.0
RLIMIT_MAX = 2**63 - 1


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
  """Limits and isolation settings; the defaults suit HumanEval-style programs.

  timeout_s is the wall-clock limit. When both timeout_floor_s and timeout_factor
  are set and a reference time is passed to run(), the limit is EvalPlus-style:
  max(timeout_floor_s, timeout_factor * reference_time_s).
  """
  timeout_s: float = 3.0
  timeout_floor_s: float | None = None
  timeout_factor: float | None = None
  cpu_seconds: int | None = None  # default: the wall-clock limit rounded up, plus one
  memory_bytes: int = 1 << 30  # address space
  max_processes: int = 64  # processes and threads of the sandbox's uid
  max_open_files: int = 128
  max_file_bytes: int = 16 << 20  # largest file the program may write
  tmp_bytes: int = 32 << 20  # size of its private /tmp
  max_output_bytes: int = 1 << 20  # stdout kept; past it dropped, past 64x it the run ends
  stderr_tail_bytes: int = 4096
  workers: int | None = None  # run_many's pool size; default: number of usable CPUs
  pin_cpus: bool = True  # pin each execution to one CPU (best effort, see docs)
  # Paths the program must not see even where they sit under a system directory.
  # The host's working directory and $HOME are always hidden (see hide_cwd_and_home).
  hidden_paths: tuple[str, ...] = ()
  hide_cwd_and_home: bool = True
  allow_subprocesses: bool = False  # fork/exec from the program (still inside the sandbox)
  strict_return_types: bool = True  # candidate results must be plain built-in data
  python: str | None = None  # interpreter for the program; default: this one's base
  native_modules: tuple[str, ...] = NATIVE_MODULES  # see NATIVE_MODULES
  unsafe_no_isolation: bool = False  # run with only rlimits if namespaces are unavailable
  # A run that ends in SANDBOX_ERROR (the harness failed: the sandbox or the worker
  # interpreter did not start before the deadline on a loaded machine, a host error) has
  # no verdict and is run again, up to this many times: a program is then left out of
  # pass@k only when its sandbox failed every time.
  sandbox_error_retries: int = 2

  def __post_init__(self):
    # Checked here, for library callers too: a timeout <= 0 fails every program as timed
    # out (pass@1 = 0.0 that looks like a result); a NaN limit compares false everywhere.
    def positive(name, value, allow_none=False, most=math.inf):
      if value is None and allow_none:
        return
      if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
          or not math.isfinite(value):
        raise ValueError(f'SandboxConfig.{name}={value!r} must be a finite number > 0')
      if value > most:
        raise ValueError(f'SandboxConfig.{name}={value!r} must be <= {most:g} (a day)')
    positive('timeout_s', self.timeout_s, most=MAX_TIMEOUT_S)
    positive('timeout_floor_s', self.timeout_floor_s, allow_none=True, most=MAX_TIMEOUT_S)
    positive('timeout_factor', self.timeout_factor, allow_none=True)
    for name, low in (('cpu_seconds', 1), ('memory_bytes', MIN_MEMORY_MB << 20),
                      ('max_processes', 1), ('max_open_files', MIN_OPEN_FILES),
                      ('max_file_bytes', 0), ('tmp_bytes', 0), ('max_output_bytes', 1),
                      ('stderr_tail_bytes', 0), ('workers', 0), ('sandbox_error_retries', 0)):
      value = getattr(self, name)
      if value is None and name in ('cpu_seconds', 'workers'):
        continue
      if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f'SandboxConfig.{name}={value!r} must be an int >= {low}')
      if value > RLIMIT_MAX:  # setrlimit takes a C long
        raise ValueError(f'SandboxConfig.{name}={value!r} must be <= {RLIMIT_MAX}')
    # (a string was taken as a sequence of one-character names: hidden_paths='/usr/lib'
    # hid '/', 'u', 's', ... and the directory itself not at all)
    for name in ('hidden_paths', 'native_modules'):
      value = getattr(self, name)
      if isinstance(value, (str, bytes)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f'SandboxConfig.{name}={value!r} must be a tuple of strings')
    if self.python is not None and not (os.path.isfile(self.python)
                                        and os.access(self.python, os.X_OK)):
      raise ValueError(f'SandboxConfig.python={self.python!r} is not an executable file')

  def timeout_for(self, reference_time_s: float | None = None) -> float:
    if (reference_time_s is not None and self.timeout_floor_s is not None
        and self.timeout_factor is not None):
      return min(MAX_TIMEOUT_S, max(self.timeout_floor_s, self.timeout_factor * reference_time_s))
    return self.timeout_s

  def allowed_native_modules(self) -> tuple[str, ...]:
    extra = SUBPROCESS_NATIVE_MODULES if self.allow_subprocesses else ()
    return tuple(self.native_modules) + extra

  def cpu_limit_for(self, timeout_s: float) -> int:
    return self.cpu_seconds if self.cpu_seconds is not None else math.ceil(timeout_s) + 1


@dataclasses.dataclass(frozen=True)
class HumanEvalProgram:
  """prompt + completion is the untrusted module; test defines check(candidate)."""
  prompt: str
  completion: str
  test: str
  entry_point: str

  def __post_init__(self):
    for field in dataclasses.fields(self):  # (an encode failure had become a sandbox error)
      value = getattr(self, field.name)
      if not isinstance(value, str):
        raise TypeError(f'HumanEvalProgram.{field.name} must be a str, got '
                        f'{type(value).__name__}')


@dataclasses.dataclass(frozen=True)
class ExecutionResult:
  status: Status
  detail: str = ''  # why it was not a pass, in one line
  stdout: str = ''  # truncated
  stderr_tail: str = ''
  duration_s: float = 0.0
  isolated: bool = True  # False only under unsafe_no_isolation

  @property
  def passed(self) -> bool:
    return self.status is Status.PASSED
