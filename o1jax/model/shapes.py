"""Shape bucketing shared by every jitted caller (generator, engine, controller)."""


def pow2_bucket(n: int, minimum: int = 1) -> int:
  """Smallest power of two >= max(n, minimum): a few compiled shapes serve every size."""
  return max(minimum, 1 << max(0, int(n) - 1).bit_length())
