"""o1jax's GGUF BPE tokenizers against llama.cpp's, one pre-tokenizer at a time.

Needs llama-cpp-python (the `reference` extra). For each `tokenizer.ggml.pre` name o1jax
reads, a vocabulary-only GGUF holds the 256 byte-level symbols plus a merge for every
pair of them (65536), so a token spans two bytes exactly when they are in the same
pre-token: the split shows in the ids, also next to multi-byte characters; plus a few
whole words no merge reaches, which a pre-tokenizer with llama.cpp's ignore_merges
(llama3, tekken) takes as one token when a pre-token equals one.
Both tokenizers encode the same texts (contractions, case runs, digit runs, whitespace and
newlines, punctuation, non-ASCII letters, CJK, emoji); the ids must be equal.

llama.cpp's own regexes approximate some of the models' originals (tekken, gpt-4o: its
engine lacks the Unicode case classes, so any letter outside a-z counts as upper case);
o1jax uses the original regexes (the models' tokenizer.json), so the two may differ on
non-ASCII letters there, and the report says where.

  python scripts/check_tokenizers_llamacpp.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from llamacpp_common import require_llama_cpp  # noqa: E402
from script_args import output_file  # noqa: E402

TEXTS = [
    "Hello World's 12345 IT'S\n\n  x",
    "CamelCaseWordsAndHTTPServer parseJSON2XML",
    "don't DON'T I'm we'll they'd You'RE",
    "numbers 1234567 3.14159 1,000,000 x2y22z333",
    "tabs\tand\r\nCRLF\r\n\r\nend",
    "  leading and trailing  ",
    "path/to/file.py\n//comment\n/*x*/",
    "a--b...c!!!? (x) [y] {z} <w>",
    "x\n\n\ny\n \n z",
    "def f(x):\n    return x**2  # square\n",
    "'quoted' \"double\" `tick`",
    "émigré Straße ΩΣω café naïve ÉCOLE",
    "日本語のテキスト、句読点。",
    "emoji 😀👍 mixed😀text",
    "abÉcd naÏve ÀBCdef xÖy ǅungla Ǆ",  # non-ASCII case changes (Lu, Lt) beside ASCII
]
PRE_NAMES = ("smollm", "gpt-2", "llama-bpe", "qwen2", "deepseek-r1-qwen", "tekken", "gpt-4o",
             "smaug-bpe", "dbrx")


def _vocab():
  from o1jax import testing
  from tokenizers import pre_tokenizers
  base = testing.byte_vocab()
  symbols = sorted(pre_tokenizers.ByteLevel.alphabet())  # all 256 byte-level symbols
  merges = [f"{a} {b}" for a in symbols for b in symbols]
  # Whole words no merge reaches (merges make 2-byte tokens only): taken as one token by
  # the pre-tokenizers that look a pre-token up before merging (llama.cpp's ignore_merges).
  words = ["Hello", "ĠWorld", "Camel", "Case", "Ġdon", "Ġthe", "Ġtext", "abc", "ĠHTTP", "ĠIT"]
  tokens = base + [a + b for a in symbols for b in symbols] + words
  types = [3] * len(testing.SPECIAL_TOKENS) + [1] * (len(tokens) - len(testing.SPECIAL_TOKENS))
  return tokens, merges, types


def _write_vocab_gguf(path: pathlib.Path, pre: str, tokens, merges, types) -> dict:
  import gguf
  writer = gguf.GGUFWriter(str(path), "llama")
  writer.add_block_count(1)
  writer.add_context_length(64)
  writer.add_embedding_length(64)
  writer.add_feed_forward_length(128)
  writer.add_head_count(4)
  writer.add_head_count_kv(4)
  writer.add_layer_norm_rms_eps(1e-5)
  writer.add_vocab_size(len(tokens))
  writer.add_tokenizer_model("gpt2")
  writer.add_tokenizer_pre(pre)
  writer.add_token_list(tokens)
  writer.add_token_merges(merges)
  writer.add_token_types(types)
  writer.add_bos_token_id(1)
  writer.add_eos_token_id(2)
  writer.add_add_bos_token(False)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
          "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges,
          "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1,
          "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.add_bos_token": False}


def check(work: pathlib.Path, names=PRE_NAMES) -> list[dict]:
  import llama_cpp
  from o1jax.checkpoint import Tokenizer

  tokens, merges, types = _vocab()
  rows = []
  for pre in names:
    path = work / f"vocab-{pre}.gguf"
    meta = _write_vocab_gguf(path, pre, tokens, merges, types)
    ours = Tokenizer.from_gguf_metadata(meta, path)
    theirs = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    differ = []
    for text in TEXTS:
      a = ours.encode(text, add_bos=False)
      b = theirs.tokenize(text.encode("utf-8"), add_bos=False, special=False)
      if a != b:
        differ.append({"text": text, "o1jax": [tokens[i] for i in a],
                       "llama.cpp": [tokens[i] for i in b]})
    rows.append({"pre": pre, "texts": len(TEXTS), "equal": len(TEXTS) - len(differ),
                 "differ": differ})
    print(f"{pre:18s} {len(TEXTS) - len(differ)}/{len(TEXTS)} texts give the same ids", flush=True)
    for d in differ:
      print(f"    {d['text']!r}\n      o1jax     {d['o1jax']}\n      llama.cpp {d['llama.cpp']}")
  return rows


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--json", type=output_file, default=None)
  parser.add_argument("--pre", default=",".join(PRE_NAMES))
  args = parser.parse_args(argv)
  if not require_llama_cpp():
    return 2
  with tempfile.TemporaryDirectory() as tmp:
    rows = check(pathlib.Path(tmp), [p for p in args.pre.split(",") if p])
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(rows, indent=2, ensure_ascii=False) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
