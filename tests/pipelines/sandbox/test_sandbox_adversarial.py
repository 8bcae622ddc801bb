"""Adversarial battery: hostile completions must fail or time out and leave the host untouched.

The battery runs once per module (in parallel, on the sandbox's own pool) against the
small problem of `add_problem.py`.
"""
import json
import os
import pathlib
import secrets
import socket
import threading
import time

import pytest

from tests.pipelines.sandbox.add_problem import RIGHT, WRONG, program
from pipelines.sandbox import Sandbox, SandboxConfig, Status

WRONG_ON_ISCLOSE = '    return int(a + b)\n'  # passes everything but the math.isclose line
WRONG_ON_ABS = '    return a + b if a < 1 else 0\n'  # passes everything but the abs() line
TIMEOUT_S = 1.5
PATIENT_TIMEOUT_S = 20.0
SECRET_ENV = 'O1JAX_SANDBOX_TEST_SECRET'
PROJECT_DIR = pathlib.Path(__file__).resolve().parents[3]
SANDBOX_UIDS = range(1 << 28, (1 << 28) + (1 << 24))  # see Sandbox._command


class _CountingServer:
  """A TCP server on 127.0.0.1 that records every connection it accepts."""

  def __init__(self):
    self.sock = socket.create_server(('127.0.0.1', 0))
    self.sock.settimeout(0.2)
    self.port = self.sock.getsockname()[1]
    self.connections = 0
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._serve, daemon=True)
    self._thread.start()

  def _serve(self):
    while not self._stop.is_set():
      try:
        conn, _ = self.sock.accept()
      except (socket.timeout, OSError):
        continue
      self.connections += 1
      conn.close()

  def close(self):
    self._stop.set()
    self._thread.join()
    self.sock.close()


def _cases(host):
  """name -> (sandbox kind, program, acceptable statuses)."""
  fail, timeout = {Status.FAILED}, {Status.TIMED_OUT}
  canary, readme, store_file = host['canary'], host['project_readme'], host['store_file']
  marker = host['marker']
  return {
    # Resources.
    'fork_bomb_guarded': ('guarded', program(RIGHT, '''
      import os
      while True:
          os.fork()
      '''), fail),
    'fork_bomb': ('permissive', program(RIGHT, '''
      import os
      while True:
          try:
              os.fork()
          except OSError:
              pass
      '''), timeout),
    'infinite_loop': ('guarded', program(RIGHT, '''
      while True:
          pass
      '''), timeout),
    'busy_threads': ('guarded', program(RIGHT, '''
      import threading
      def spin():
          while True:
              pass
      for _ in range(16):
          threading.Thread(target=spin, daemon=True).start()
      spin()
      '''), timeout),
    'sleep_past_timeout': ('guarded', program(RIGHT, '''
      import time
      time.sleep(60)
      '''), timeout),
    'memory_bomb': ('guarded_patient', program(RIGHT, '''
      hoard = bytearray(8 << 30)
      '''), {Status.MEMORY_EXCEEDED}),
    'memory_growth': ('guarded_patient', program(RIGHT, '''
      hoard = []
      while True:
          hoard.append(bytearray(200 << 20))
      '''), {Status.MEMORY_EXCEEDED}),
    'huge_output': ('guarded', program(RIGHT, '''
      import sys
      while True:
          sys.stdout.write('x' * 65536)
      '''), fail),  # its output past 1 MiB dropped, the run ended at 64 MiB
    'big_file': ('guarded', program(RIGHT, '''
      with open('big.bin', 'wb') as f:
          f.write(b'0' * (64 << 20))
      '''), fail),
    'fill_tmp': ('guarded', program(RIGHT, '''
      for i in range(4):
          with open(f'part{i}.bin', 'wb') as f:
              f.write(b'0' * (15 << 20))
      '''), fail),
    'many_threads': ('guarded', program(RIGHT, '''
      import threading, time
      for _ in range(500):
          threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
      '''), fail),
    'many_files': ('guarded', program(RIGHT, '''
      handles = [open('/dev/null') for _ in range(10000)]
      '''), fail),
    # Filesystem and secrets.
    'write_canary': ('guarded', program(RIGHT, f'''
      with open({str(canary)!r}, 'w') as f:
          f.write('pwned')
      '''), fail),
    'delete_canary': ('guarded', program(RIGHT, f'''
      import os
      os.remove({str(canary)!r})
      '''), fail),
    'write_project_readme': ('guarded', program(RIGHT, f'''
      with open({str(readme)!r}, 'a') as f:
          f.write('pwned')
      '''), fail),
    'write_system_dirs': ('guarded', program(RIGHT, f'''
      with open('/usr/{marker}', 'w') as f:
          f.write('pwned')
      '''), fail),
    'write_etc': ('guarded', program(RIGHT, f'''
      with open('/etc/{marker}', 'w') as f:
          f.write('pwned')
      '''), fail),
    'read_shadow': ('guarded', program(RIGHT, '''
      print(open('/etc/shadow').read())
      '''), fail),
    'read_results_store': ('guarded', program(RIGHT, f'''
      print(open({str(store_file)!r}).read())
      '''), fail),
    'list_project': ('guarded', program(RIGHT, f'''
      import os
      print(os.listdir({str(PROJECT_DIR)!r}))
      '''), fail),
    'env_secret': ('guarded', program(RIGHT, f'''
      import os
      print(dict(os.environ))
      assert os.environ[{SECRET_ENV!r}]
      '''), fail),
    'proc_environ': ('guarded', program(RIGHT, '''
      print(open('/proc/1/environ').read())
      '''), fail),
    'chroot_escape': ('guarded', program(RIGHT, '''
      import os
      os.chroot('/')
      '''), fail),
    # Network.
    'socket_localhost': ('guarded', program(RIGHT, f'''
      import socket
      socket.create_connection(('127.0.0.1', {host['port']}), timeout=1).sendall(b'x')
      '''), fail),
    'socket_localhost_permissive': ('permissive', program(RIGHT, f'''
      import socket
      socket.create_connection(('127.0.0.1', {host['port']}), timeout=1).sendall(b'x')
      '''), fail),
    # Processes.
    'subprocess_shell': ('guarded', program(RIGHT, f'''
      import subprocess
      subprocess.run('echo pwned > {canary}', shell=True, check=True)
      '''), fail),
    'subprocess_shell_permissive': ('permissive', program(RIGHT, f'''
      import subprocess
      subprocess.run('echo pwned > {canary}', shell=True, check=True)
      '''), fail),
    'os_system': ('guarded', program(RIGHT, '''
      import os
      assert os.system('true') == 0
      '''), fail),
    'background_process': ('permissive', program(RIGHT, f'''
      import subprocess
      subprocess.Popen(['sleep', '{marker}1'], start_new_session=True)
      while True:
          pass
      '''), timeout),
    'setsid_daemon': ('permissive', program(WRONG, f'''
      import os
      if os.fork() == 0:
          os.setsid()
          if os.fork() == 0:
              os.execv('/bin/sleep', ['sleep', '{marker}2'])
          os._exit(0)
      '''), fail),
    'kill_parent': ('guarded', program(WRONG, '''
      import os
      os.kill(os.getppid(), 9)
      '''), fail),
    'kill_everything': ('guarded', program(WRONG, '''
      import os
      os.kill(-1, 9)
      '''), fail),
    'kill_process_group': ('guarded', program(WRONG, '''
      import os
      os.kill(0, 9)
      '''), {Status.FAILED, Status.CRASHED}),
    'ctypes_call': ('guarded', program(RIGHT, '''
      import ctypes
      ctypes.CDLL(None).system(b'true')
      '''), fail),
    # Fake passes.
    'sys_exit_before_tests': ('guarded', program(WRONG, '''
      import sys
      sys.exit(0)
      '''), fail),
    'os_exit_before_tests': ('guarded', program(WRONG, '''
      import os
      os._exit(0)
      '''), fail),
    'raise_systemexit_in_tests': ('guarded', program('    raise SystemExit(0)\n'), fail),
    'redefine_check': ('guarded', program(WRONG, '''
      def check(candidate):
          pass
      '''), fail),
    'always_equal': ('guarded', program('    return AlwaysEqual()\n', '''
      class AlwaysEqual:
          def __eq__(self, other):
              return True
          def __sub__(self, other):
              return 0
      '''), fail),
    'lying_int': ('guarded', program('    return Liar(0)\n', '''
      class Liar(int):
          def __eq__(self, other):
              return True
      '''), fail),
    'patch_builtins': ('guarded', program(WRONG_ON_ABS, '''
      import builtins
      builtins.abs = lambda x: 0
      builtins.AssertionError = type('Ignored', (Exception,), {})
      '''), fail),
    'patch_math_module': ('guarded', program(WRONG_ON_ISCLOSE, '''
      import math
      math.isclose = lambda *args, **kwargs: True
      '''), fail),
    'swap_sys_modules': ('guarded', program(WRONG_ON_ISCLOSE, '''
      import sys, types
      fake = types.ModuleType('math')
      fake.isclose = lambda *args, **kwargs: True
      sys.modules['math'] = fake
      '''), fail),
    'guessed_sentinel': ('guarded', program(WRONG, '''
      import os
      guess = b'pass ' + b'0' * 32 + b'\\n'
      for fd in range(1, 256):
          try:
              os.write(fd, guess)
          except OSError:
              pass
      '''), fail),
    'frame_walk': ('guarded', program(WRONG, '''
      import os, sys
      frame = sys._getframe()
      while frame is not None:
          for value in list(frame.f_locals.values()):
              if isinstance(value, bytes) and len(value) == 32:
                  for fd in range(1, 64):
                      try:
                          os.write(fd, b'pass ' + value + b'\\n')
                      except OSError:
                          pass
          frame = frame.f_back
      '''), fail),
    'traceback_frames': ('guarded', program(WRONG, '''
      try:
          1 / 0
      except ZeroDivisionError as error:
          stolen = error.__traceback__.tb_frame.f_back.f_locals
      '''), fail),
    'gc_scan': ('guarded', program(WRONG, '''
      import gc
      found = [o for o in gc.get_objects() if isinstance(o, dict)]
      '''), fail),
    'settrace': ('guarded', program(WRONG, '''
      import sys
      sys.settrace(lambda frame, event, arg: None)
      '''), fail),
    'signal_handler_frames': ('guarded', program(WRONG, '''
      import signal
      signal.signal(signal.SIGALRM, lambda signum, frame: frame)
      '''), fail),
    'crafted_code_object': ('guarded', program(WRONG, '''
      code = (lambda: 0).__code__.replace(co_code=b'\\x00\\x00')
      '''), fail),
    'extra_audit_hook': ('guarded', program(WRONG, '''
      import sys
      sys.addaudithook(lambda event, args: print('HOOKED', event, flush=True))
      import json
      '''), fail),
    # Controls: correct code next to hostile neighbours still passes, wrong code fails.
    'control_right_1': ('guarded', program(RIGHT), {Status.PASSED}),
    'control_right_2': ('permissive', program(RIGHT), {Status.PASSED}),
    'control_wrong': ('guarded', program(WRONG), fail),
  }


@pytest.fixture(scope='module')
def battery(tmp_path_factory):
  base = tmp_path_factory.mktemp('sandbox_host')
  canary = base / 'README.md'  # stands in for the project's README
  canary.write_text('canary\n')
  store = base / 'results_store'
  store.mkdir()
  store_file = store / 'results.jsonl'
  secret = secrets.token_hex(16)
  store_file.write_text(json.dumps({'secret': secret}) + '\n')
  readme = PROJECT_DIR / 'README.md'
  readme_before = readme.read_bytes() if readme.exists() else None
  server = _CountingServer()
  os.environ[SECRET_ENV] = secret
  host = {'canary': canary, 'project_readme': readme, 'store_file': store_file,
          'port': server.port, 'marker': f'98{secrets.randbelow(10**6)}.5'}
  try:
    config = dict(timeout_s=TIMEOUT_S, hidden_paths=(str(store), str(PROJECT_DIR)), workers=2)
    # Memory cases get a long wall clock: the address-space limit must end them,
    # and on a loaded machine growing to 1 GiB can take longer than TIMEOUT_S.
    patient = dict(config, timeout_s=PATIENT_TIMEOUT_S)
    sandboxes = {'guarded': Sandbox(SandboxConfig(**config)),
                 'guarded_patient': Sandbox(SandboxConfig(**patient)),
                 'permissive': Sandbox(SandboxConfig(allow_subprocesses=True, **config))}
    cases = _cases(host)
    results = {}
    for kind, sandbox in sandboxes.items():
      names = [name for name, case in cases.items() if case[0] == kind]
      for name, result in zip(names, sandbox.run_many(cases[name][1] for name in names)):
        results[name] = result
  finally:
    del os.environ[SECRET_ENV]
    server.close()
  yield dict(host, cases=cases, results=results, secret=secret, server=server,
             canary_text=canary.read_text(), readme_before=readme_before,
             readme_after=readme.read_bytes() if readme.exists() else None)


def test_battery_has_at_least_25_hostile_completions(battery):
  hostile = [name for name in battery['cases'] if not name.startswith('control_')]
  assert len(hostile) >= 25


@pytest.mark.parametrize('name', sorted(_cases({
  'canary': '', 'project_readme': '', 'store_file': '', 'port': 0, 'marker': ''})))
def test_case_ends_as_expected(battery, name):
  result = battery['results'][name]
  expected = battery['cases'][name][2]
  assert result.status in expected, (result.status, result.detail, result.stderr_tail[-800:])
  assert result.isolated


def test_timeouts_are_prompt(battery):
  for name, result in battery['results'].items():
    if result.status is Status.TIMED_OUT:
      assert result.duration_s < TIMEOUT_S + 1.0, (name, result.duration_s)


def test_host_files_untouched(battery):
  assert battery['canary_text'] == 'canary\n'
  assert battery['readme_after'] == battery['readme_before']
  for directory in ('/usr', '/etc'):
    assert not os.path.exists(f'{directory}/{battery["marker"]}')


def test_no_secret_leaked(battery):
  for name, result in battery['results'].items():
    assert battery['secret'] not in result.stdout, name
    assert battery['secret'] not in result.stderr_tail, name
  assert 'root:' not in battery['results']['read_shadow'].stdout


def test_server_got_no_connection(battery):
  assert battery['server'].connections == 0
  for name in ('socket_localhost', 'socket_localhost_permissive'):
    assert 'unreachable' in battery['results'][name].detail.lower(), battery['results'][name]


def _host_processes():
  for entry in pathlib.Path('/proc').iterdir():
    if not entry.name.isdigit():
      continue
    try:
      cmdline = (entry / 'cmdline').read_bytes().replace(b'\0', b' ').decode(errors='replace')
      uid = int((entry / 'status').read_text().split('\nUid:')[1].split()[0])
      state = (entry / 'stat').read_text().rpartition(')')[2].split()[0]
    except (OSError, IndexError, ValueError):
      continue
    if state != 'Z':
      yield int(entry.name), uid, cmdline


def test_no_process_survives(battery):
  """No program of the battery is alive after it. The sandbox users are shared with other
  test files' programs (pytest-xdist runs one beside this one), which end within their
  own time limits (seconds): a process has to stay for 10 s to count as a survivor."""
  leftovers = lambda: [(pid, uid, cmd) for pid, uid, cmd in _host_processes()
                       if battery['marker'] in cmd or (os.geteuid() == 0 and uid in SANDBOX_UIDS)]
  deadline = time.monotonic() + 10
  while leftovers() and time.monotonic() < deadline:
    time.sleep(0.5)
  assert leftovers() == []


def test_blocked_operations_are_named(battery):
  """The refusals come from the sandbox layer they target, not from an unrelated error."""
  details = {name: battery['results'][name].detail for name in battery['results']}
  assert 'os.fork is disabled' in details['fork_bomb_guarded']
  assert 'import of ctypes is disabled' in details['ctypes_call']
  assert 'signal handlers are disabled' in details['signal_handler_frames']
  assert 'frame introspection' in details['frame_walk']
  assert 'frame introspection' in details['traceback_frames']
  assert 'not plain built-in data' in details['always_equal']
  assert 'not plain built-in data' in details['lying_int']
  assert 'AssertionError' in details['swap_sys_modules']
  assert 'AssertionError' in details['patch_builtins']
  assert 'SystemExit' in details['sys_exit_before_tests']
  assert 'output exceeded' in details['huge_output']  # after 64 MiB, dropped past 1 MiB
  assert 'File too large' in details['big_file']
  assert 'No space left' in details['fill_tmp']
  assert 'Read-only file system' in details['write_system_dirs']
  assert 'HOOKED' not in battery['results']['extra_audit_hook'].stdout  # CPython drops it silently
