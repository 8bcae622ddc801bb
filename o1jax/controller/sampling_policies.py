"""Plain sampling policies: independent samples per example, each drawn by the engine.

  policy = build_policy({"name": "sample_n", "n": 8, "temperature": 0.7})
  policy.num_samples            # 8 work items per example
  policy.sampling(base, 3)      # the SamplingSpec of sample 3

The pipeline makes `num_samples` work items per example, samples each with its
`SamplingSpec` (the engine or generator predictor), scores them, and with `vote`
takes the majority of the extracted answers (HumanEval: pass@k for every k <= n).
The reasoning controller's policies (policies.py) share their namespace (registry.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from o1jax.controller.registry import MAX_SAMPLES, BasePolicy, register
from o1jax.model.sampling import Sampling, SamplingParams, check_int


@dataclasses.dataclass(frozen=True)
class SamplingSpec(SamplingParams):
  """Decoding settings of one sample (`SamplingParams` + its token budget); `seed` and the
  work key fix its random stream."""
  max_new_tokens: int = 256

  def __post_init__(self):
    super().__post_init__()
    # (< 1: the engine would refuse every request, one by one)
    check_int(self.max_new_tokens, "max_new_tokens", 1)

  def to_dict(self) -> dict[str, Any]:
    """The sample's record (and a controller policy's content hash: `sample_identity` is
    plain decoding's); min_p only when set (it is not a config setting)."""
    out = {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
           "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed}
    if self.min_p:
      out["min_p"] = self.min_p
    return out

  def sample_identity(self) -> dict[str, Any]:
    """What of it can change a plainly decoded sample (its content key): at temperature 0
    the draw is the argmax whatever the seed and the filters (a seed changed for a greedy
    run computed every sample again, to the same text)."""
    out = self.to_dict()
    if self.temperature == 0:
      for name in ("seed", "top_p", "top_k", "min_p"):
        out.pop(name, None)
    return out


@register
@dataclasses.dataclass(frozen=True)
class Greedy(BasePolicy):
  """One sample per example with the config's sampling (temperature 0 by default)."""
  name: ClassVar[str] = "greedy"

  @property
  def num_samples(self) -> int:
    return 1


@register
@dataclasses.dataclass(frozen=True)
class SampleN(BasePolicy):
  """`n` independent samples at `temperature`; every k <= n is scored (pass@k, vote)."""
  name: ClassVar[str] = "sample_n"
  vote: ClassVar[bool] = True
  own_sampling: ClassVar[tuple[str, ...]] = ("temperature", "top_p", "top_k")
  n: int = 4
  temperature: float = 0.7
  top_p: float = 0.95
  top_k: int = 0

  def __post_init__(self):
    # Work items per example: a count, at most MAX_SAMPLES (a million took the launcher
    # minutes of silence to plan, before any sample ran).
    check_int(self.n, f"policy {self.name}: n", 1, MAX_SAMPLES)
    try:  # the sampling it gives every sample, checked once here
      Sampling(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)
    except ValueError as e:
      raise ValueError(f"policy {self.name}: {e}") from None
    if self.temperature <= 0 and self.n > 1:
      # n greedy samples would be n copies of the same text.
      raise ValueError(f"policy {self.name}: n={self.n} samples need temperature > 0")
    if self.top_k == 1 and self.n > 1:  # (the argmax alone: greedy too)
      raise ValueError(f"policy {self.name}: n={self.n} samples need top_k != 1 (top_k=1 "
                       f"draws the most likely token only)")

  @property
  def num_samples(self) -> int:
    return self.n

  def sample_identity(self) -> dict[str, Any]:
    """Not `n`: sample i is drawn from the seed, the request and i whatever n is (n=8 after
    n=4 computes samples 4-7 only)."""
    return {k: v for k, v in self.to_dict().items() if k != "n"}

  def sampling(self, base: SamplingSpec, sample_index: int) -> SamplingSpec:
    del sample_index  # the work key, not the seed, separates samples
    return dataclasses.replace(base, temperature=self.temperature, top_p=self.top_p,
                               top_k=self.top_k)
