"""`token_texts`: each token's text as it reads inside a text. Decoders that drop the space
a text starts with (Llama-2's Strip, Metaspace) drop it from a token decoded alone; the
controller's per-token tables (answer keys, step delimiters) need the text in context."""

import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from o1jax.checkpoint.tokenizer import Tokenizer, token_texts
from o1jax.controller.testing import MockTokenizer

PIECES = ["<unk>", "<s>", "</s>", "\u2581Q", "\u2581The", "\u2581answer", "\u2581is", "\u25815",
          "\u25816", "5", "6", ".", "\u2581", "\n\n", "a", "\u2581-", "<0xE2>"]
DECODERS = {
    "strip": decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                decoders.Fuse(), decoders.Strip(" ", 1, 0)]),
    "metaspace": decoders.Metaspace(replacement="\u2581", prepend_scheme="first"),
    "no_strip": decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                   decoders.Fuse()]),
}


def spm_tokenizer(decoder: str) -> Tokenizer:
  backend = tokenizers.Tokenizer(models.WordLevel({t: i for i, t in enumerate(PIECES)},
                                                  unk_token="<unk>"))
  backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
  backend.decoder = DECODERS[decoder]
  backend.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in PIECES[:3]])
  return Tokenizer(backend, bos_id=1, eos_ids=[2])


@pytest.mark.parametrize("decoder", sorted(DECODERS))
def test_texts_joined_are_the_text(decoder):
  """After any token, the texts of the tokens that follow make up the decoded text."""
  tok = spm_tokenizer(decoder)
  texts = token_texts(tok)
  five = PIECES.index("\u25815")
  assert texts[five] == " 5"
  if decoder != "no_strip":  # the premise: alone, the token loses its space
    assert tok.decode([five]) == "5"
  rng = np.random.default_rng(0)
  for _ in range(300):
    seq = [int(i) for i in rng.integers(3, len(PIECES), size=int(rng.integers(1, 8)))]
    for first in range(len(PIECES)):
      head = tok.decode([first])
      text = tok.decode([first] + seq)
      if text.startswith(head):
        assert text == head + "".join(texts[i] for i in seq), (first, seq)


def test_word_suffix_decoders_give_the_space_to_the_word_it_ends():
  """BPEDecoder("</w>") (GPT-1/CLIP style): a word's last piece carries the space after
  it, dropped at the end of a text; joined, the texts are the text (and that space)."""
  pieces = ["<unk>", "5</w>", "6</w>", "5", "6", "c", "a</w>", ".</w>"]
  backend = tokenizers.Tokenizer(models.WordLevel({t: i for i, t in enumerate(pieces)},
                                                  unk_token="<unk>"))
  backend.decoder = decoders.BPEDecoder(suffix="</w>")
  tok = Tokenizer(backend, bos_id=None, eos_ids=[])
  texts = token_texts(tok)
  assert tok.decode([1, 2]) == "5 6" and [tok.decode([1]), tok.decode([2])] == ["5", "6"]
  assert texts[1] == "5 " and texts[3] == "5"
  rng = np.random.default_rng(1)
  for _ in range(300):
    seq = [int(i) for i in rng.integers(1, len(pieces), size=int(rng.integers(1, 8)))]
    text, joined = tok.decode(seq), "".join(texts[i] for i in seq)
    assert joined in (text, text + " "), seq


def test_special_tokens_follow_skip_special():
  tok = spm_tokenizer("strip")
  assert token_texts(tok, skip_special=True)[2] == ""
  assert token_texts(tok, skip_special=False)[2] == "</s>"


def test_byte_level_and_plain_vocabularies_are_unchanged(tiny_tokenizer):
  for tok in (tiny_tokenizer, MockTokenizer(["", "<s>", "</s>", " 5", "5", "x"])):
    for skip in (False, True):
      assert token_texts(tok, skip_special=skip) == [
          tok.decode([i], skip_special=skip) for i in range(tok.vocab_size)]


@pytest.fixture
def tiny_tokenizer(tmp_path):
  from o1jax.checkpoint import load_checkpoint
  from o1jax.testing import tiny_config, write_hf_checkpoint
  write_hf_checkpoint(tmp_path, tiny_config(), seed=0)
  return load_checkpoint(tmp_path).tokenizer


def test_a_gguf_added_token_decodes_as_text_and_a_control_token_does_not(tmp_path):
  """llama.cpp prints USER_DEFINED tokens (Qwen's <tool_call>, <think>) and transformers
  keeps its non-special added tokens when skipping specials; they were dropped from the
  engine's text (skip_special) like control tokens."""
  from o1jax import testing
  from o1jax.checkpoint import load_checkpoint
  config = testing.tiny_config(vocab_size=len(testing.SPECIAL_TOKENS) + 257)
  path = tmp_path / "added.gguf"
  testing.write_gguf_checkpoint(path, config, added_tokens=("<tool_call>",))
  tok = load_checkpoint(path).tokenizer
  ids = tok.encode("a<tool_call>b<|im_end|>")
  assert len(ids) == 4  # both matched whole in the text
  assert tok.decode(ids, skip_special=True) == "a<tool_call>b"
  assert tok.decode(ids) == "a<tool_call>b<|im_end|>"
