"""Controller fixtures: a hand-computable mock vocabulary and a tiny random Llama.

Mock vocabulary (20 tokens): chains are written as edges a -> b with a logit
(every other entry of the row is 0), so with a 20-token vocabulary
P(b | a) = e^x / (e^x + 19): x=5 -> 0.88650, x=8 -> 0.99364.
"""

import dataclasses

import numpy as np
import pytest

from o1jax.controller import Controller
from o1jax.controller.testing import MockDecodeModel, MockTokenizer

VOCAB = ["", "<s>", "</s>", "\n\n", " A", " B", " C", " D", " bad", "The answer is", " 7", " 3",
         " Wait", "Q", " check:", " ", " Yes", " No", ".", " E"]
ID = {s: i for i, s in enumerate(VOCAB)}


def p_edge(x: float, v: int = len(VOCAB)) -> float:
  """P(b | a) for an edge of logit x in a row that is 0 elsewhere."""
  return float(np.exp(x) / (np.exp(x) + v - 1))


@dataclasses.dataclass
class MockWorld:
  edges: list
  triggers: list = dataclasses.field(default_factory=list)  # (token, {token: boost})
  vocab: list = dataclasses.field(default_factory=lambda: list(VOCAB))

  def model(self) -> MockDecodeModel:
    v = len(self.vocab)
    ids = {s: i for i, s in enumerate(self.vocab)}
    table = np.zeros((v, v), np.float32)
    for a, b, x in self.edges:
      table[ids[a], ids[b]] = x
    trig = [ids[t] for t, _ in self.triggers]
    boosts = np.zeros((len(self.triggers), v), np.float32)
    for k, (_, bo) in enumerate(self.triggers):
      for tok, x in bo.items():
        boosts[k, ids[tok]] = x
    return MockDecodeModel(table, trig, boosts)

  def controller(self, **kw) -> Controller:
    return Controller(self.model(), MockTokenizer(self.vocab), **kw)


@pytest.fixture
def world():
  return MockWorld


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
  """A tiny random Llama (byte vocabulary) wrapped as a DecodeModel, and its tokenizer."""
  from o1jax.checkpoint import load_checkpoint
  from o1jax.controller import ContiguousLlama
  from o1jax.model import Llama
  from o1jax.testing import tiny_config, write_hf_checkpoint

  path = tmp_path_factory.mktemp("tiny_controller")
  write_hf_checkpoint(path, tiny_config(max_context=512), seed=5)
  ck = load_checkpoint(path)
  params = dict(ck.params)
  params["embed"] = np.asarray(params["embed"]) * 0.05  # soft logits: sampling really samples
  return ContiguousLlama(Llama(ck.config, params)), ck.tokenizer


def docs_example_policy() -> str:
  """The policy module of docs/controller.md's worked example, as the docs print it."""
  import pathlib
  text = (pathlib.Path(__file__).resolve().parents[3] / "docs" / "controller.md").read_text()
  start = text.index("```python\n", text.index("## Adding a policy")) + len("```python\n")
  return text[start:text.index("\n```", start) + 1]
