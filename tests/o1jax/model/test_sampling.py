"""Sampling filters against hand-computed cases and empirical frequencies."""

import jax
import jax.numpy as jnp
import numpy as np

from o1jax.model.sampling import sample, sequence_key

LOGITS = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))  # probabilities chosen by hand


def _draw(n, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, logits=LOGITS):
  keys = jax.random.split(jax.random.PRNGKey(0), n)
  many = jnp.repeat(logits, n, axis=0)
  full = lambda v, dt: jnp.full((n,), v, dt)
  ids = sample(many, keys, full(temperature, jnp.float32), full(top_k, jnp.int32), full(top_p, jnp.float32),
               full(min_p, jnp.float32))
  return np.bincount(np.asarray(ids), minlength=logits.shape[-1]) / n


def test_greedy_rows_take_argmax_even_beside_sampled_rows():
  logits = jnp.array([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
  keys = jax.random.split(jax.random.PRNGKey(1), 2)
  ids = sample(logits, keys, jnp.array([0.0, 0.0]), jnp.zeros(2, jnp.int32), jnp.ones(2), jnp.zeros(2))
  assert np.asarray(ids).tolist() == [1, 0]
  mixed = sample(logits, keys, jnp.array([0.0, 5.0]), jnp.zeros(2, jnp.int32), jnp.ones(2), jnp.zeros(2))
  assert int(mixed[0]) == 1


def test_temperature_one_matches_probabilities():
  freq = _draw(20000)
  np.testing.assert_allclose(freq, [0.5, 0.3, 0.15, 0.05], atol=0.015)


def test_top_k_two_renormalises_over_two_tokens():
  # keep {0.5, 0.3} -> 0.625, 0.375
  np.testing.assert_allclose(_draw(20000, top_k=2), [0.625, 0.375, 0, 0], atol=0.015)


def test_top_p_keeps_smallest_prefix_reaching_p():
  # p = 0.7: mass before token 1 is 0.5 < 0.7 -> keep; before token 2 is 0.8 -> drop.
  np.testing.assert_allclose(_draw(20000, top_p=0.7), [0.625, 0.375, 0, 0], atol=0.015)


def test_min_p_drops_tokens_below_fraction_of_max():
  # min_p = 0.2: threshold 0.2 * 0.5 = 0.1 -> drop 0.05 only; renormalise over 0.95.
  np.testing.assert_allclose(_draw(20000, min_p=0.2), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0], atol=0.015)


def test_low_temperature_concentrates_on_argmax():
  assert _draw(2000, temperature=0.05)[0] > 0.99


def test_sequence_key_depends_on_request_and_sample_only():
  a = sequence_key(1, 5, 0)
  assert np.array_equal(np.asarray(a), np.asarray(sequence_key(1, 5, 0)))
  others = [sequence_key(2, 5, 0), sequence_key(1, 6, 0), sequence_key(1, 5, 1)]
  assert all(not np.array_equal(np.asarray(a), np.asarray(o)) for o in others)


def test_first_argmax_is_argmax_including_ties():
  from o1jax.model.sampling import first_argmax

  rng = np.random.default_rng(0)
  logits = rng.standard_normal((6, 300)).astype(np.float32)
  logits[1, [7, 40, 299]] = 9.0  # a three-way tie: the first index wins
  logits[2, :] = -np.inf
  logits[2, 5] = 0.0
  logits[3, :] = 1.0  # all equal
  got = np.asarray(jax.jit(first_argmax)(jnp.asarray(logits)))
  np.testing.assert_array_equal(got, np.argmax(logits, axis=-1))
  assert got[1] == 7 and got[3] == 0


def test_token_logprobs_without_alternatives_match_log_softmax():
  from o1jax.engine.steps import token_logprobs

  rng = np.random.default_rng(1)
  logits = jnp.asarray(rng.standard_normal((5, 1000)) * 4, jnp.float32)
  tokens = jnp.asarray(rng.integers(0, 1000, size=5), jnp.int32)
  chosen, ids, lps = jax.jit(token_logprobs, static_argnums=2)(logits, tokens, 0)
  want = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), tokens[:, None], -1)[:, 0]
  np.testing.assert_allclose(np.asarray(chosen), np.asarray(want), rtol=0, atol=1e-6)
  assert ids.shape == (5, 0) and lps.shape == (5, 0)
  with_top, _, top_lp = jax.jit(token_logprobs, static_argnums=2)(logits, tokens, 3)
  np.testing.assert_allclose(np.asarray(with_top), np.asarray(want), rtol=0, atol=1e-6)
  np.testing.assert_allclose(np.asarray(top_lp[:, 0]), np.asarray(jnp.max(jax.nn.log_softmax(logits, -1), -1)), atol=1e-6)
