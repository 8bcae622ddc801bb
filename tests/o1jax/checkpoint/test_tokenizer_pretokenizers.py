"""GGUF pre-tokenizers (llama.cpp's names) split by hand and against Python's `regex` running
the models' own patterns. scripts/check_tokenizers_llamacpp.py compares whole tokenizers
with llama.cpp's (docs/measurements/2026-12-04_tokenizers_vs_llamacpp.json)."""

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
  with pytest.raises(CheckpointError, match="pre-tokenizer 'viking' is not supported"):
    _byte_level_pre("viking", "m.gguf")


CASE_TEXT = "CamelCaseHTTPServer don't 12345 a/b.py/\nx naÏve"
# Tekken (Mistral) and o200k (gpt-4o, Phi-4): words split where lower case turns upper;
# a "/" stays with the punctuation before it; Ï is upper case (Lu), so "naÏve" splits.
CASE_SPLITS = {
    "tekken": ["Camel", "Case", "HTTPServer", "Ġdon", "'t", "Ġ", "1", "2", "3", "4", "5", "Ġa",
               "/b", ".py", "/Ċ", "x", "Ġna", "Ãıve"],
    "gpt-4o": ["Camel", "Case", "HTTPServer", "Ġdon't", "Ġ", "123", "45", "Ġa", "/b", ".py",
               "/Ċ", "x", "Ġna", "Ãıve"],
}


@pytest.mark.parametrize("pre", sorted(CASE_SPLITS))
def test_case_splitting_pre_tokenizers_by_hand(pre):
  assert [w for w, _ in _byte_level_pre(pre, "x").pre_tokenize_str(CASE_TEXT)] == CASE_SPLITS[pre]


# The patterns as the models' tokenizer.json files write them (Mistral's tekken; o200k).
_U, _L = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_C = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
ORIGINAL = {
    "tekken": rf"[^\r\n\p{{L}}\p{{N}}]?{_U}*{_L}+|[^\r\n\p{{L}}\p{{N}}]?{_U}+{_L}*|\p{{N}}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "gpt-4o": rf"[^\r\n\p{{L}}\p{{N}}]?{_U}*{_L}+{_C}|[^\r\n\p{{L}}\p{{N}}]?{_U}+{_L}*{_C}"
              r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
TEXTS = [CASE_TEXT, TEXT, "émigré Straße ΩΣω ÉCOLE ǅungla", "tabs\tand\r\nCRLF  x\n\n\ny",
         "I'M you'RE x2y22z333 3.14159 1,000", "日本語のテキスト、句読点。😀👍mixed", "a--b...c!!!?"]


@pytest.mark.parametrize("pre", sorted(ORIGINAL))
def test_splits_equal_python_regex_on_the_original_pattern(pre):
  regex = pytest.importorskip("regex")
  from tokenizers import pre_tokenizers
  as_bytes = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  for text in TEXTS:
    want = [as_bytes.pre_tokenize_str(w)[0][0] for w in regex.findall(ORIGINAL[pre], text)]
    assert [w for w, _ in _byte_level_pre(pre, "x").pre_tokenize_str(text)] == want, text


@pytest.mark.parametrize("alias, same_as", [("smaug-bpe", "llama-bpe"), ("dbrx", "llama-bpe")])
def test_aliases_split_as_llama3(alias, same_as):
  for text in TEXTS:
    assert (_byte_level_pre(alias, "x").pre_tokenize_str(text)
            == _byte_level_pre(same_as, "x").pre_tokenize_str(text))


@pytest.mark.parametrize("pre, whole", [("llama-bpe", True), ("tekken", True), ("qwen2", False),
                                        ("gpt-4o", False), ("smollm", False)])
def test_a_pre_token_in_the_vocabulary_is_one_token_where_llama_cpp_ignores_merges(pre, whole):
  # "abc" is a token no merge makes (only "a b"); llama.cpp's llama3 and tekken look a
  # pre-token up whole before merging (ignore_merges), the others merge from bytes.
  # Before: "abc" came out as "ab", "c" for every pre-tokenizer.
  tokens = testing.byte_vocab() + ["ab", "abc"]
  meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
          "tokenizer.ggml.merges": ["a b"],
          "tokenizer.ggml.token_type": [3] * len(testing.SPECIAL_TOKENS) + [1] * (256 + 2)}
  tok = Tokenizer.from_gguf_metadata(meta)
  ids = tok.encode("abc", add_bos=False)
  assert [tokens[i] for i in ids] == (["abc"] if whole else ["ab", "c"])


@pytest.mark.parametrize("model, pre, key, bos", [
    ("gpt2", "llama-bpe", None, True), ("gpt2", "tekken", None, True), ("gpt2", "qwen2", None, False),
    ("gpt2", "smollm", None, False), ("gpt2", "llama-bpe", False, False), ("gpt2", "qwen2", True, True)])
def test_bos_default_follows_llama_cpp_where_the_gguf_has_no_add_bos_key(model, pre, key, bos):
  # Before: no key meant no BOS for every vocabulary; llama.cpp starts llama3 and tekken
  # vocabularies (and SentencePiece ones) with BOS unless the key says otherwise.
  meta = {"tokenizer.ggml.model": model, "tokenizer.ggml.pre": pre,
          "tokenizer.ggml.tokens": testing.byte_vocab(), "tokenizer.ggml.merges": [],
          "tokenizer.ggml.token_type": [3] * len(testing.SPECIAL_TOKENS) + [1] * 256,
          "tokenizer.ggml.bos_token_id": 1}
  if key is not None:
    meta["tokenizer.ggml.add_bos_token"] = key
  assert (Tokenizer.from_gguf_metadata(meta).encode("hi")[0] == 1) == bos


def test_default_pre_tokenizer_splits_as_llama_cpp_by_hand():
  """"default" (or no tokenizer.ggml.pre) is llama.cpp's four regexes in turn, not GPT-2's
  alone (which kept " 1234567" and " ..." whole)."""
  for pre in ("default", None):
    got = [w for w, _ in _byte_level_pre(pre, "x").pre_tokenize_str("abc 1234567 ... x!!")]
    assert got == ["abc", "Ġ", "123", "456", "7", "Ġ", "...", "Ġx", "!!"]


def _split_in_turn(regex, patterns, text):
  """llama.cpp's unicode_regex_split: each pattern splits every piece the one before left
  into its matches and the text between them."""
  pieces = [text]
  for pattern in patterns:
    out = []
    for piece in pieces:
      at = 0
      for m in regex.finditer(pattern, piece):
        out += [piece[at:m.start()]] if m.start() > at else []
        out.append(m.group())
        at = m.end()
      out += [piece[at:]] if at < len(piece) else []
    pieces = out
  return pieces


def test_default_pre_tokenizer_equals_python_regex_in_turn():
  regex = pytest.importorskip("regex")
  from tokenizers import pre_tokenizers
  as_bytes = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  patterns = [r"[\p{P}\$\+<=>\^~\|]+",
              r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
              r"\p{N}+", r"[0-9][0-9][0-9]"]
  for text in TEXTS + ["$100 + <b>=>^~|x</b> 12,345,678.90 don't", "١٢٣٤ ½ 12345\t\t x"]:
    want = [as_bytes.pre_tokenize_str(w)[0][0] for w in _split_in_turn(regex, patterns, text)]
    assert [w for w, _ in _byte_level_pre("default", "x").pre_tokenize_str(text)] == want, text


def test_end_of_generation_tokens_are_read_by_their_text_as_llama_cpp_does():
  """Every token whose text is an end-of-turn marker stops generation, whatever the
  metadata's eos id names (SmolLM2 names <|im_end|>; a base model writes <|endoftext|>;
  Gemma 3 names <eos> and ends its turns with <end_of_turn>), and the eom id is read. Such
  a token is a control token even when its type says otherwise (it is matched whole in
  text and left out of text decoded without special tokens)."""
  tokens = testing.byte_vocab() + ["<end_of_turn>", "<|eom_id|>", "<end_of_turn>x"]
  n = len(tokens)
  meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2",
          "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": [],
          "tokenizer.ggml.token_type": [3] * len(testing.SPECIAL_TOKENS) + [1] * (n - len(testing.SPECIAL_TOKENS)),
          "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.eom_token_id": n - 1}
  tok = Tokenizer.from_gguf_metadata(meta)
  by_text = sorted(i for i, t in enumerate(tokens) if t in (
      "<|im_end|>", "<|endoftext|>", "<end_of_turn>", "<|eom_id|>"))
  assert tok.eos_ids == (1, *sorted({n - 1, *by_text}))  # (the eos id first: its eos_token)
  assert tok.encode("hi<end_of_turn>", add_bos=False)[-1] == n - 3  # one token, not 13 bytes
  assert tok.decode(tok.encode("hi<end_of_turn>", add_bos=False), skip_special=True) == "hi"


def test_the_embedded_models_stop_on_every_end_of_turn_token():
  from o1jax.checkpoint import load_checkpoint, load_tokenizer
  smol = load_tokenizer("embedded")
  assert smol.eos_ids == (2, 0)  # <|im_end|> (what the metadata names), <|endoftext|>
  # (a template's {{ eos_token }} is the metadata's, not the first by id)
  assert smol.backend.id_to_token(smol.eos_ids[0]) == "<|im_end|>"
  assert load_checkpoint("embedded").tokenizer.eos_ids == smol.eos_ids
