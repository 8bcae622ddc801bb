"""Time per call of `o1jax.model.sampling.sample` against a full-sort sampler, side by side.

  python scripts/bench_sampling.py [--rows 32] [--vocab 49152]

The baseline is the textbook way, and what `sample` did before: sort each row,
cut top-k / top-p / min-p on the sorted values, draw with `jax.random.categorical`.
`sample` reads each row's 256 largest values instead (`lax.top_k`), bisects for
the thresholds only when they lie past those, and draws by inverse CDF. Rows are
Zipf-like logits (a peaked head and a long tail, like a language model's), so the
settings below exercise each path; both samplers run jitted and warm. Prints ms
per call and the speed-up for every setting.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # (sibling modules)

from o1jax.model.sampling import sample  # noqa: E402
from script_args import count  # noqa: E402


def sort_sample(logits, keys, temperature, top_k, top_p, min_p):
  """The full-sort baseline (greedy rows take the argmax)."""
  v = logits.shape[-1]
  scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
  sorted_desc = -jnp.sort(-scaled, axis=-1)
  k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
  kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)
  keep = scaled >= kth
  probs = jax.nn.softmax(jnp.where(sorted_desc >= kth, sorted_desc, -jnp.inf), axis=-1)  # top-p in top-k
  before = jnp.cumsum(probs, axis=-1) - probs
  n_keep = jnp.maximum(jnp.sum(before < top_p[:, None], axis=-1), 1)
  keep &= scaled >= jnp.take_along_axis(sorted_desc, (n_keep - 1)[:, None], axis=-1)
  logp = jax.nn.log_softmax(scaled, axis=-1)
  keep &= logp >= jnp.max(logp, -1, keepdims=True) + jnp.log(jnp.maximum(min_p, 1e-30))[:, None]
  ids = jax.vmap(jax.random.categorical)(keys, jnp.where(keep, scaled, -jnp.inf))
  return jnp.where(temperature > 0, ids, jnp.argmax(logits, -1)).astype(jnp.int32)


def time_call(f, args, repeats: int) -> float:
  jax.block_until_ready(f(*args))
  best = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    best.append(time.perf_counter() - t0)
  return float(np.median(best))


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--rows", type=count(1), default=32)
  p.add_argument("--vocab", type=count(2), default=49152)
  p.add_argument("--repeats", type=count(1), default=10)
  a = p.parse_args(argv)
  rng = np.random.default_rng(0)
  base = -1.1 * np.log(np.arange(1, a.vocab + 1))
  logits = np.stack([base[rng.permutation(a.vocab)] + 0.3 * rng.standard_normal(a.vocab)
                     for _ in range(a.rows)]).astype(np.float32)
  logits = jnp.asarray(logits * 4.0)  # a peaked head: a few tokens hold most of the mass
  keys = jax.random.split(jax.random.PRNGKey(0), a.rows)
  settings = [("temperature 0.7, top-p 0.95", 0.7, 0, 0.95, 0.0),
              ("temperature 0.7, top-k 40", 0.7, 40, 1.0, 0.0),
              ("temperature 0.7, top-k 40, top-p 0.9", 0.7, 40, 0.9, 0.0),
              ("temperature 1.0 (no filter)", 1.0, 0, 1.0, 0.0),
              ("temperature 1.0, top-p 0.999", 1.0, 0, 0.999, 0.0),
              ("temperature 0.7, min-p 0.05", 0.7, 0, 1.0, 0.05),
              ("temperature 4.0, top-p 0.95 (cut past the 256)", 4.0, 0, 0.95, 0.0)]
  new, old = jax.jit(sample), jax.jit(sort_sample)
  print(f"rows {a.rows}, vocab {a.vocab}, {jax.devices()[0].platform}; ms per call (median)")
  print("| setting | sample | full sort | speed-up |\n|---|---|---|---|")
  for name, t, k, top_p, min_p in settings:
    full = lambda x, dt: jnp.full((a.rows,), x, dt)
    args = (logits, keys, full(t, jnp.float32), full(k, jnp.int32), full(top_p, jnp.float32),
            full(min_p, jnp.float32))
    t_new, t_old = time_call(new, args, a.repeats), time_call(old, args, a.repeats)
    print(f"| {name} | {t_new * 1e3:.1f} | {t_old * 1e3:.1f} | {t_old / t_new:.1f}x |", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
