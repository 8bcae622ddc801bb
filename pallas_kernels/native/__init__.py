"""Native CPU kernels (C++ through XLA's FFI), built on first use.

XLA's CPU backend lacks a fast gather, so the paged decode attention reads the
KV pages in place in `paged_decode_attention.cc` instead of copying each row's
pages out first; `int8_matmul.cc` multiplies 4-/8-bit weights by activations
quantized to two int8 levels, with exact VNNI / AMX integer dot products,
instead of streaming f32 weights (see `pallas_kernels.vnni_matmul`);
`f32_matmul.cc` multiplies f32 rows by f32 weights stored in column tiles, a
few rows for about the cost of one (XLA's CPU dot costs 2.3x from 8 rows on). The sources are compiled once per machine with the
system C++ compiler against the headers jaxlib ships (`jax.ffi.include_dir()`),
cached under $O1JAX_CACHE_DIR (default ~/.cache/o1jax) keyed by sources,
compiler flags, jaxlib version and CPU, and registered as FFI targets.
$O1JAX_NATIVE_ARCH_FLAGS replaces -march=native (another target CPU).

Everything degrades gracefully: no compiler, a failed build, a non-CPU
backend, or O1JAX_NATIVE_KERNELS=0 -> `available()` is False and callers keep
the XLA path (logged once, with the reason).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger(__name__)

_SOURCES = [pathlib.Path(__file__).with_name(name)
            for name in ("paged_decode_attention.cc", "int8_matmul.cc", "f32_matmul.cc")]
_HEADERS = [pathlib.Path(__file__).with_name("tile_runs.h")]
_TARGET = "o1jax_paged_decode_attention"
_WRITE_TARGET = "o1jax_write_pool_rows"
_INT8_MATMUL_TARGET = "o1jax_int8_matmul"
_F32_MATMUL_TARGET = "o1jax_f32_matmul"
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def _flags() -> list[str]:
  """Compiler flags: for this CPU (-march=native on x86), or the target that
  $O1JAX_NATIVE_ARCH_FLAGS names instead (e.g. "-march=haswell": the AVX2 build that
  CPUs without AVX-512 run, built and tested on one that has it)."""
  # (-mcpu=native elsewhere: what GCC and clang both take on aarch64.)
  native = "-march=native" if _X86 else "-mcpu=native"
  arch = os.environ.get("O1JAX_NATIVE_ARCH_FLAGS", native).split()
  wide = ["-mprefer-vector-width=512"] if _X86 else []
  return ["-O3", *arch, "-std=c++17", "-shared", "-fPIC", "-fopenmp-simd", *wide, "-w"]


def _cpu_signature() -> str:
  """CPU model + flags: -march=native code must not run on another CPU."""
  try:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith("flags"):
        return platform.machine() + line
  except OSError:
    pass
  return platform.machine() + platform.processor()


def _cache_dir() -> pathlib.Path:
  root = os.environ.get("O1JAX_CACHE_DIR") or os.path.join(pathlib.Path.home(), ".cache", "o1jax")
  return pathlib.Path(root) / "native"


def _build() -> pathlib.Path:
  """Compiles the kernel library (atomic rename: parallel workers may race). Returns its path."""
  compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
  if compiler is None:
    raise RuntimeError("no C++ compiler (g++/c++) on PATH")
  sources = b"\0".join(path.read_bytes() for path in _SOURCES + _HEADERS)
  flags = _flags()
  key = hashlib.sha256(b"\0".join([sources, " ".join(flags).encode(), compiler.encode(),
                                   jax.__version__.encode(), _cpu_signature().encode()]))
  out = _cache_dir() / f"libo1jax_native_{key.hexdigest()[:16]}.so"
  if out.exists():
    return out
  out.parent.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
    tmp_lib = pathlib.Path(tmp) / out.name
    cmd = [compiler, *flags, f"-I{jax.ffi.include_dir()}", *map(str, _SOURCES), "-o",
           str(tmp_lib)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
      names = ", ".join(path.name for path in _SOURCES)
      raise RuntimeError(f"compiling {names} failed:\n{proc.stderr[-2000:]}")
    os.replace(tmp_lib, out)
  log.info("native kernels: built %s", out)
  return out


@functools.cache
def _load() -> str | None:
  """Builds and registers the FFI target once. Returns None if ready, else why not."""
  global _int8_matmul_built, _f32_matmul_built
  if os.environ.get("O1JAX_NATIVE_KERNELS", "1") == "0":
    return "disabled by O1JAX_NATIVE_KERNELS=0"
  if jax.default_backend() != "cpu":
    return f"default backend is {jax.default_backend()}, not cpu"
  try:
    lib = ctypes.cdll.LoadLibrary(str(_build()))
    jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.O1jaxPagedDecodeAttention),
                                platform="cpu")
    jax.ffi.register_ffi_target(_WRITE_TARGET, jax.ffi.pycapsule(lib.O1jaxWritePoolRows),
                                platform="cpu")
    jax.ffi.register_ffi_target(_INT8_MATMUL_TARGET, jax.ffi.pycapsule(lib.O1jaxInt8Matmul),
                                platform="cpu")
    jax.ffi.register_ffi_target(_F32_MATMUL_TARGET, jax.ffi.pycapsule(lib.O1jaxF32Matmul),
                                platform="cpu")
    _int8_matmul_built = INT8_MATMUL_BUILDS[lib.O1jaxInt8MatmulSupported()]
    _f32_matmul_built = F32_MATMUL_BUILDS[lib.O1jaxF32MatmulSupported()]
  except (OSError, RuntimeError, subprocess.SubprocessError) as e:
    log.warning("native kernels unavailable, using the XLA path: %s", e)
    return str(e)
  return None


# What int8_matmul.cc's O1jaxInt8MatmulSupported() reports (AMX is chosen per call).
INT8_MATMUL_BUILDS = (None, "avx512_vnni", "avx2")
_int8_matmul_built = None  # set by _load (None: neither in the build)
# What f32_matmul.cc's O1jaxF32MatmulSupported() reports: the instructions it was built for.
F32_MATMUL_BUILDS = (None, "avx512", "avx2", "portable")
_f32_matmul_built = None  # set by _load (None: no fused multiply-add in the build)


# KV pool element types the native paged decode attention reads.
POOL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def available() -> bool:
  """True when the native CPU kernels are built and registered."""
  return _load() is None


def unavailable_reason() -> str | None:
  return _load()


def paged_decode_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                           block_tables: jax.Array, lengths: jax.Array,
                           sliding_window: int | None = None) -> jax.Array:
  """One query per row against its paged f32 keys/values, read in place.

  q [B, H, D] f32; k_pages, v_pages [NB, BS, KVH, D] f32 or bf16 (read as they
  are stored, widened to f32 in the kernel); block_tables [B, MB]
  int32; lengths [B] int32 (keys 0..lengths[b]-1 visible; 0 -> zeros; capped at
  MB * BS; table entries are clipped to [0, NB)); sliding_window w: only the last w
  of them (only their pages are read). Returns [B, H, D] f32.
  Same math as `pallas_kernels.paged_attention.paged_decode_attention_reference`
  (to f32 rounding); `pallas_kernels.ops` chooses between them."""
  if not available():
    raise RuntimeError(f"native paged_decode_attention unavailable: {unavailable_reason()}")
  b, h, d = q.shape
  nb, bs, kvh, dk = k_pages.shape
  if (dk != d or h % kvh or v_pages.shape != k_pages.shape or block_tables.ndim != 2
      or block_tables.shape[0] != b or lengths.shape != (b,)):
    raise ValueError(f"paged_decode_attention (native): q{q.shape}, k_pages{k_pages.shape}, "
                     f"v_pages{v_pages.shape}, block_tables{block_tables.shape}, "
                     f"lengths{lengths.shape} are inconsistent")
  if k_pages.dtype not in POOL_DTYPES or v_pages.dtype != k_pages.dtype:
    raise ValueError(f"paged_decode_attention (native): pools are {k_pages.dtype} / "
                     f"{v_pages.dtype}; both must be one of {[str(t) for t in POOL_DTYPES]}")
  if sliding_window is not None and sliding_window < 1:
    raise ValueError(f"paged_decode_attention (native): sliding_window={sliding_window} must "
                     f"be >= 1 or None")
  call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct((b, h, d), jnp.float32),
                          vmap_method="sequential")
  return call(q.astype(jnp.float32), k_pages, v_pages, block_tables.astype(jnp.int32),
              lengths.astype(jnp.int32), window=np.int64(sliding_window or 0))


def write_pool_rows(pool: jax.Array, rows: jax.Array, block: jax.Array,
                    offset: jax.Array) -> jax.Array:
  """pool.at[block, offset].set(rows, mode="drop"), updating the pool in place.

  pool [NB, BS, KVH, D]; rows [R, KVH, D] of the pool's dtype; block, offset [R]
  int32 (block outside [0, NB) drops the row). For bf16 pools: XLA's CPU
  scatter copies the whole pool twice (through f32) on every update."""
  if not available():
    raise RuntimeError(f"native write_pool_rows unavailable: {unavailable_reason()}")
  if (pool.ndim != 4 or rows.ndim != 3 or rows.shape[1:] != pool.shape[2:]
      or rows.dtype != pool.dtype or block.shape != (rows.shape[0],)
      or offset.shape != (rows.shape[0],)):
    raise ValueError(f"write_pool_rows (native): pool{pool.shape} {pool.dtype}, rows{rows.shape} "
                     f"{rows.dtype}, block{block.shape}, offset{offset.shape} are inconsistent")
  call = jax.ffi.ffi_call(_WRITE_TARGET, jax.ShapeDtypeStruct(pool.shape, pool.dtype),
                          input_output_aliases={0: 0}, vmap_method="sequential")
  return call(pool, rows, block.astype(jnp.int32), offset.astype(jnp.int32))


def int8_matmul_available() -> bool:
  """True when the native int8 matmul runs here (kernels built for AVX512-VNNI, or for
  AVX2 + FMA + F16C)."""
  return int8_matmul_build() is not None


def int8_matmul_build() -> str | None:
  """Which build of the int8 kernel runs here ("avx512_vnni", "avx2"; both give the same
  bits), None where none does."""
  return _int8_matmul_built if available() else None


def int8_matmul(x: jax.Array, packed: jax.Array, scale: jax.Array, minimum: jax.Array, *,
                bits: int, zero: int, has_min: bool, lut=None) -> jax.Array:
  """x f32 [M, K] times a weight in `pallas_kernels.vnni_matmul`'s tiled layout
  (packed uint8, scale / minimum f16 [Np/16, K/32, 16]; lut: the 16 stored values 4-bit
  indices stand for, or None) -> f32 [M, Np]."""
  if not int8_matmul_available():
    why = unavailable_reason() or "this CPU has neither AVX512-VNNI nor AVX2"
    raise RuntimeError(f"native int8_matmul unavailable: {why}")
  m, k = x.shape
  tiles, blocks, tile = scale.shape
  if (x.dtype != jnp.float32 or packed.dtype != jnp.uint8 or scale.dtype != jnp.float16
      or minimum.shape != scale.shape or minimum.dtype != jnp.float16 or tile != 16
      or blocks * 32 != k or packed.size * (2 if bits == 4 else 1) != k * tiles * tile):
    raise ValueError(f"int8_matmul (native): x{x.shape} {x.dtype}, packed{packed.shape} "
                     f"{packed.dtype}, scale{scale.shape} {scale.dtype}, minimum{minimum.shape} "
                     f"{minimum.dtype} (bits={bits}) are inconsistent")
  if lut is not None and (bits != 4 or len(lut) != 16):
    raise ValueError(f"int8_matmul (native): a lut needs bits=4 and 16 values, got bits={bits} "
                     f"and {len(lut)}")
  call = jax.ffi.ffi_call(_INT8_MATMUL_TARGET, jax.ShapeDtypeStruct((m, tiles * tile), jnp.float32),
                          vmap_method="sequential")
  table = jnp.asarray(np.asarray(lut if lut is not None else np.zeros(16), np.uint8))
  return call(x, packed, scale, minimum, table, bits=np.int64(bits), zero=np.int64(zero),
              has_min=bool(has_min), has_lut=lut is not None)


def f32_matmul_available() -> bool:
  """True when the native f32 matmul runs here (kernels built for a CPU with a fused
  multiply-add: AVX-512, AVX2 + FMA, aarch64)."""
  return f32_matmul_build() is not None


def f32_matmul_build() -> str | None:
  """Which build of the f32 kernel runs here ("avx512", "avx2", "portable"; all three
  give the same bits), None where none does."""
  return _f32_matmul_built if available() else None


def f32_matmul(x: jax.Array, tiles: jax.Array) -> jax.Array:
  """x f32 [M, K] times a weight in column tiles (`pallas_kernels.f32_matmul.pack`:
  f32 [T, K, 32]) -> f32 [M, 32 T] (`f32_matmul.cc`). Row m's result is the in-order
  f32 sum over k of x[m, k] w[k, n] (fused multiply-adds): it does not depend on the
  other rows."""
  if not f32_matmul_available():
    why = unavailable_reason() or "this CPU has no fused multiply-add"
    raise RuntimeError(f"native f32_matmul unavailable: {why}")
  if (x.ndim != 2 or tiles.ndim != 3 or tiles.shape[1:] != (x.shape[1], 32)
      or x.dtype != jnp.float32 or tiles.dtype != jnp.float32):
    raise ValueError(f"f32_matmul (native): x{x.shape} {x.dtype} and tiles{tiles.shape} "
                     f"{tiles.dtype} must be f32 [M, K] and [T, K, 32]")
  call = jax.ffi.ffi_call(_F32_MATMUL_TARGET,
                          jax.ShapeDtypeStruct((x.shape[0], tiles.shape[0] * 32), jnp.float32),
                          vmap_method="sequential")
  return call(x, tiles)
