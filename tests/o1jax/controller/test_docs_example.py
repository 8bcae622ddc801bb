"""The worked example of docs/controller.md runs as written on the mock model."""

import dataclasses
from typing import ClassVar

from o1jax.controller import POLICIES, Policy, majority_vote, register
from tests.o1jax.controller.conftest import MockWorld


@register
@dataclasses.dataclass(frozen=True)
class GreedyThenVote(Policy):
  """Greedy first; below `min_logprob` mean log-prob, n more samples and a vote."""

  name: ClassVar[str] = "greedy_then_vote"
  n: int = 4
  min_logprob: float = -0.5
  temperature: float = 0.7  # for the extra samples

  @property
  def traces_per_call(self) -> int:  # its largest generate call (sized at load)
    return self.n

  def run(self, ctl, requests):
    first = ctl.generate(requests, self.settings(temperature=0.0), 1)
    out = []
    for i, req in enumerate(requests):
      greedy = first.traces[i][0]
      wall, calls = first.wall_time_s[i], first.invocations[i]
      if greedy.mean_logprob >= self.min_logprob:
        out.append(ctl.result(req, self.name, [greedy], 0, greedy.answer, wall, calls))
        continue
      more = ctl.generate([req], self.settings(), self.n, sample_offset=1)
      traces = [greedy] + more.traces[0]
      answer, votes = majority_vote([t.answer for t in traces])
      chosen = next((j for j, t in enumerate(traces) if t.answer == answer), None)
      out.append(ctl.result(req, self.name, traces, chosen, answer, wall + more.wall_time_s[0],
                            calls + more.invocations[0], votes))
    return out


EDGES = [("Q", " A", 5), (" A", "The answer is", 5), ("The answer is", " 7", 5), (" 7", "</s>", 5)]


def test_greedy_then_vote_by_name():
  assert POLICIES["greedy_then_vote"] is GreedyThenVote
  ctl = MockWorld(EDGES).controller()
  sure, = ctl.run(["Q"], {"name": "greedy_then_vote", "min_logprob": -0.5})
  assert len(sure.traces) == 1 and sure.answer == "7"  # mean log p = log 0.8865 = -0.12
  unsure, = ctl.run(["Q"], {"name": "greedy_then_vote", "n": 3, "min_logprob": -0.01})
  assert len(unsure.traces) == 4 and unsure.loop_invocations == 2
  assert [t.sample_index for t in unsure.traces] == [0, 1, 2, 3]
  ctl.check_policy_fits(GreedyThenVote(n=3))  # what a pipeline worker checks at load
