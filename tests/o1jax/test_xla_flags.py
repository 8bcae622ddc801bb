"""Importing o1jax makes XLA:CPU programs batch-invariant (o1jax/xla_flags.py): a row's
result does not depend on the other rows of its call, nor on the call's length."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from o1jax import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A fused row reduction (RMSNorm's shape) on 1 vs 4 rows of 1024 x 576, and the tiny
# model's prefill of one prompt alone and beside three others, in a fresh process.
PROBE = textwrap.dedent("""
    import json, os, sys
    import o1jax
    import jax, jax.numpy as jnp, numpy as np
    from o1jax.checkpoint import load_checkpoint
    from o1jax.controller import build_decode_model
    from o1jax.model import Llama
    from o1jax.testing import tiny_config, write_hf_checkpoint
    rng = np.random.default_rng(0)
    x = jnp.asarray(np.abs(rng.standard_normal((4, 1024, 576))).astype(np.float32) + 0.1)
    rms = jax.jit(lambda v: v * jax.lax.rsqrt(jnp.mean(v * v, axis=-1, keepdims=True) + 1e-5))
    norm = float(np.abs(np.asarray(rms(x[:1]))[0] - np.asarray(rms(x))[0]).max())
    write_hf_checkpoint(sys.argv[1], tiny_config(d_model=576, ffn_dim=1536, max_context=1024))
    ck = load_checkpoint(sys.argv[1])
    dm = build_decode_model(Llama(ck.config, ck.params), {"cache": "paged", "block_size": 16})
    toks = rng.integers(3, 259, (4, 1024)).astype(np.int32)
    fwd = jax.jit(dm.forward)
    def last_logits(rows):
      out, _ = fwd(dm.params, dm.init_cache(rows, 1024), jnp.asarray(toks[:rows]),
                   jnp.zeros(rows, jnp.int32), jnp.full(rows, 1000, jnp.int32))
      return np.asarray(out)[0]
    prefill = float(np.abs(last_logits(1) - last_logits(4)).max())
    print(json.dumps(dict(flags=os.environ.get("XLA_FLAGS", ""), norm=norm, prefill=prefill)))
""")


def _probe(tmp_path, env):
  out = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "tiny")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-2000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_o1jax_makes_rows_independent_of_their_batch(tmp_path):
  if xla_flags._jaxlib_version() not in xla_flags.YNN_FLAG_VERSIONS:
    pytest.skip("this jaxlib does not have the flag")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  got = _probe(tmp_path, env)
  assert xla_flags.YNN_PRODUCTS_ONLY in got["flags"].split()
  assert got["norm"] == 0.0 and got["prefill"] == 0.0


def test_the_flag_is_not_added_over_the_users_choice_nor_for_unknown_jaxlibs(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_experimental_ynn_fusion_type=reduce")
  assert not xla_flags.batch_invariant_cpu_flags()
  assert os.environ["XLA_FLAGS"] == "--xla_cpu_experimental_ynn_fusion_type=reduce"
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
  monkeypatch.setattr(xla_flags, "_jaxlib_version", lambda: (0, 99))
  assert not xla_flags.batch_invariant_cpu_flags()  # an unknown flag would abort XLA
  assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"


def test_in_this_process_the_flag_is_set():
  if xla_flags._jaxlib_version() not in xla_flags.YNN_FLAG_VERSIONS:
    pytest.skip("this jaxlib does not have the flag")
  assert xla_flags.YNN_PRODUCTS_ONLY in os.environ.get("XLA_FLAGS", "").split()
  np.testing.assert_equal(xla_flags.batch_invariant_cpu_flags(), True)
