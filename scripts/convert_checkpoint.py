"""Convert a checkpoint to an o1jax orbax checkpoint (or HF safetensors).

  python scripts/convert_checkpoint.py embedded /tmp/smollm2-orbax
  python scripts/convert_checkpoint.py model.gguf out_dir --format=safetensors

The copy is written into a hidden `.converting-PID` directory inside the destination and
its files moved up, the one that makes it a checkpoint last: a conversion stopped at any
point leaves no copy that loads with part of its files (a missing tokenizer_config.json
loaded as a tokenizer without BOS and chat template); the next conversion there removes
what a killed one staged. Prints how long loading the source
and the result take, side by side.
"""

from __future__ import annotations

import os
import signal
import sys

_CLEANUP: list = []  # what a stop removes: the partial copy, directories made for it
_TERMINAL = None  # the real stderr once a writer failed (`_writers_log`)

if __name__ == "__main__":  # before the imports below (~2 s)
  def _stopped(signum, frame):
    # (a KeyboardInterrupt raised while JAX starts lands in one of its gc callbacks,
    # where Python ignores it: the conversion went on and exited 0)
    for remove in reversed(_CLEANUP):
      remove()
    print(f"\nstopped by {signal.Signals(signum).name}: the destination is as it was",
          file=sys.stderr, flush=True)
    os._exit(128 + signum)

  signal.signal(signal.SIGINT, _stopped)
  signal.signal(signal.SIGTERM, _stopped)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import io  # noqa: E402
import pathlib  # noqa: E402
import shutil  # noqa: E402
import time  # noqa: E402

from o1jax.checkpoint import CheckpointError, load_checkpoint  # noqa: E402
from o1jax.checkpoint.errors import new_checkpoint_dir  # noqa: E402
from o1jax.checkpoint.orbax_io import save_orbax  # noqa: E402
from o1jax.checkpoint.safetensors_loader import save_safetensors  # noqa: E402


def _first_missing(path: pathlib.Path) -> pathlib.Path | None:
  """The outermost directory of `path` (itself included) that does not exist yet."""
  missing = None
  for p in (path, *path.parents):
    if p.exists():
      break
    missing = p
  return missing


# The files that make a directory a checkpoint for the loader: moved last.
_MARKERS = ("o1jax_model.json", "config.json")


def _move_up(staging: pathlib.Path, out: pathlib.Path) -> None:
  """Moves `staging`'s entries into `out` (its parent), the loader's marker file last: a
  stop midway leaves no directory that loads."""
  entries = sorted(staging.iterdir(), key=lambda p: p.name in _MARKERS)
  for entry in entries:
    os.replace(entry, out / entry.name)
  staging.rmdir()


def _remove_abandoned_staging(dst: pathlib.Path) -> None:
  """Staging directories of conversions killed with kill -9 (their process is gone): in
  the destination they made it "not empty" for every later conversion."""
  for staging in (dst.glob(".converting-*") if dst.is_dir() else ()):
    pid = staging.name.rsplit("-", 1)[1]
    if pid.isdigit() and not _alive(int(pid)):
      shutil.rmtree(staging, ignore_errors=True)


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # (someone else's)
    return True
  return True


@contextlib.contextmanager
def _writers_log():
  """Python's stderr into a buffer while a checkpoint is written. Orbax's threads log one
  write error (a full disk) as ~240 lines of tracebacks, before it reaches here as an
  exception and after, as they wind down. Written: the buffer goes to stderr. Failed:
  stderr stays a sink to the end of the process (`main` prints the one-line error to
  the real one)."""
  sys.stderr.flush()
  real, buffer = sys.stderr, io.StringIO()
  sys.stderr = buffer
  try:
    yield
  except Exception:
    global _TERMINAL
    _TERMINAL, sys.stderr = real, open(os.devnull, "w")
    raise
  except BaseException:  # Ctrl-C, an exit: said on the real stderr (it went to the sink)
    sys.stderr = real
    raise
  sys.stderr = real
  real.write(buffer.getvalue())


def convert(src: str, dst: str, fmt: str = "orbax") -> dict:
  if fmt not in ("orbax", "safetensors"):
    raise ValueError(f"--format={fmt!r}: expected orbax or safetensors")
  target = pathlib.Path(str(dst)).expanduser().absolute() if str(dst).strip() else None
  if target is not None:
    _remove_abandoned_staging(target)
  made = _first_missing(target) if target is not None else None
  out = new_checkpoint_dir(dst)  # its problems before the source is read (a large load)
  # (inside the destination: a mount point too, where a rename onto it fails)
  staging = out / f".converting-{os.getpid()}"

  def remove_once() -> bool:  # the destination as it was; whether anything was there
    if made is not None:
      there = made.exists()
      shutil.rmtree(made, ignore_errors=True)
      return there
    children = list(out.iterdir()) if out.is_dir() else []
    for child in children:
      if child.is_dir() and not child.is_symlink():
        shutil.rmtree(child, ignore_errors=True)
      else:
        child.unlink(missing_ok=True)
    return bool(children)

  def remove() -> None:  # the destination as it was: absent (with the parents made), or empty
    # Again until nothing comes back for a second (30 s at most): orbax's writes go on in
    # tensorstore's threads after its save has raised (a full disk: at its first failed
    # write) and made 20-odd files again after one removal.
    deadline, quiet = time.monotonic() + 30.0, 0
    while quiet < 4 and time.monotonic() < deadline:
      quiet = 0 if remove_once() else quiet + 1
      if quiet < 4:
        time.sleep(0.25)

  _CLEANUP.append(remove)
  try:
    t0 = time.perf_counter()
    ck = load_checkpoint(src)
    src_s = time.perf_counter() - t0
    try:
      with _writers_log():
        if fmt == "orbax":
          save_orbax(staging, ck.config, ck.params, ck.tokenizer)
        else:  # safetensors (the format was checked first)
          save_safetensors(staging, ck.config, ck.params)
          ck.tokenizer.save(staging)
      _move_up(staging, out)
    except CheckpointError:
      raise
    except Exception as e:  # a full disk, a read-only place: the writers' own errors
      raise CheckpointError(f"{out}: cannot write the checkpoint: {type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")) from e
    t0 = time.perf_counter()
    load_checkpoint(out)  # what was written loads (else it is removed: no broken copy stays)
    dst_s = time.perf_counter() - t0
  except BaseException:
    remove()
    raise
  finally:
    _CLEANUP.remove(remove)
  return {"source_format": ck.format, "source_load_s": src_s, "converted_load_s": dst_s}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("src", help="'embedded', a .gguf file, an HF or orbax directory")
  parser.add_argument("dst", help="output directory (must not exist or be empty)")
  parser.add_argument("--format", default="orbax", choices=("orbax", "safetensors"))
  args = parser.parse_args(argv)
  try:
    r = convert(args.src, args.dst, args.format)
  except (CheckpointError, ValueError) as e:
    print(f"error: {e}", file=_TERMINAL or sys.stderr)
    return 2
  print(f"load {r['source_format']} source: {r['source_load_s']:.2f} s; "
        f"load converted {args.format}: {r['converted_load_s']:.2f} s "
        f"({r['source_load_s'] / max(r['converted_load_s'], 1e-9):.1f}x)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
