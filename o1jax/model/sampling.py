"""Token sampling: greedy, temperature, top-k, top-p, min-p — per row of a batch.

Randomness is derived, never positional: the key of token `step` of sample `j`
of request `r` is fold_in(fold_in(fold_in(seed_key(seed), r), j), step), so a
sequence samples the same tokens whatever batch or slot it runs in.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import numbers

import jax
import jax.numpy as jnp

# Seeds `seed_key` takes (64 bits), and int request ids `key_id_words` takes (64 bits).
SEED_RANGE = (-2**63, 2**63)
KEY_ID_RANGE = (0, 2**64)
SAMPLE_INDEX_LIMIT = 2**32  # a sample index folds in as one word
INT32_MAX = 2**31 - 1
MIN_TEMPERATURE = 1e-6  # the smallest temperature the draw divides by
# The largest: XLA divides by t as a multiply by 1/t, and past ~8.5e37 1/t is below
# float32's normal range, flushed to 0 (every logit 0: uniform draws, NaN for -inf ones).
MAX_TEMPERATURE = 1e30


def is_int(value) -> bool:
  """An int of any kind (Python's, numpy's); not a bool (True is no count) nor a float."""
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value) -> bool:
  """A real number (an int too); not a bool nor a str."""
  return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_int(value, name: str, low: int = 0, high: int | None = None) -> int:
  """`value` as a Python int; ValueError naming `name` unless it is an int (numpy's too,
  not a bool nor a float) in [low, high] (high None: no upper bound)."""
  if not is_int(value) or value < low or (high is not None and value > high):
    bound = f">= {low}" if high is None else f"in [{low}, {high}]"
    raise ValueError(f"{name} must be an int {bound}, got {value!r}")
  return int(value)


def check_seed(seed, what: str = "seed") -> None:
  """ValueError unless `seed` is an int `sequence_key` takes."""
  low, high = SEED_RANGE
  if not is_int(seed) or not low <= seed < high:
    raise ValueError(f"{what} must be an int in [-2**63, 2**63), got {seed!r}")


def check_key_id(request_id, what: str = "request_id") -> None:
  """ValueError unless `request_id` is an int `sequence_key` folds in (64 bits)."""
  low, high = KEY_ID_RANGE
  if not is_int(request_id) or not low <= request_id < high:
    raise ValueError(f"{what} must be an int in [0, 2**64), got {request_id!r}")


def check_sample_index(index, what: str = "sample index") -> None:
  """ValueError unless `index` is an int `sequence_key` folds in as a sample index."""
  if not is_int(index) or not 0 <= index < SAMPLE_INDEX_LIMIT:
    raise ValueError(f"{what} must be an int in [0, 2**32), got {index!r}")


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How the next token is drawn, checked once here for every class that carries it:
  `SamplingParams` (+ seed), the engine's `GenerationParams` (+ stopping) and the
  controller's `LoopSettings` (+ the reasoning loop's knobs)."""

  temperature: float = 0.0  # 0 -> greedy
  top_k: int = 0  # 0 -> off
  top_p: float = 1.0  # 1 -> off
  min_p: float = 0.0  # 0 -> off

  def __post_init__(self):
    # Types first: a str compares with a TypeError, a float top_k would be cut to an int
    # on the device, and a NaN temperature would silently decode greedily.
    for name in ("temperature", "top_p", "min_p"):
      if not is_real(getattr(self, name)):
        raise ValueError(f"{name} must be a number, got {getattr(self, name)!r}")
    # An int32 on the device; any k >= the vocabulary is off (0 too).
    check_int(self.top_k, "top_k", 0, INT32_MAX)
    if not math.isfinite(self.temperature):
      raise ValueError(f"temperature must be finite, got {self.temperature}")
    if self.temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if self.temperature and not MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE:
      # The device divides by max(t, MIN_TEMPERATURE) in float32: a smaller t was raised
      # to it (1e-300 even read as 0 by the host, greedy on the device); a larger one
      # than MAX_TEMPERATURE ignored the logits and every filter.
      raise ValueError(f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, "
                       f"{MAX_TEMPERATURE:g}], got {self.temperature}")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
    if not 0.0 <= self.min_p < 1.0:
      raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0


@dataclasses.dataclass(frozen=True)
class SamplingParams(Sampling):
  """`Sampling` of one sequence plus the seed of its random stream (see the module doc)."""

  seed: int = 0

  def __post_init__(self):
    super().__post_init__()
    check_seed(self.seed)


def seed_key(seed: int) -> jax.Array:
  """PRNGKey(seed) with all 64 bits of `seed` ([high word, low word], what PRNGKey gives
  with x64 on): without x64 it keeps the low word only, and seeds 2**32 apart drew the
  same samples. Seeds in [0, 2**32) keep their keys."""
  seed = int(seed) % 2**64  # two's complement
  return jnp.asarray([seed >> 32, seed & 0xFFFFFFFF], jnp.uint32)


# The first key word of a str request id and of an int id of 2**32 or more (an int id
# below 2**32 folds in one word alone, the keys such ids have always had).
_STRING_ID_TAG = 0x53545249
_WIDE_ID_TAG = 0x57494445


def key_id_words(request_id) -> tuple[int, ...]:
  """The 32-bit words a request id folds into its sampling keys (`sequence_key`): an int
  below 2**32 itself; a wider int (up to 2**64) a tag and its two halves; a str a tag and
  64 bits of its sha256 (surrogatepass: an id holding a lone surrogate still names one
  stream). A 32-bit id gave two ids one stream at a few hundred thousand ids (a CRC:
  "plumless" and "buckeroo"; the pipelines' 31-bit hashes: the samples of one example at
  n = 100,000 shared ~2 streams)."""
  if isinstance(request_id, str):
    digest = hashlib.sha256(request_id.encode("utf-8", "surrogatepass")).digest()
    return (_STRING_ID_TAG, int.from_bytes(digest[:4], "little"),
            int.from_bytes(digest[4:8], "little"))
  check_key_id(request_id)
  request_id = int(request_id)
  if request_id < 2**32:
    return (request_id,)
  return (_WIDE_ID_TAG, request_id >> 32, request_id & 0xFFFFFFFF)


def sequence_key(seed: int, request_id, sample_index: int) -> jax.Array:
  """Base key of one sample of one request (uint32 key data [2]). request_id: an int in
  [0, 2**64), a str, or its words (`key_id_words`)."""
  key = seed_key(seed)
  for word in (request_id if isinstance(request_id, tuple) else key_id_words(request_id)):
    key = jax.random.fold_in(key, word)
  return jax.random.fold_in(key, sample_index)


CANDIDATES = 256  # largest values per row read by `lax.top_k` (5 ms on [32, 49152])
_SEARCH_STEPS = 32  # a bisection over the 32-bit order of f32 values is exact in 32 steps


def _order_key(x: jax.Array) -> jax.Array:
  """f32 -> uint32 with the same order (-inf < ... < -0 < +0 < ... < +inf)."""
  i = jax.lax.bitcast_convert_type(x, jnp.int32)
  i = jnp.where(i < 0, i ^ jnp.int32(0x7FFFFFFF), i)
  return jax.lax.bitcast_convert_type(i, jnp.uint32) ^ jnp.uint32(0x80000000)


def _from_order_key(u: jax.Array) -> jax.Array:
  i = jax.lax.bitcast_convert_type(u ^ jnp.uint32(0x80000000), jnp.int32)
  i = jnp.where(i < 0, i ^ jnp.int32(0x7FFFFFFF), i)
  return jax.lax.bitcast_convert_type(i, jnp.float32)


def _filters(scaled, top_k, top_p, min_p):
  """Which filters are on per row, log-sum-exp, and the min-p threshold in scaled units."""
  v = scaled.shape[-1]
  k_on = (top_k > 0) & (top_k < v)
  p_on = top_p < 1.0
  lse = jax.nn.logsumexp(scaled, axis=-1)
  # min-p: keep log p >= max log p + log(min_p), i.e. scaled >= max + log(min_p).
  m_cut = jnp.max(scaled, axis=-1) + jnp.log(jnp.maximum(min_p, 1e-30))
  m_cut = jnp.where(min_p > 0, m_cut, -jnp.inf)
  return k_on, p_on, lse, m_cut


def _threshold_from_candidates(vals, lse, top_k, top_p, k_on, p_on, vocab: int):
  """(threshold [B], known [B]) from each row's C largest scaled values `vals` (descending).

  In the order of transformers' and vLLM's samplers: top-k keeps the values >= the
  k-th largest (ties at it are kept); top-p then keeps the smallest prefix of those
  whose mass *among them* (renormalized) reaches p; min-p (the caller's) is relative
  to the largest probability, which renormalizing does not change. Known when the
  cuts lie among the candidates (top-k's ties too); filters that are off give -inf."""
  c = vals.shape[-1]
  kth = jnp.take_along_axis(vals, (jnp.clip(top_k, 1, c) - 1)[:, None], axis=-1)[:, 0]
  # With top-p on, top-k's mass must be whole: ties at the k-th value may continue past
  # the candidates.
  k_known = ~k_on | (c >= vocab) | ((top_k <= c) & (~p_on | (vals[:, -1] < kth)))
  probs = jnp.exp(vals - lse[:, None])
  k_mass = jnp.sum(jnp.where(vals >= kth[:, None], probs, 0.0), axis=-1)
  target = top_p * jnp.where(k_on & p_on, k_mass, 1.0)  # top-p's mass, in the row's units
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  n_keep = jnp.sum(mass_before < target[:, None], axis=-1)
  pth = jnp.take_along_axis(vals, (jnp.clip(n_keep, 1, c) - 1)[:, None], axis=-1)[:, 0]
  p_known = ~p_on | (n_keep < c) | (c >= vocab)  # the prefix ends inside the candidates
  cut = jnp.maximum(jnp.where(k_on, kth, -jnp.inf), jnp.where(p_on, pth, -jnp.inf))
  return cut, k_known & p_known


def _bisect(scaled, holds) -> jax.Array:
  """[B] the largest value t of each row with holds(scaled >= t) ([B, V] -> [B] bool;
  true at the row's minimum, monotone): a bisection over the order keys of f32,
  exact in 32 steps."""
  lo = _order_key(jnp.min(scaled, axis=-1))
  hi = _order_key(jnp.max(scaled, axis=-1)) + 1

  def halve(_, bounds):
    lo, hi = bounds
    mid = lo + (hi - lo) // 2
    ok = holds(scaled >= _from_order_key(mid)[:, None])
    return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

  lo, _ = jax.lax.fori_loop(0, _SEARCH_STEPS, halve, (lo, hi))
  return _from_order_key(lo)


def _threshold_by_search(scaled, lse, top_k, top_p, k_on, p_on):
  """The same threshold over the whole row, without sorting: the largest value t
  with (count(x >= t) >= k) or (mass(x >= t) >= p x the top-k set's mass) is
  max(k-th value, top-p value). With both filters on, a first bisection finds the
  k-th value (whose set's mass top-p reads). [B]"""
  probs = jnp.exp(scaled - lse[:, None])
  count_holds = lambda kept: jnp.sum(kept, axis=-1) >= top_k

  def k_mass(_):
    kept = scaled >= _bisect(scaled, count_holds)[:, None]
    return jnp.where(k_on & p_on, jnp.sum(jnp.where(kept, probs, 0.0), axis=-1), 1.0)

  # (a cond: the first bisection only where a row needs it; the rows here are rare)
  target = top_p * jax.lax.cond(jnp.any(k_on & p_on), k_mass,
                                lambda _: jnp.ones_like(top_p), None)
  cut = _bisect(scaled, lambda kept: ((k_on & count_holds(kept))
                                      | (p_on & (jnp.sum(jnp.where(kept, probs, 0.0), axis=-1)
                                                 >= target))))
  return jnp.where(k_on | p_on, cut, -jnp.inf)


def _search_rows(need, fallback, scaled, lse, top_k, top_p, k_on, p_on):
  """`_threshold_by_search` for the rows in `need` ([B] bool), one row at a time;
  `fallback` elsewhere.

  The search reads a row 32 times. Run over the whole batch it cost every row that
  while a few need it (a real model's top-p set at temperature 0.8-1 passes the 256
  candidates at 0-13% of positions), and the batch's rows (2 x 12.6 MB at [64, 49152])
  came from memory in each pass; a gathered row stays in cache for its 32. `sample` on
  [64, 49152] logits, top-p 0.95, this 2-core CPU (median of 5, quiet machine): 1 / 8 /
  64 rows in need 28 / 32 / 58 ms; the batch search before: 78-81 ms whatever the count
  (the search alone at 64 rows: 48 vs 79 ms); 2 to 64 rows per pass were within 2-3 ms
  of one. The CPU's choice (`sample` picks per platform; elsewhere `_search_batch`)."""
  todo = jnp.nonzero(need, size=need.shape[0], fill_value=0)[0]

  def one_row(i, cuts):
    r = todo[i]
    row = lambda a: jax.lax.dynamic_slice_in_dim(a, r, 1)
    found = _threshold_by_search(row(scaled), row(lse), row(top_k), row(top_p), row(k_on),
                                 row(p_on))
    return jax.lax.dynamic_update_slice_in_dim(cuts, found.astype(cuts.dtype), r, 0)

  return jax.lax.fori_loop(0, jnp.sum(need, dtype=jnp.int32), one_row, fallback)


def _search_batch(need, fallback, scaled, lse, top_k, top_p, k_on, p_on):
  """`_search_rows` as one search over the whole batch, if any row needs it: on a GPU
  each bisection pass is a kernel launch, so one [B, V] pass beats B row-sized ones."""
  # (filters off outside `need`: its first bisection runs only if a row in need has both)
  found = jax.lax.cond(jnp.any(need),
                       lambda _: _threshold_by_search(scaled, lse, top_k, top_p, k_on & need,
                                                      p_on & need),
                       lambda _: fallback, None)
  return jnp.where(need, found, fallback)


CDF_BLOCK = 128  # weights per block of the two-level inverse CDF


def _last_positive(weights: jax.Array) -> jax.Array:
  """[..., N] -> [...] index of the last positive weight; N - 1 if there is none (an
  all-NaN row, as its argmax)."""
  n = weights.shape[-1]
  last = jnp.max(jnp.where(weights > 0, jnp.arange(n, dtype=jnp.int32), -1), axis=-1)
  return jnp.where(last >= 0, last, n - 1)


def _first_passing(weights: jax.Array, cum: jax.Array, target: jax.Array) -> jax.Array:
  """[B, N] -> [B] first index with a positive weight whose running sum passes target
  (N if none). Asking for a positive weight keeps a zero one (a filtered token, the
  padding) from being drawn where a parallel scan's rounding lifts its running sum."""
  n = weights.shape[-1]
  hit = (weights > 0) & (cum > target[:, None])
  return jnp.min(jnp.where(hit, jnp.arange(n, dtype=jnp.int32), n), axis=-1)


def _inverse_cdf(weights: jax.Array, u: jax.Array) -> jax.Array:
  """Index drawn with probability weights / sum(weights) from uniforms u [B] in [0, 1):
  the first positive weight whose running sum passes u * total.

  Two levels: the running sum of block sums picks the block, then the running sum
  inside that block (from the blocks before it) picks the index. XLA's CPU cumsum
  over a whole [64, 49152] row took 13 ms (22 ms with the count); this reads the
  weights once (~2 ms). Rounding can put the target past the last positive weight
  of the chosen block (or of the row): that weight is taken then."""
  b, v = weights.shape
  c = min(CDF_BLOCK, v)
  w = jnp.pad(weights, ((0, 0), (0, (-v) % c))).reshape(b, -1, c)
  nb = w.shape[1]
  sums = jnp.sum(w, axis=-1)  # [B, NB]
  block_cum = jnp.cumsum(sums, axis=-1)
  target = u * block_cum[:, -1]
  blk = _first_passing(sums, block_cum, target)
  past_end = blk >= nb  # u * total rounded up to the total (or no positive weight)
  blk = jnp.minimum(blk, nb - 1)
  rows = jnp.arange(b)
  base = jnp.where(blk > 0, block_cum[rows, jnp.maximum(blk - 1, 0)], 0.0)
  inner = w[rows, blk]  # [B, C]
  j = _first_passing(inner, base[:, None] + jnp.cumsum(inner, axis=-1), target)
  j = jnp.where(j < c, j, _last_positive(inner))
  return jnp.where(past_end, _last_positive(weights), blk * c + j).astype(jnp.int32)


def _scaled(logits, temperature) -> jax.Array:
  """[B, V] f32 logits / temperature, the values a sampled row draws from by softmax.

  A row with +inf logits puts all its mass on them (equally): as logits 0 among -inf
  (exp(inf - inf) would make every weight NaN). A row whose finite logits overflow when
  divided (|logit| > f32 max x temperature) is divided after subtracting its largest
  logit: the same softmax, now without inf - inf; other rows keep the plain quotient,
  so their draws do not change by a rounding."""
  x = logits.astype(jnp.float32)
  t = jnp.maximum(temperature, MIN_TEMPERATURE)[:, None]
  # One pass over the row finds both cases: its largest value (NaN aside) is +inf, or
  # finite with a quotient that is not (the row's other quotients are then finite or -inf).
  top = jnp.max(jnp.where(jnp.isnan(x), -jnp.inf, x), axis=-1, keepdims=True)
  overflow = jnp.isfinite(top) & ~jnp.isfinite(top / t)
  return jnp.where(top == jnp.inf, jnp.where(x == jnp.inf, 0.0, -jnp.inf),
                   jnp.where(overflow, (x - top) / t, x / t))


def filter_threshold(logits, temperature, top_k, top_p, min_p) -> jax.Array:
  """[B] the smallest scaled logit (logits / temperature) a row keeps after top-k,
  top-p and min-p: `sample` draws from softmax(scaled) restricted to scaled >= it."""
  scaled = _scaled(logits, temperature)
  k_on, p_on, lse, m_cut = _filters(scaled, top_k, top_p, min_p)
  return jnp.maximum(_threshold_by_search(scaled, lse, top_k, top_p, k_on, p_on), m_cut)


def first_argmax(logits: jax.Array) -> jax.Array:
  """jnp.argmax over the last axis (the first index of the maximum) as a max, a
  compare and a min: XLA's CPU argmax (a variadic reduce) took 2.9 ms on [32,
  49152] logits, this 1.5 ms. [..., V] -> [...] int32 (all-NaN rows -> V - 1)."""
  v = logits.shape[-1]
  top = jnp.max(logits, axis=-1, keepdims=True)
  index = jnp.arange(v, dtype=jnp.int32)
  first = jnp.min(jnp.where(logits == top, index, v), axis=-1)
  return jnp.minimum(first, v - 1)


def token_logprobs(logits: jax.Array, tokens: jax.Array, top_n: int):
  """log-softmax of logits [B, V] at tokens [B]; plus the top_n best (ids, logprobs)."""
  if top_n:
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
    top_lp, top_ids = jax.lax.top_k(logp, top_n)
  else:
    # The same operations as log_softmax, at one token per row instead of all V.
    shifted = logits.astype(jnp.float32)
    shifted = shifted - jnp.max(shifted, axis=-1, keepdims=True)
    log_norm = jnp.log(jnp.sum(jnp.exp(shifted), axis=-1))
    chosen = jnp.take_along_axis(shifted, tokens[:, None], axis=-1)[:, 0] - log_norm
    top_lp = jnp.zeros((logits.shape[0], 0), jnp.float32)
    top_ids = jnp.zeros((logits.shape[0], 0), jnp.int32)
  return chosen, top_ids.astype(jnp.int32), top_lp


def sample(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_k: jax.Array,
           top_p: jax.Array, min_p: jax.Array, all_sampled: bool = False,
           filters: bool | None = None) -> jax.Array:
  """Samples one token per row. logits: [B, V]; keys: [B, 2]; params: [B]. Returns [B] int32.

  Rows with temperature 0 take the argmax. A sampled row draws from
  softmax(logits / temperature) restricted to the tokens its top-k / top-p /
  min-p filters keep, by inverse CDF on one uniform from its key. Nothing is
  sorted: the filter thresholds come from the row's `CANDIDATES` largest
  values when they lie among them (the usual case: the draw then reads only
  those), else from a bisection over the whole row, and a row that keeps more
  than the candidates draws over the whole vocabulary. Which way a row goes
  depends on that row alone, so its token does not depend on the batch.
  (A full sort of [32, 49152] f32 logits took 290-310 ms on a 2-core CPU; this
  takes 5-7 ms when every row's kept set is among its candidates, 2 ms unfiltered:
  `scripts/bench_sampling.py`.)

  What the caller knows of the rows leaves out the tests that choose between
  branches (`lax.cond` on the batch's values), with the same tokens: all_sampled,
  every row samples (temperature > 0); filters, some sampled row filters (True) or
  none does (False; None: unknown). A GPU runs a `lax.cond` by copying its
  predicate to the host and waiting for the device (XLA's ConditionalThunk); the
  device loop then cannot queue the next kernels ahead."""
  def greedy(_):
    return first_argmax(logits)

  def sampled(_):
    scaled = _scaled(logits, temperature)
    v = scaled.shape[-1]
    u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)

    def whole_vocabulary(cut):
      top = jnp.max(scaled, axis=-1, keepdims=True)
      w = jnp.where(scaled >= cut[:, None], jnp.exp(scaled - top), 0.0)
      return _inverse_cdf(w, u)

    def candidates(_):
      """(ids drawn among the candidates, among: a row's kept set lies inside them,
      cut: its threshold for a draw over the whole vocabulary)."""
      k_on, p_on, lse, m_cut = _filters(scaled, top_k, top_p, min_p)
      # The barrier keeps XLA (CPU) from rewriting top_k + a static slice of its
      # result (vals[:, :1] below) into a full sort, which undid the point of top_k.
      # (Not on a mesh: XLA's SPMD partitioner aborts on an optimization barrier, and
      # the values are the same without it.)
      vals, idx = jax.lax.top_k(scaled, min(CANDIDATES, v))
      if jax.sharding.get_abstract_mesh().empty:
        vals, idx = jax.lax.optimization_barrier((vals, idx))
      cut, known = _threshold_from_candidates(vals, lse, top_k, top_p, k_on, p_on, v)
      cut = jnp.maximum(cut, m_cut)
      # Kept set inside the candidates: draw among them (vals[:, 0] is always kept).
      among = known & ((vals[:, -1] < cut) | (vals.shape[-1] == v))
      weights = jnp.where(vals >= cut[:, None], jnp.exp(vals - vals[:, :1]), 0.0)
      ids = jnp.take_along_axis(idx, _inverse_cdf(weights, u)[:, None], axis=-1)[:, 0]
      # A threshold past the candidates: the exact search, for the sampled rows needing it.
      exact = jax.lax.platform_dependent(~known & (temperature > 0), cut, scaled, lse, top_k,
                                         top_p, k_on, p_on, cpu=_search_rows,
                                         default=_search_batch)
      return ids.astype(jnp.int32), among, jnp.where(known, cut, jnp.maximum(exact, m_cut))

    b = scaled.shape[0]
    if v <= CANDIDATES:  # the candidates are the whole vocabulary (in another order)
      ids, among, cut = candidates(None)
    elif filters is False and all_sampled:  # every row draws over the whole vocabulary
      return whole_vocabulary(jnp.full((b,), -jnp.inf, jnp.float32))
    elif filters:
      ids, among, cut = candidates(None)
    else:
      # An unfiltered row draws over the whole vocabulary (cut -inf) either way: the
      # candidates' top_k is skipped when no sampled row filters.
      on = (temperature > 0) & (((top_k > 0) & (top_k < v)) | (top_p < 1.0) | (min_p > 0))
      no_filter = lambda _: (jnp.zeros((b,), jnp.int32), jnp.zeros((b,), bool),
                             jnp.full((b,), -jnp.inf, jnp.float32))
      ids, among, cut = jax.lax.cond(jnp.any(on), candidates, no_filter, None)
    # One whole-vocabulary draw (one compiled copy) for every row whose kept set passes
    # the candidates, whichever branch it came from (none can where the candidates are
    # the whole vocabulary: every threshold is known there).
    if v > CANDIDATES:
      ids = jnp.where(among, ids, jax.lax.cond(jnp.all(among), lambda _: ids,
                                               lambda _: whole_vocabulary(cut), None))
    if all_sampled:
      return ids.astype(jnp.int32)
    # The argmax only where some row is greedy (a pass over the logits).
    greedy_ids = jax.lax.cond(jnp.all(temperature > 0), lambda _: ids.astype(jnp.int32),
                              greedy, None)
    return jnp.where(temperature > 0, ids.astype(jnp.int32), greedy_ids)

  if all_sampled:
    return sampled(None)
  return jax.lax.cond(jnp.any(temperature > 0), sampled, greedy, None)
