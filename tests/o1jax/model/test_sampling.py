"""Sampling filters against hand-computed cases and empirical frequencies."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from o1jax.model.sampling import SamplingParams, sample, sequence_key

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


def test_the_hottest_temperature_still_reads_the_logits_and_the_filters():
  """At the largest temperature the check lets through, logits of 3e38 and 1e38 still
  differ on the device (at 1e38, 1/t flushed to 0: uniform draws, filters off)."""
  from o1jax.model.sampling import MAX_TEMPERATURE
  huge = jnp.asarray([[3e38, 1e38, -jnp.inf, 0.0]], jnp.float32)
  scaled = np.asarray(huge[0, :2]) / MAX_TEMPERATURE  # 3e8, 1e8: all mass on token 0
  assert scaled[0] - scaled[1] > 100
  for filters in (dict(), dict(top_k=1), dict(top_p=0.5), dict(min_p=0.5)):
    np.testing.assert_array_equal(_draw(200, MAX_TEMPERATURE, logits=huge, **filters),
                                  [1.0, 0.0, 0.0, 0.0])
  with pytest.raises(ValueError, match="temperature must be 0"):
    SamplingParams(temperature=MAX_TEMPERATURE * 10)


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
  from o1jax.model.sampling import token_logprobs

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


# -- vocabularies larger than the candidates: every path of `sample` ------------------

def _kept_reference(scaled, top_k, top_p, min_p):
  """numpy: the kept mask of one row by a full sort, in transformers' order: top-k, then
  top-p on the top-k set's renormalized probabilities, then min-p."""
  order = np.argsort(-scaled, kind="stable")
  s = scaled[order]
  keep = np.ones_like(scaled, bool)
  if 0 < top_k < len(s):
    keep &= scaled >= s[top_k - 1]
  if top_p < 1.0:  # on the top-k set, renormalized (transformers' and vLLM's order)
    p = np.exp(s - s.max())
    if 0 < top_k < len(s):
      p = np.where(s >= s[top_k - 1], p, 0.0)
    p /= p.sum()
    before = np.cumsum(p) - p
    n_keep = max(int((before < top_p).sum()), 1)
    keep &= scaled >= s[n_keep - 1]
  if min_p > 0:
    logp = scaled - np.log(np.exp(scaled - scaled.max()).sum()) - scaled.max()
    keep &= logp >= logp.max() + np.log(min_p)
  return keep


# (top_k, top_p, min_p, temperature): inside the 256 candidates (top-k 40, peaked
# top-p), more kept than the candidates (pure temperature, min-p), and thresholds
# that lie past the candidates (top-k 400, top-p of a flat row): bisection.
# Top-k with top-p: inside the candidates (k 40 and k 50 with min-p) and past them (k 300).
CASES = [(40, 1.0, 0.0, 0.7), (0, 0.9, 0.0, 0.7), (0, 1.0, 0.0, 1.3), (0, 1.0, 0.001, 1.0),
         (400, 1.0, 0.0, 1.0), (0, 0.95, 0.0, 3.0), (300, 0.99, 0.0, 2.0), (40, 0.8, 0.0, 1.0),
         (50, 0.9, 0.005, 1.3)]


def _rows(n, vocab=1000, seed=3):
  rng = np.random.default_rng(seed)
  # Zipf-like: a peaked head and a long tail, so the cases above land where intended.
  base = -1.1 * np.log(np.arange(1, vocab + 1)) + 0.3 * rng.standard_normal(vocab)
  return np.stack([base[rng.permutation(vocab)] for _ in range(n)]).astype(np.float32)


def test_filter_threshold_keeps_exactly_the_reference_set():
  from o1jax.model.sampling import filter_threshold

  logits = _rows(len(CASES))
  k, p, m, t = (np.array(c) for c in zip(*CASES))
  cut = np.asarray(jax.jit(filter_threshold)(jnp.asarray(logits), jnp.asarray(t, jnp.float32),
                                             jnp.asarray(k, jnp.int32), jnp.asarray(p, jnp.float32),
                                             jnp.asarray(m, jnp.float32)))
  for i, (ki, pi, mi, ti) in enumerate(CASES):
    scaled = (logits[i] / np.float32(ti)).astype(np.float32)
    want = _kept_reference(scaled, ki, pi, mi)
    np.testing.assert_array_equal(scaled >= cut[i], want, err_msg=f"case {CASES[i]}")
  sizes = [int((logits[i] / np.float32(c[3]) >= cut[i]).sum()) for i, c in enumerate(CASES)]
  assert sizes[0] == 40 and sizes[2] == 1000 and sizes[4] == 400
  assert sizes[1] < 256 and sizes[5] > 256  # one top-p case on each side of the candidates


def test_every_path_draws_from_the_filtered_distribution():
  """Empirical frequencies of 20000 draws per case against the exact filtered
  softmax: nothing outside the kept set, and mass per rank decile within 0.015."""
  n = 20000
  logits = _rows(1)[0]
  for top_k, top_p, min_p, t in CASES:
    scaled = (logits / np.float32(t)).astype(np.float32)
    keep = _kept_reference(scaled, top_k, top_p, min_p)
    probs = np.where(keep, np.exp(scaled - scaled.max()), 0.0)
    probs /= probs.sum()
    keys = jax.random.split(jax.random.PRNGKey(7), n)
    full = lambda v, dt: jnp.full((n,), v, dt)
    ids = np.asarray(jax.jit(sample)(jnp.asarray(np.repeat(logits[None], n, 0)), keys,
                                     full(t, jnp.float32), full(top_k, jnp.int32),
                                     full(top_p, jnp.float32), full(min_p, jnp.float32)))
    assert keep[ids].all(), f"case {(top_k, top_p, min_p, t)} drew a filtered token"
    freq = np.bincount(ids, minlength=len(logits)) / n
    order = np.argsort(-probs)
    for chunk in np.array_split(order[:max(int(keep.sum()), 10)], 10):
      assert abs(freq[chunk].sum() - probs[chunk].sum()) < 0.015, (top_k, top_p, min_p, t)


def test_a_rows_token_does_not_depend_on_the_other_rows():
  """Rows of every path in one batch draw what each draws alone."""
  logits = jnp.asarray(_rows(len(CASES), seed=5))
  k, p, m, t = (np.array(c) for c in zip(*CASES))
  keys = jax.random.split(jax.random.PRNGKey(11), len(CASES))
  args = (jnp.asarray(t, jnp.float32), jnp.asarray(k, jnp.int32), jnp.asarray(p, jnp.float32),
          jnp.asarray(m, jnp.float32))
  f = jax.jit(sample)
  together = np.asarray(f(logits, keys, *args))
  alone = [int(f(logits[i:i + 1], keys[i:i + 1], *(a[i:i + 1] for a in args))[0])
           for i in range(len(CASES))]
  assert together.tolist() == alone


@pytest.mark.parametrize("fields, match", [
    (dict(temperature=float("nan")), r"^temperature must be finite, got nan$"),
    (dict(temperature=float("inf")), r"^temperature must be finite, got inf$"),
    (dict(temperature=True), r"^temperature must be a number, got True$"),
    # Below the draw's floor (1e-300 was greedy on the device, sampled for the host) and
    # past float32's range (inf on the device).
    (dict(temperature=1e-300), r"^temperature must be 0 \(greedy\) or in \[1e-06, 1e\+30\], got 1e-300$"),
    (dict(temperature=5e-7), r"^temperature must be 0 \(greedy\) or in \[1e-06, "),
    (dict(temperature=1e39), r"^temperature must be 0 \(greedy\) or in .*, got 1e\+39$"),
    # Past ~8.5e37, 1/t flushed to 0 on the device: every logit 0, filters off (NaN).
    (dict(temperature=1e38), r"^temperature must be 0 \(greedy\) or in .*, got 1e\+38$"),
    (dict(top_p=None), r"^top_p must be a number, got None$"),
    (dict(min_p="0.1"), r"^min_p must be a number, got '0.1'$"),
    (dict(top_k=5.0), r"^top_k must be an int in \[0, 2147483647\], got 5.0$"),
    (dict(top_k=2**31), r"^top_k must be an int in \[0, 2147483647\], got 2147483648$"),
    (dict(seed=2**63), r"^seed must be an int in \[-2\*\*63, 2\*\*63\), got 9223372036854775808$"),
    (dict(seed=-2**63 - 1), r"^seed must be an int in"),
    (dict(seed="3"), r"^seed must be an int in .*, got '3'$"),
])
def test_bad_sampling_params_name_the_field(fields, match):
  with pytest.raises(ValueError, match=match):
    SamplingParams(**fields)


def test_request_ids_use_64_bits_and_ids_below_2_32_keep_their_keys():
  """Int request ids were 32 bits (the pipelines hashed (example, sample) to 31): the
  samples of one example at n = 100,000 shared ~2 random streams. An id below 2**32 still
  folds in alone; a wider one folds a tag and both halves, apart from its low word, its
  halves as ids, and a str id."""
  from o1jax.model.sampling import key_id_words
  words = lambda rid: np.asarray(sequence_key(3, rid, 0))
  for rid in (0, 7, 2**32 - 1):
    old = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(3), rid), 0)
    assert np.array_equal(words(rid), np.asarray(old))
  wide = [2**32, 2**32 + 7, 7 * 2**32, 2**64 - 1, np.uint64(2**40 + 3)]
  keys = [words(r) for r in wide] + [words(r) for r in (0, 7, 1, 2**32 - 1, 3)] + [words("7")]
  assert len({k.tobytes() for k in keys}) == len(keys)
  assert key_id_words(2**40 + 3) == (key_id_words(2**40 + 3)[0], 2**8, 3)
  for bad in (2**64, -1, 1.0, True):
    with pytest.raises(ValueError, match=r"^request_id must be an int in \[0, 2\*\*64\), got "):
      sequence_key(0, bad, 0)


def test_every_seed_the_check_lets_through_makes_a_key():
  for seed in (-2**63, -1, 0, 2**32, 2**63 - 1, np.int64(7), np.uint32(7)):
    SamplingParams(seed=seed)
    assert sequence_key(seed, 0, 0).shape == (2,)
  assert SamplingParams(temperature=np.float32(0.5), top_k=np.int64(3), top_p=1).top_k == 3


def test_seeds_use_all_64_bits():
  """Seeds 2**32 apart (1 and 2**32 + 1, -1 and 2**32 - 1) drew the same samples: the
  key held the seed's low word only. Keys are PRNGKey's with x64 on ([high, low]); seeds
  in [0, 2**32) keep the keys they had."""
  from o1jax.model.sampling import seed_key
  pairs = [(1, 2**32 + 1), (-1, 2**32 - 1), (0, -2**63), (-2**31, 2**31)]
  for a, b in pairs:
    assert not np.array_equal(np.asarray(sequence_key(a, 0, 0)), np.asarray(sequence_key(b, 0, 0)))
  for seed in (0, 1, 2**31, 2**32 - 1):
    assert np.array_equal(np.asarray(seed_key(seed)), np.asarray(jax.random.PRNGKey(seed)))
  with jax.enable_x64(True):
    for seed in (-2**63, -1, 2**32 + 1, 2**63 - 1):
      assert np.array_equal(np.asarray(seed_key(seed)), np.asarray(jax.random.PRNGKey(seed)))


def test_inverse_cdf_picks_the_index_whose_cumulative_weight_passes_the_target():
  """The two-level draw against float64 running sums: the index i with
  cum[i - 1] <= u * total < cum[i] (a positive weight), up to f32 rounding at
  the boundary; rows of zero blocks, a ragged last block and u at 0 and near 1."""
  from o1jax.model.sampling import CDF_BLOCK, _inverse_cdf

  rng = np.random.default_rng(3)
  v = 3 * CDF_BLOCK + 37
  weights = rng.random((64, v)).astype(np.float32) ** 4
  weights[weights < 0.05] = 0.0  # zeros inside blocks
  weights[1, :2 * CDF_BLOCK] = 0.0  # leading empty blocks
  weights[2, CDF_BLOCK + 5:] = 0.0  # trailing empty blocks: the last positive is early
  weights[3] = 0.0
  weights[3, v - 1] = 2.0  # all mass on the ragged block's last index
  u = rng.random(64).astype(np.float32)
  u[:5] = [0.0, 0.0, 0.5, 0.3, np.nextafter(np.float32(1), np.float32(0))]
  ids = np.asarray(jax.jit(_inverse_cdf)(jnp.asarray(weights), jnp.asarray(u)))
  cum = np.cumsum(weights.astype(np.float64), axis=-1)
  for r in range(64):
    i, target = ids[r], float(u[r]) * cum[r, -1]
    assert weights[r, i] > 0, (r, i)
    tol = 1e-5 * cum[r, -1]
    below = cum[r, i - 1] if i else 0.0
    assert below <= target + tol and target < cum[r, i] + tol, (r, i, below, target, cum[r, i])
  assert ids[3] == v - 1


def test_inverse_cdf_frequencies_over_a_whole_vocabulary():
  """Rows drawn through the whole-vocabulary path (temperature only, a flat
  distribution: far more tokens kept than the candidates): mass per rank decile
  against the softmax."""
  rng = np.random.default_rng(4)
  logits = rng.standard_normal(2048 + 37).astype(np.float32)  # a ragged last block
  n = 20000
  keys = jax.random.split(jax.random.PRNGKey(9), n)
  full = lambda x, dt: jnp.full((n,), x, dt)
  ids = np.asarray(jax.jit(sample)(jnp.asarray(np.repeat(logits[None], n, 0)), keys,
                                   full(1.0, jnp.float32), full(0, jnp.int32),
                                   full(1.0, jnp.float32), full(0.0, jnp.float32)))
  probs = np.exp(logits - logits.max())
  probs /= probs.sum()
  freq = np.bincount(ids, minlength=len(logits)) / n
  for chunk in np.array_split(np.argsort(-probs), 10):
    assert abs(freq[chunk].sum() - probs[chunk].sum()) < 0.015


@pytest.mark.parametrize("need", [[0] * 9, [1] * 9, [0, 1, 0, 0, 1, 1, 0, 1, 0], [0] * 8 + [1]])
def test_the_whole_row_search_runs_for_the_rows_in_need_only(need):
  """Rows in need get the batch search's thresholds bit for bit (one row per pass);
  the others keep the fallback."""
  from o1jax.model.sampling import _filters, _search_rows, _threshold_by_search

  logits = jnp.asarray(_rows(len(CASES), seed=8))
  k, p, m, t = (jnp.asarray(np.array(c), dt) for c, dt in
                zip(zip(*CASES), (jnp.int32, jnp.float32, jnp.float32, jnp.float32)))
  scaled = logits / t[:, None]
  k_on, p_on, lse, _ = _filters(scaled, k, p, m)
  want = np.asarray(jax.jit(_threshold_by_search)(scaled, lse, k, p, k_on, p_on))
  need = jnp.asarray(need, bool)
  fallback = jnp.full((len(CASES),), 123.0)
  got = np.asarray(jax.jit(_search_rows)(need, fallback, scaled, lse, k, p, k_on, p_on))
  np.testing.assert_array_equal(got, np.where(np.asarray(need), want, 123.0))


def test_the_batch_search_gives_the_row_search_thresholds():
  """The GPU's whole-batch search (one pass per bisection step) and the CPU's row by
  row one give the same thresholds; `sample` lowers for CUDA with it."""
  from o1jax.model.sampling import _filters, _search_batch, _search_rows

  logits = jnp.asarray(_rows(len(CASES), seed=9))
  k, p, m, t = (jnp.asarray(np.array(c), dt) for c, dt in
                zip(zip(*CASES), (jnp.int32, jnp.float32, jnp.float32, jnp.float32)))
  scaled = logits / t[:, None]
  k_on, p_on, lse, _ = _filters(scaled, k, p, m)
  fallback = jnp.full((len(CASES),), -5.0)
  for need in ([0, 1, 0, 0, 1, 1, 0, 0, 1], [0] * 9, [1] * 9):
    need = jnp.asarray(need, bool)
    a = jax.jit(_search_rows)(need, fallback, scaled, lse, k, p, k_on, p_on)
    b = jax.jit(_search_batch)(need, fallback, scaled, lse, k, p, k_on, p_on)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  keys = jax.random.split(jax.random.PRNGKey(0), len(CASES))
  traced = jax.jit(sample).trace(logits, keys, t, k, p, m)
  loops = {platform: traced.lower(lowering_platforms=(platform,)).as_text().count("stablehlo.while")
           for platform in ("cpu", "cuda")}
  assert loops["cpu"] > loops["cuda"] >= 1, loops  # the CPU's loop over the rows in need


def test_the_draw_never_lands_on_a_zero_weight():
  """A running sum that rounding lifts at a zero weight (a parallel scan can) does not
  draw it: the first positive weight past the target is taken; a row without one
  draws its last index (as the argmax of an all-NaN row)."""
  from o1jax.model.sampling import _first_passing, _inverse_cdf

  weights = jnp.asarray([[1.0, 0.0, 1.0, 0.0]])
  lifted = jnp.asarray([[1.0, 1.0000001, 2.0, 2.0]])  # index 1's sum rounded up
  assert int(_first_passing(weights, lifted, jnp.asarray([1.0]))[0]) == 2
  assert int(_first_passing(weights, lifted, jnp.asarray([2.0]))[0]) == 4  # none: N
  zero = jnp.zeros((2, 300))
  assert np.asarray(jax.jit(_inverse_cdf)(zero, jnp.asarray([0.0, 0.7]))).tolist() == [299, 299]
  nan = jnp.full((2, 1000), jnp.nan)
  keys = jax.random.split(jax.random.PRNGKey(0), 2)
  ids = jax.jit(sample)(nan, keys, jnp.asarray([0.0, 0.8]), jnp.zeros(2, jnp.int32),
                        jnp.ones(2), jnp.zeros(2))
  assert np.asarray(ids).tolist() == [999, 999]  # greedy and sampled alike, in range


def test_infinite_logits_take_all_the_mass():
  """+inf logits (an overflowing model) hold all the mass, shared equally; -inf ones
  none: every setting draws an infinite token, never a masked one (before, an
  unfiltered row drew token 0)."""
  v, n = 1000, 400
  row = np.random.default_rng(1).standard_normal(v).astype(np.float32)
  row[::3] = -np.inf
  row[[5, 601]] = np.inf
  keys = jax.random.split(jax.random.PRNGKey(2), n)
  full = lambda x, dt: jnp.full((n,), x, dt)
  for t, k, p, m in [(0.8, 0, 1.0, 0.0), (0.8, 0, 0.9, 0.0), (0.8, 40, 1.0, 0.0),
                     (50.0, 0, 0.5, 0.1), (0.0, 0, 1.0, 0.0)]:
    ids = np.asarray(jax.jit(sample)(jnp.asarray(np.repeat(row[None], n, 0)), keys,
                                     full(t, jnp.float32), full(k, jnp.int32),
                                     full(p, jnp.float32), full(m, jnp.float32)))
    assert set(ids.tolist()) <= {5, 601}, (t, k, p, m, sorted(set(ids.tolist()))[:5])
    if t > 0 and p > 0.5:  # (top-p 0.5 keeps one of the two: the first reaches it)
      assert 0.4 < np.mean(ids == 5) < 0.6, (t, k, p, m)  # shared equally


@pytest.mark.parametrize("vocab", [100, 3000])  # candidates = the whole row / a part of it
def test_what_the_caller_knows_of_the_rows_keeps_the_tokens(vocab):
  """`all_sampled` / `filters` leave branches out; every row's token stays the general
  sampler's, for peaked and flat rows, filters that pass the candidates or not."""
  rng = np.random.default_rng(vocab)
  b = 16
  logits = rng.normal(0, 1, (b, vocab)) * rng.choice([0.2, 3.0], (b, 1))
  logits[0, [3, 7]] = np.inf  # +inf logits share the mass
  logits[1, :] = np.nan  # an all-NaN row takes its last index
  logits = jnp.asarray(logits, jnp.float32)
  keys = jax.random.split(jax.random.PRNGKey(2), b)
  t = jnp.asarray(rng.uniform(0.5, 1.5, b), jnp.float32)
  none_k, none_p, none_m = jnp.zeros(b, jnp.int32), jnp.ones(b), jnp.zeros(b)
  general = sample(logits, keys, t, none_k, none_p, none_m)
  np.testing.assert_array_equal(
      sample(logits, keys, t, none_k, none_p, none_m, all_sampled=True, filters=False), general)
  top_k = jnp.asarray(rng.choice([0, 5, 400], b), jnp.int32)
  top_p = jnp.asarray(rng.choice([1.0, 0.9, 0.995], b), jnp.float32)
  min_p = jnp.asarray(rng.choice([0.0, 0.05], b), jnp.float32)
  general = sample(logits, keys, t, top_k, top_p, min_p)
  np.testing.assert_array_equal(
      sample(logits, keys, t, top_k, top_p, min_p, all_sampled=True, filters=True), general)


@pytest.mark.parametrize("vocab", [100, 1000])  # candidates = the whole row / a part of it
def test_logits_that_overflow_when_scaled_draw_from_the_same_softmax(vocab):
  """Finite logits past f32 max x temperature (inf once divided): the row draws from the
  softmax the quotient means (before, inf - inf made every weight NaN and the draw
  landed anywhere). The scale by 1e30 keeps the gaps: softmax(1e30 x / 1e-6)'s mass is
  on the row's maximum, and the rows beside it keep their tokens."""
  rng = np.random.default_rng(vocab)
  n = 64
  row = rng.standard_normal(vocab).astype(np.float32)
  row[17] = 4.0  # the maximum, by a gap far past the temperature
  huge = np.repeat(row[None] * np.float32(1e35), n, 0)
  huge[1, ::2] = -np.inf
  huge[1, 17] = row[17] * 1e35
  keys = jax.random.split(jax.random.PRNGKey(3), n)
  full = lambda x, dt: jnp.full((n,), x, dt)
  for k, p, m in [(0, 1.0, 0.0), (0, 0.9, 0.0), (40, 1.0, 0.0), (0, 1.0, 0.1)]:
    ids = np.asarray(jax.jit(sample)(jnp.asarray(huge), keys, full(1e-6, jnp.float32),
                                     full(k, jnp.int32), full(p, jnp.float32),
                                     full(m, jnp.float32)))
    assert set(ids.tolist()) == {17}, (k, p, m, sorted(set(ids.tolist()))[:5])
  from o1jax.model.sampling import filter_threshold
  cut = np.asarray(filter_threshold(jnp.asarray(huge[:2]), jnp.full((2,), 1e-6, jnp.float32),
                                    jnp.full((2,), 40, jnp.int32), jnp.ones(2, jnp.float32),
                                    jnp.zeros(2, jnp.float32)))
  # (the 40th value is -inf: the others are past the range below the max)
  assert not np.isnan(cut).any() and (cut <= 0).all()  # the max's shifted value is 0
  normal = np.asarray(sample(jnp.asarray(row[None].repeat(2, 0)), keys[:2],
                             jnp.full((2,), 0.7, jnp.float32), jnp.zeros(2, jnp.int32),
                             jnp.ones(2), jnp.zeros(2)))
  plain = np.asarray(sample(jnp.asarray(np.stack([row, row * 1e35])), keys[:2],
                            jnp.asarray([0.7, 0.7], jnp.float32), jnp.zeros(2, jnp.int32),
                            jnp.ones(2), jnp.zeros(2)))
  assert plain[0] == normal[0]  # a row without overflow keeps its draw beside one with it


def test_filter_threshold_maps_infinite_logits_as_the_draw_does():
  """filter_threshold reads the values `sample` draws from: +inf logits as 0 among -inf."""
  from o1jax.model.sampling import filter_threshold
  row = np.random.default_rng(4).standard_normal((1, 500)).astype(np.float32)
  row[0, [5, 9]] = np.inf
  cut = np.asarray(filter_threshold(jnp.asarray(row), jnp.ones(1, jnp.float32),
                                    jnp.full((1,), 2, jnp.int32), jnp.ones(1, jnp.float32),
                                    jnp.zeros(1, jnp.float32)))
  assert cut[0] == 0.0  # the two infinite tokens' value; the others are -inf
