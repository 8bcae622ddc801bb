"""GGUF pre-tokenizers of Llama 3 and Qwen2/Qwen3 (llama.cpp's names), split by hand."""

import pytest

from o1jax import testing
from o1jax.checkpoint import CheckpointError, Tokenizer
from o1jax.checkpoint.tokenizer import _byte_level_pre

TEXT = "Hello World's 12345 IT'S\n\n  x"
# The GPT-4-style split both use: case-insensitive contractions, a letter run with one
# leading non-letter, newlines apart from other whitespace, a space left alone before a
# digit; the two differ in digits (Qwen: one each; Llama 3: up to three). Byte-level
# symbols: 'Ġ' is a space, 'Ċ' a newline.
WORDS = ["Hello", "ĠWorld", "'s", "Ġ", "ĠIT", "'S", "ĊĊ", "Ġ", "Ġx"]
DIGITS = {"qwen2": ["1", "2", "3", "4", "5"], "llama-bpe": ["123", "45"]}


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe"])
def test_split_by_hand(pre):
  got = [w for w, _ in _byte_level_pre(pre, "x").pre_tokenize_str(TEXT)]
  assert got == WORDS[:4] + DIGITS[pre] + WORDS[4:]


def test_qwen2_tokenizer_from_gguf_metadata_round_trips():
  meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2",
          "tokenizer.ggml.tokens": testing.byte_vocab(), "tokenizer.ggml.merges": [],
          "tokenizer.ggml.token_type": [3] * len(testing.SPECIAL_TOKENS) + [1] * 256}
  tok = Tokenizer.from_gguf_metadata(meta)
  text = "<|im_start|>user\nWhat is 12+30?<|im_end|>"
  ids = tok.encode(text)
  assert ids[0] == testing.SPECIAL_TOKENS.index("<|im_start|>") and tok.decode(ids) == text


def test_unknown_pre_tokenizer_is_named():
  with pytest.raises(CheckpointError, match="pre-tokenizer 'tekken' is not supported"):
    _byte_level_pre("tekken", "m.gguf")
