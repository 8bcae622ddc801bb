"""PID 1 of a sandbox: builds the filesystem view, drops privileges, runs the worker.

Runs as `python -I -S -c <this source> <key=value>...` under `unshare`, so it must
import only the standard library and never the project. It is trusted code: no
model-generated code runs in this interpreter. It loads ctypes (for mount(2),
pivot_root(2), prctl(2)), which is why the untrusted program runs in a freshly
exec'd interpreter instead of a fork of this one: a process that has loaded
_ctypes gives pure Python arbitrary memory reads.

Protocol on the status fd (the host trusts only this channel for setup):
  `ready\n` once the sandbox is built, then `exit <code>\n` or `signal <n>\n` for
  the worker, or `error <message>\n` if setup failed.

The lifeline fd is the read end of a pipe whose write end only the host process
holds: end of file there means the host is gone (killed with the job that runs
it), and PID 1 exits at once, which ends every process of the sandbox.
"""
import ctypes
import os
import signal
import sys
import threading

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_REC = 16384
MS_RELATIME = 1 << 21
MNT_DETACH = 2

PR_SET_DUMPABLE = 4
PR_CAPBSET_DROP = 24
PR_SET_SECUREBITS = 28
PR_SET_NO_NEW_PRIVS = 38
# NOROOT, NO_SETUID_FIXUP, KEEP_CAPS, NO_CAP_AMBIENT_RAISE and their locks.
SECUREBITS_ALL_LOCKED = 0xFF

# statvfs f_flag bits map onto the MS_* flags a user namespace may not clear.
STATVFS_TO_MS = (
  (os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
  (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME),
  (os.ST_RELATIME, MS_RELATIME),
)
PIVOT_ROOT_SYSCALL = {'x86_64': 155, 'aarch64': 41, 'riscv64': 41, 'ppc64le': 203, 's390x': 217}
DEVICES = ('null', 'zero', 'full', 'random', 'urandom')
ETC_FILES = ('ld.so.cache', 'ld.so.conf', 'localtime')

libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                       ctypes.c_char_p)
libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)
libc.prctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                       ctypes.c_ulong)


def check(ret, what):
  if ret != 0:
    err = ctypes.get_errno()
    raise OSError(err, f'{what}: {os.strerror(err)}')


def mount(source, target, fstype, flags, data=None):
  enc = lambda s: None if s is None else os.fsencode(s)
  check(libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)),
        f'mount {source} on {target}')


def locked_flags(path):
  """Flags a remount must keep: inside a user namespace the kernel refuses to clear them."""
  flags = os.statvfs(path).f_flag
  return sum(ms for st, ms in STATVFS_TO_MS if flags & st)


def bind(source, target, rdonly=True):
  mount(source, target, None, MS_BIND | MS_REC)
  if rdonly:
    mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | locked_flags(target))


def mount_points_under(root):
  """Mount points at or below root, parents first (from /proc/self/mountinfo)."""
  points = []
  with open('/proc/self/mountinfo', 'rb') as f:
    for line in f:
      raw = line.split(b' ')[4]
      # mountinfo escapes space, tab, newline and backslash as \ooo.
      path = os.fsdecode(raw.replace(b'\\040', b' ').replace(b'\\011', b'\t')
                         .replace(b'\\012', b'\n').replace(b'\\134', b'\\'))
      if path == root or path.startswith(root + '/'):
        points.append(path)
  return points


def touch(path):
  with open(path, 'w'):
    pass


def inside(path, tree):
  return path == tree or path.startswith(tree.rstrip('/') + '/')


def build_root(cfg):
  """Whitelist view: system dirs and the interpreter read-only, a private /tmp, nothing else.

  Of the Python extension modules only the allowed ones of the interpreter's own
  directory exist (`masked`, `native_dir`, `native_files`).
  """
  root = cfg['root']
  mount('tmpfs', root, 'tmpfs', MS_NOSUID | MS_NODEV, 'size=1m,mode=0755')
  bound = []
  for tree in cfg['system_trees']:
    if os.path.islink(tree):
      os.symlink(os.readlink(tree), root + tree)
    elif os.path.isdir(tree):
      os.mkdir(root + tree)
      bind(tree, root + tree)
      bound.append(tree)
  for tree in cfg['ro_trees']:
    if any(inside(tree, b) for b in bound) or not os.path.isdir(tree):
      continue
    os.makedirs(root + tree, exist_ok=True)
    bind(tree, root + tree)
    bound.append(tree)

  etc = root + '/etc'
  os.mkdir(etc)
  for name in ETC_FILES:
    host = '/etc/' + name
    if os.path.isfile(host):
      touch(f'{etc}/{name}')
      bind(host, f'{etc}/{name}')
  with open(etc + '/passwd', 'w') as f:
    f.write('root:x:0:0:root:/tmp:/bin/false\nsandbox:x:%d:%d::/tmp:/bin/false\n'
            % (cfg['uid'], cfg['gid']))
  with open(etc + '/group', 'w') as f:
    f.write('root:x:0:\nsandbox:x:%d:\n' % cfg['gid'])
  with open(etc + '/hosts', 'w') as f:
    f.write('127.0.0.1 localhost\n')

  os.mkdir(root + '/dev')
  mount('tmpfs', root + '/dev', 'tmpfs', MS_NOSUID | MS_NOEXEC, 'size=64k,mode=0755')
  for name in DEVICES:
    touch(f'{root}/dev/{name}')
    bind('/dev/' + name, f'{root}/dev/{name}', rdonly=False)

  # Hidden paths that would show through a bound tree get an empty read-only mask.
  for hidden in cfg['hidden']:
    if not any(inside(hidden, b) and hidden != b for b in bound):
      continue
    if any(inside(b, hidden) for b in bound):
      continue  # the interpreter lives there; only the interpreter tree is visible
    target = root + hidden
    if os.path.isdir(target) and not os.path.islink(target):
      mount('tmpfs', target, 'tmpfs', MS_NOSUID | MS_NODEV | MS_NOEXEC, 'size=4k,mode=0555')
    elif os.path.isfile(target) and not os.path.islink(target):
      bind('/dev/null', target)

  # Native code: other extension directories are empty, and the interpreter's own holds
  # only the allowed modules, so a refused module is not there under any name or path.
  for masked in cfg['masked']:
    target = root + masked
    if any(inside(masked, b) for b in bound) and os.path.isdir(target) \
        and not os.path.islink(target):
      mount('tmpfs', target, 'tmpfs', MS_NOSUID | MS_NODEV | MS_NOEXEC, 'size=4k,mode=0555')
  native_dir = cfg['native_dir']
  if native_dir and os.path.isdir(root + native_dir):
    target = root + native_dir
    mount('tmpfs', target, 'tmpfs', MS_NOSUID | MS_NODEV | MS_NOEXEC, 'size=64k,mode=0755')
    for name in cfg['native_files']:
      touch(f'{target}/{name}')
      bind(f'{native_dir}/{name}', f'{target}/{name}')

  os.mkdir(root + '/tmp')
  owner = '' if cfg['userns'] else ',uid=%d,gid=%d' % (cfg['uid'], cfg['gid'])
  mount('tmpfs', root + '/tmp', 'tmpfs', MS_NOSUID | MS_NODEV | MS_NOEXEC,
        'size=%d,mode=0700%s' % (cfg['tmp_bytes'], owner))

  # Everything except /tmp and the device binds becomes read-only, submounts included.
  writable = (root + '/tmp', root + '/dev')
  for point in mount_points_under(root):
    if any(inside(point, w) for w in writable) and point != root + '/dev':
      continue
    mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | locked_flags(point))

  os.chdir(root)
  nr = PIVOT_ROOT_SYSCALL.get(os.uname().machine)
  if nr is not None:
    check(libc.syscall(nr, b'.', b'.'), 'pivot_root')
    check(libc.umount2(b'.', MNT_DETACH), 'umount old root')
  else:
    os.chroot('.')
  os.chdir('/tmp')


def drop_privileges(cfg):
  """Root on the host becomes a throwaway uid; root of a user namespace loses every capability."""
  last_cap = cfg['last_cap']
  if cfg['userns']:
    check(libc.prctl(PR_SET_SECUREBITS, SECUREBITS_ALL_LOCKED, 0, 0, 0), 'securebits')
  for cap in range(last_cap + 1):
    check(libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), 'capbset drop')
  if cfg['userns']:
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    data = (ctypes.c_uint32 * 6)()
    check(libc.capset(header, data), 'capset')
  elif os.getuid() == 0:
    os.setgroups([])
    os.setresgid(cfg['gid'], cfg['gid'], cfg['gid'])
    os.setresuid(cfg['uid'], cfg['uid'], cfg['uid'])
  check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), 'no_new_privs')
  check(libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), 'dumpable')


def set_limits(cfg):
  import resource
  def limit(kind, soft, hard=None):
    resource.setrlimit(kind, (soft, soft if hard is None else hard))
  limit(resource.RLIMIT_AS, cfg['memory_bytes'])
  limit(resource.RLIMIT_CPU, cfg['cpu_seconds'], cfg['cpu_seconds'] + 1)
  limit(resource.RLIMIT_NPROC, cfg['max_processes'])
  limit(resource.RLIMIT_NOFILE, cfg['max_open_files'])
  limit(resource.RLIMIT_FSIZE, cfg['max_file_bytes'])
  limit(resource.RLIMIT_CORE, 0)


def parse_args(argv):
  cfg = {}
  for item in argv:
    key, _, value = item.partition('=')
    if key in ('system_trees', 'ro_trees', 'hidden', 'masked', 'native_files'):
      cfg[key] = [p for p in value.split('\n') if p]
    elif key in ('python', 'root', 'worker_src', 'native_dir'):
      cfg[key] = value
    else:
      cfg[key] = int(value)
  return cfg


def follow_host(lifeline_fd, worker_pid):
  """Exits PID 1 (and with it the whole sandbox) when the host process is gone."""
  while True:
    try:
      if not os.read(lifeline_fd, 64):
        break
    except InterruptedError:
      continue
    except OSError:
      break
  try:  # without a PID namespace (unsafe mode) the worker does not die with us
    os.kill(worker_pid, signal.SIGKILL)
  except OSError:
    pass
  os._exit(137)


def main():
  cfg = parse_args(sys.argv[1:])
  status_fd = cfg['status_fd']
  say = lambda text: os.write(status_fd, text.encode() + b'\n')
  try:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # kill(0, ...) from the program must not reach the host-side unshare process; the
    # host still kills PID 1 by pid, and --kill-child takes it down with unshare.
    if cfg['isolate']:
      os.setsid()
    if cfg['isolate']:
      build_root(cfg)
      drop_privileges(cfg)
    else:  # unsafe mode: the caller's own user, resource limits only
      check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), 'no_new_privs')
    if cfg['cpu'] >= 0:
      os.sched_setaffinity(0, {cfg['cpu']})
  except Exception as exc:
    say(f'error {type(exc).__name__}: {exc}'.replace('\n', ' '))
    os._exit(70)
  say('ready')
  argv = [cfg['python'], '-I', '-S', '-B', '-c', cfg['worker_src'],
          str(cfg['payload_fd']), str(cfg['result_fd']), str(cfg['allow_subprocesses'])]
  env = {'PATH': '/usr/bin:/bin', 'LANG': 'C.UTF-8', 'HOME': '/tmp', 'TMPDIR': '/tmp'}
  pid = os.fork()
  if pid == 0:
    try:
      os.close(status_fd)
      os.close(cfg['lifeline_fd'])
      for fd in (cfg['payload_fd'], cfg['result_fd']):
        os.set_inheritable(fd, True)
      signal.signal(signal.SIGINT, signal.SIG_DFL)
      set_limits(cfg)
      os.execve(cfg['python'], argv, env)
    finally:
      os._exit(127)
  os.close(cfg['payload_fd'])
  os.close(cfg['result_fd'])
  threading.Thread(target=follow_host, args=(cfg['lifeline_fd'], pid), daemon=True).start()
  while True:  # as PID 1 we also reap whatever the worker orphans
    child, status = os.waitpid(-1, 0)
    if child == pid:
      break
  if os.WIFSIGNALED(status):
    say(f'signal {os.WTERMSIG(status)}')
  else:
    say(f'exit {os.WEXITSTATUS(status)}')
  os._exit(0)


main()
