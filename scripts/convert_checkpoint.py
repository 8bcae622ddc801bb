"""Convert a checkpoint to an o1jax orbax checkpoint (or HF safetensors).

  python scripts/convert_checkpoint.py embedded /tmp/smollm2-orbax
  python scripts/convert_checkpoint.py model.gguf out_dir --format=safetensors

Prints how long loading the source and the result take, side by side.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

from o1jax.checkpoint import CheckpointError, load_checkpoint
from o1jax.checkpoint.errors import new_checkpoint_dir
from o1jax.checkpoint.orbax_io import save_orbax
from o1jax.checkpoint.safetensors_loader import save_safetensors


def convert(src: str, dst: str, fmt: str = "orbax") -> dict:
  if fmt not in ("orbax", "safetensors"):
    raise ValueError(f"--format={fmt!r}: expected orbax or safetensors")
  existed = os.path.exists(dst)
  out = new_checkpoint_dir(dst)  # its problems before the source is read (a large load)
  try:
    t0 = time.perf_counter()
    ck = load_checkpoint(src)
    src_s = time.perf_counter() - t0
    if fmt == "orbax":
      save_orbax(dst, ck.config, ck.params, ck.tokenizer)
    else:  # safetensors (the format was checked first)
      save_safetensors(dst, ck.config, ck.params)
      ck.tokenizer.save(dst)
    t0 = time.perf_counter()
    load_checkpoint(dst)  # what was written loads (else it is removed: no broken copy stays)
    dst_s = time.perf_counter() - t0
  except BaseException:
    # The destination as it was (absent, or empty): a refused save left an empty directory
    # and a copy that did not load stayed, refused by every later load and rerun.
    if existed:
      for child in out.iterdir():
        shutil.rmtree(child) if child.is_dir() else child.unlink()
    else:
      shutil.rmtree(out, ignore_errors=True)
    raise
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
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"load {r['source_format']} source: {r['source_load_s']:.2f} s; "
        f"load converted {args.format}: {r['converted_load_s']:.2f} s "
        f"({r['source_load_s'] / max(r['converted_load_s'], 1e-9):.1f}x)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
