"""Shape bucketing shared by every jitted caller (generator, engine, controller)."""


def pow2_bucket(n: int, minimum: int = 1) -> int:
  """Smallest power of two >= max(n, minimum): a few compiled shapes serve every size."""
  return max(minimum, 1 << max(0, int(n) - 1).bit_length())


def three_quarter_bucket(n: int, minimum: int = 1) -> int:
  """`pow2_bucket`, or 3/4 of it when n fits there (…, 48, 64, 96, 128, …): at most
  one extra shape per octave, at most 33% padding instead of 100%."""
  b = pow2_bucket(n, minimum)
  if b > minimum and b % 4 == 0 and n <= b * 3 // 4:
    return b * 3 // 4
  return b
