"""The worked example of docs/controller.md runs as written on the mock model."""

import pytest

from o1jax.controller import POLICIES
from tests.o1jax.controller.conftest import MockWorld, docs_example_policy

_EXAMPLE = {}
exec(compile(docs_example_policy(), "docs/controller.md", "exec"), _EXAMPLE)  # registers it
GreedyThenVote = _EXAMPLE["GreedyThenVote"]


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


def test_a_bad_n_fails_when_the_policy_is_built():
  with pytest.raises(ValueError, match=r"^greedy_then_vote: n must be an int >= 1, got 0$"):
    GreedyThenVote(n=0)
