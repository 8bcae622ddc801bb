"""XLA settings every o1jax process needs, applied when o1jax is imported (JAX's CPU client
reads XLA_FLAGS once, when it is created).

Batch-invariant CPU programs. XLA:CPU hands some fused computations to YNNPACK
(`__ynn_fusion`, on by default in jaxlib 0.10-0.11), whose elementwise and reduction
fusions split the work by the whole array's size: a row's RMSNorm (its mean of squares and
the scaling fused together) came out differently beside other rows. Measured on the
embedded model, the same 830-token prompt prefilled alone and beside 3 others: last logits
4.2e-5 apart (f32 matmuls), 1.2e-2 (int8, whose activation rounding amplifies it); a
prompt prefilled past a shared prefix differed from the whole prompt the same way. With
only YNNPACK's matrix-product fusions kept, XLA's own loop emitter gives every row the
same sums however many rows a call has: the paged cache's prefill, batch composition and
shared prompt prefixes give bit-identical logits (tests/o1jax/test_xla_flags.py). (The
contiguous cache's attention, one product over the whole row, still sums by the batch's
size: 4.4e-5 in f32; turning off YNNPACK's products too fixes that but cost ~8% of
batch-1 decoding here: `scripts/bench_engine.py`, int8 + bf16 KV, 64 tokens, generated
tok/s at concurrency 1 in alternating runs: default 173.9-181.0 (5 runs), products kept
177.3-183.6 (2), none 151.7-180.6 (5); concurrency 32 the same within noise.)

An unknown flag in XLA_FLAGS aborts the process, so the flag is added only for the jaxlib
versions known to have it, and never over a value the user set.
"""

from __future__ import annotations

import logging
import os

YNN_PRODUCTS_ONLY = "--xla_cpu_experimental_ynn_fusion_type=dot"  # products only
# jaxlib (major, minor) versions whose XLA has the flag and the value (checked: 0.10.2,
# 0.11.2; an unknown value aborts too).
YNN_FLAG_VERSIONS = ((0, 10), (0, 11))


def _jaxlib_version() -> tuple[int, int] | None:
  from importlib import metadata
  try:
    major, minor = metadata.version("jaxlib").split(".")[:2]
    return int(major), int(minor)
  except (metadata.PackageNotFoundError, ValueError):
    return None


def batch_invariant_cpu_flags() -> bool:
  """Adds YNN_PRODUCTS_ONLY to XLA_FLAGS (see the module doc). Returns whether the flag is
  in effect for programs compiled from now on: False where this jaxlib does not know it,
  where the user chose a YNN fusion type, or where JAX's CPU client already exists."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_cpu_experimental_ynn_fusion_type" in flags:
    return YNN_PRODUCTS_ONLY in flags.split()
  if _jaxlib_version() not in YNN_FLAG_VERSIONS:
    return False
  os.environ["XLA_FLAGS"] = f"{flags} {YNN_PRODUCTS_ONLY}".strip()
  from jax._src import xla_bridge
  if getattr(xla_bridge, "_backends", None):
    logging.getLogger(__name__).warning(
        "JAX's backends were created before o1jax was imported: XLA_FLAGS %s applies only to "
        "new processes (import o1jax before running JAX computations)", YNN_PRODUCTS_ONLY)
    return False
  return True
