"""A tiny random checkpoint and three questions: the real engine and controller in seconds."""

import json

import pytest

QUESTIONS = (("2+3?", "5"), ("7-1?", "6"), ("4*2?", "8"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  """A directory with `tiny.gguf` (o1jax.testing's tiny Llama, seed 0) and `q.jsonl`."""
  from o1jax.testing import tiny_config, write_gguf_checkpoint
  root = tmp_path_factory.mktemp("tiny")
  write_gguf_checkpoint(root / "tiny.gguf", tiny_config(), seed=0)
  (root / "q.jsonl").write_text("".join(json.dumps({"question": q, "answer": a}) + "\n"
                                        for q, a in QUESTIONS))
  return root
