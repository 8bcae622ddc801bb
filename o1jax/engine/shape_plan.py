"""Which compiled program an engine call runs: a bigger one already compiled, or its own.

A new shape costs a trace, a lowering and a compile (seconds per prefill shape of the
embedded model on a 2-core CPU; ~0.7 s from JAX's persistent cache: tracing, lowering and
loading the executable run in every process), while running a call padded to a bigger
compiled shape costs the padded positions. `ShapePlan` decides by the rent-or-buy rule: a
call whose own shape is not compiled runs in the cheapest compiled shape that fits, and
the extra seconds are added to its shape's debt; when the debt with this call's extra
would reach the measured cost of a compile, the shape is compiled. A short job compiles a
few shapes; a long one ends with every bucket it uses, having paid at most about twice
what the best choice in hindsight would have. Both costs are measured on this machine (a
GPU runs positions a thousand times faster than a CPU, and compiles no faster). Tokens do
not depend on the choice: padded rows and positions are masked.

A prefill shape is (rows, positions per row, table width in blocks), its size the
positions it computes; a decode shape is (rows, table width, stop-id width, top-K
alternatives), its size rows x width per step (a step's cost is not all in that product,
so the padding is overestimated: the plan compiles sooner, never later, than it should).
"""

from __future__ import annotations

import collections

Shape = tuple[int, int, int]

# Runs of a shape timed (one sync each) for the seconds-per-position estimate.
TIMED_RUNS_PER_SHAPE = 2
# A rented shape's table is at most this much wider than the call needs: attention over
# a wider table is not counted in the positions.
MAX_WIDTH_RATIO = 2


def size(shape: tuple) -> int:
  """Rows x the second dimension: positions (prefill), row-blocks per step (decode)."""
  return shape[0] * shape[1]


def prefill_fits(bigger: Shape, wanted: Shape) -> bool:
  """`bigger` can run a prefill call of shape `wanted` (padded)."""
  return (bigger[0] >= wanted[0] and bigger[1] >= wanted[1] and bigger[2] >= wanted[2]
          and bigger[2] <= MAX_WIDTH_RATIO * wanted[2])


def decode_fits(bigger: tuple, wanted: tuple) -> bool:
  """`bigger` can run a decode call of shape `wanted` (rows, table width, then what
  makes other programs: stop-id width, top-K, draw kind, steps per call): more rows,
  a wider table (at most MAX_WIDTH_RATIO wider), the same rest. (An "any" draw would
  give a greedy batch its tokens, but a GPU would pay the branch tests the kind
  leaves out on every step.)"""
  return (bigger[0] >= wanted[0] and wanted[1] <= bigger[1] <= MAX_WIDTH_RATIO * wanted[1]
          and bigger[2:] == wanted[2:])


class ShapePlan:
  """Rent (pad into a compiled shape) or buy (compile the call's own) for each call."""

  def __init__(self, call_overhead: int = 0, fits=prefill_fits):
    self.call_overhead = call_overhead  # size units a call costs beyond its own
    self.fits = fits
    self.compiled: set[Shape] = set()
    self.debt: collections.Counter[Shape] = collections.Counter()  # seconds of padding so far
    self.rented = 0  # calls that ran in a bigger compiled shape
    self._compile_seconds: list[float] = []
    self._run_seconds = 0.0
    self._run_positions = 0
    self._timed: collections.Counter[Shape] = collections.Counter()

  @property
  def compile_seconds(self) -> float | None:
    """Mean measured cost of compiling a new shape (None before one was measured)."""
    s = self._compile_seconds
    return sum(s) / len(s) if s else None

  @property
  def position_seconds(self) -> float | None:
    """Measured seconds per computed position (None before a run was timed)."""
    return self._run_seconds / self._run_positions if self._run_positions else None

  def choose(self, wanted: Shape, repeats: int = 1) -> Shape:
    """The shape this call runs in: `wanted` when compiled (or when nothing is measured
    yet), else the cheapest compiled one that fits while its debt allows (`repeats`:
    the steps a decode call runs at most, each paying the padding)."""
    if wanted in self.compiled:
      return wanted
    compile_s, per_position = self.compile_seconds, self.position_seconds
    candidates = [s for s in self.compiled if self.fits(s, wanted)]
    if compile_s is None or per_position is None or not candidates:
      return wanted
    best = min(candidates, key=lambda s: (size(s), s))
    extra = (size(best) - size(wanted)) * per_position * repeats
    if self.debt[wanted] + extra >= compile_s:
      return wanted
    self.debt[wanted] += extra
    self.rented += 1
    return best

  def observe_compile(self, shape: Shape, seconds: float) -> None:
    """`shape` was compiled by a call whose dispatch took `seconds` (trace, lowering,
    compile: the run itself is asynchronous)."""
    self.compiled.add(shape)
    self.debt.pop(shape, None)
    self._compile_seconds.append(max(float(seconds), 0.0))

  def wants_timing(self, shape: Shape) -> bool:
    return self._timed[shape] < TIMED_RUNS_PER_SHAPE

  def observe_run(self, shape: Shape, seconds: float, repeats: int = 1) -> None:
    """A call of `shape` ran in `seconds` (from dispatch to its result on the device),
    `repeats` steps of it (decode)."""
    self.compiled.add(shape)
    self._timed[shape] += 1
    self._run_seconds += max(float(seconds), 0.0)
    self._run_positions += (size(shape) + self.call_overhead) * max(int(repeats), 1)
