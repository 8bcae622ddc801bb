"""Argument types the scripts share: a bad value is argparse's one line naming the flag
(exit 2) before any work, and an output file that cannot be written is found before the
computation whose numbers it would hold (they were lost after minutes of work)."""

from __future__ import annotations

import argparse
import os
import sys


def count(low: int = 1):
  """An int >= low (`--problems 0` ended in an IndexError after the model loaded)."""
  def parse(text: str) -> int:
    try:
      value = int(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"expected an int >= {low}, got {text!r}") from None
    if value < low:
      raise argparse.ArgumentTypeError(f"expected an int >= {low}, got {value}")
    return value
  return parse


def numbers(text: str) -> list[float]:
  """A comma-separated list of numbers ("0.3,0.7,1.2")."""
  try:
    values = [float(x) for x in text.split(",") if x.strip()]
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
  if not values:
    raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}")
  return values


def _number(low: float, inclusive: bool):
  """A finite number above `low` (or at it, `inclusive`)."""
  what = f"a finite number {'>=' if inclusive else '>'} {low:g}"

  def parse(text: str) -> float:
    try:
      value = float(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not (value >= low if inclusive else value > low) or value == float("inf"):
      raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
    return value
  return parse


# `--interval-ms 0` or `nan` failed after the model loaded; 0 as "the default rule".
positive = _number(0, inclusive=False)
non_negative = _number(0, inclusive=True)


def percent(text: str) -> float:
  """A percentage in (0, 100] (`--keep-percent 150` failed after the model loaded)."""
  value = positive(text)
  if value > 100:
    raise argparse.ArgumentTypeError(f"expected a percentage in (0, 100], got {text}")
  return value


def positive_numbers(text: str) -> list[float]:
  """Comma-separated finite numbers > 0 (`--loads 0` spun forever on NaN arrival times)."""
  values = numbers(text)
  if not all(0 < v < float("inf") for v in values):
    raise argparse.ArgumentTypeError(f"expected comma-separated numbers > 0, got {text!r}")
  return values


def counts(low: int = 1):
  """Comma-separated ints >= low ("1,2,4")."""
  one = count(low)

  def parse(text: str) -> list[int]:
    parts = [x for x in text.split(",") if x.strip()]
    if not parts:
      raise argparse.ArgumentTypeError(f"expected comma-separated ints >= {low}, got {text!r}")
    try:
      return [one(x.strip()) for x in parts]
    except argparse.ArgumentTypeError:
      raise argparse.ArgumentTypeError(f"expected comma-separated ints >= {low}, got "
                                       f"{text!r}") from None
  return parse


def levels(text: str) -> list[int]:
  """Synthetic GSM difficulty levels ("1,2"), each one the generator has."""
  from pipelines.datasets.gsm_synthetic import LEVELS  # pylint: disable=g-import-not-at-top
  try:
    values = [int(x) for x in text.split(",") if x.strip()]
  except ValueError:
    values = []
  if not values or any(v not in LEVELS for v in values):
    raise argparse.ArgumentTypeError(f"expected comma-separated levels of {list(LEVELS)}, got "
                                     f"{text!r}")
  return values


def output_file(text: str) -> str:
  """A file to write the results to ("" = none): its directory exists and is writable."""
  if not text:
    return text
  if os.path.isdir(text):
    raise argparse.ArgumentTypeError(f"{text} is a directory: name a file")
  parent = os.path.dirname(os.path.abspath(text))
  if not os.path.isdir(parent):
    raise argparse.ArgumentTypeError(f"directory {parent} does not exist")
  if not os.access(parent, os.W_OK):
    raise argparse.ArgumentTypeError(f"cannot write in {parent}")
  return text


def run_as_script(main) -> None:
  """Exits with `main()`'s code: its int (2 from `user_errors`), else 0 (a result)."""
  result = main()
  sys.exit(result if isinstance(result, int) else 0)


def user_errors(main):
  """`main`, with a checkpoint that cannot be loaded (a wrong --model / --source) printed as
  one `error:` line, exit code 2, instead of a traceback."""
  def run(argv=None) -> int:
    from o1jax.checkpoint import CheckpointError  # pylint: disable=g-import-not-at-top
    try:
      return main(argv)
    except CheckpointError as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
  return run
