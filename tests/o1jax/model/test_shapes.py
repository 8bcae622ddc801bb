"""Shape buckets: powers of two with a floor."""

from o1jax.model.shapes import pow2_bucket, three_quarter_bucket


def test_pow2_bucket_values():
  # 0 and 1 -> 1; 3 -> 4; floors apply; exact powers stay put.
  assert [pow2_bucket(n) for n in (0, 1, 2, 3, 4, 5, 64, 65)] == [1, 1, 2, 4, 4, 8, 64, 128]
  assert pow2_bucket(5, 16) == 16 and pow2_bucket(17, 16) == 32 and pow2_bucket(300, 256) == 512


def test_three_quarter_bucket_values():
  # 3/4 of the power of two when n fits there (and it stays above the floor).
  got = [three_quarter_bucket(n, 16) for n in (1, 16, 17, 24, 25, 40, 48, 49, 65, 96, 97)]
  assert got == [16, 16, 24, 24, 32, 48, 48, 64, 96, 96, 128]
  assert three_quarter_bucket(3) == 3 and three_quarter_bucket(5, 8) == 8
