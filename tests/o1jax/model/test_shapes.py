"""Shape buckets: powers of two with a floor."""

from o1jax.model.shapes import pow2_bucket


def test_pow2_bucket_values():
  # 0 and 1 -> 1; 3 -> 4; floors apply; exact powers stay put.
  assert [pow2_bucket(n) for n in (0, 1, 2, 3, 4, 5, 64, 65)] == [1, 1, 2, 4, 4, 8, 64, 128]
  assert pow2_bucket(5, 16) == 16 and pow2_bucket(17, 16) == 32 and pow2_bucket(300, 256) == 512
