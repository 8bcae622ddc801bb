#!/usr/bin/env python3
"""Record llama.cpp's tokenizer ids and teacher-forced logits for the gemma3-270m model.

Runs outside the project's environment needs only `llama-cpp-python` importable, e.g.

  CMAKE_BUILD_PARALLEL_LEVEL=2 pip install --target /tmp/refsite llama-cpp-python==0.3.36
  PYTHONPATH=/tmp/refsite .venv/bin/python scripts/record_llamacpp_gemma3_fixture.py

The GGUF is the one `load_checkpoint("gemma3-270m")` reads (`make gemma3`), or --gguf.
Writes tests/fixtures/llamacpp_gemma3.json: for each tokenizer text, llama.cpp's ids
(add_bos=False, special=True); for each prompt (with <bos>, as llama.cpp adds it), the
top-5 (id, logit) at every position, teacher-forced on the prompt's own tokens. The long
prompt (> 512 tokens) makes the local layers' window cut in. Loaded as in
record_llamacpp_fixture.py: f32 KV cache, no flash attention, no extra buffer types.
"""

import argparse
import json
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO_ROOT, "tests", "fixtures", "llamacpp_gemma3.json")
sys.path.insert(0, REPO_ROOT)

TOKENIZER_TEXTS = [
    "Hello world", "The answer is 42.", "  two leading spaces", "tabs\tand\nnewlines\n\n\nend",
    "ünïcödé — “quotes” and emoji 🙂🚀", "日本語のテキスト", "x=3*(y+2)**2; print(f'{x!r}')",
    "<start_of_turn>user\nWhat is 12 times 7?<end_of_turn>\n<start_of_turn>model\n",
    "trailing space ", "a" * 40, "mixed CASE WoRdS and 1234567890 digits", "<b>bold</b> html",
    "   three   spaces   between   ", "line one\r\nline two", "Zürich, Köln, Łódź", "😀🎉👍🏽 ok",
    "def f(x):\n    return x * 2\n", "1,234,567.89 and -0.5e-3", "",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in "
    "May. How many clips did Natalia sell altogether in April and May?",
]
PROMPTS = {
    "france": "The capital of France is",
    "story": "Once upon a time, in a small village by the sea, there lived",
    "code": "def fibonacci(n):\n    ",
    # ~600 tokens: past the 512-token window of the local layers
    "long": " ".join(f"Item {i}: the number {i * 7 % 101} is written here." for i in range(50)),
}
TOPK = 5


def topk(row, k):
  import numpy as np
  idx = np.argsort(-row)[:k]
  return [[int(i), round(float(row[i]), 5)] for i in idx]


def main():
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("--gguf", default=None)
  ap.add_argument("--out", default=DEFAULT_OUT)
  args = ap.parse_args()
  # llama.cpp's OpenMP threads spin while they wait: on a busy machine with 2 cores a token
  # took ~3 s instead of 0.05 (the numbers are the same either way).
  os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
  import numpy as np
  import llama_cpp
  from llama_cpp import Llama

  from llamacpp_common import disable_extra_buffer_types
  disable_extra_buffer_types()
  if args.gguf is None:
    from o1jax.checkpoint.embedded import named_model_path
    args.gguf = str(named_model_path("gemma3-270m"))
  kwargs = dict(model_path=args.gguf, n_ctx=1024, n_batch=1024, n_ubatch=1024, n_threads=2,
                n_threads_batch=2, logits_all=True, verbose=False, flash_attn=False)
  if hasattr(llama_cpp, "GGML_TYPE_F32"):
    kwargs["type_k"] = kwargs["type_v"] = llama_cpp.GGML_TYPE_F32
  llm = Llama(**kwargs)
  tokenizer = [{"text": t, "ids": llm.tokenize(t.encode("utf-8"), add_bos=False, special=True)}
               for t in TOKENIZER_TEXTS]
  prompts = []
  for name, text in PROMPTS.items():
    ids = llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)
    llm.reset()
    llm.eval(ids)
    scores = np.array(llm.scores[:len(ids)], dtype=np.float32)
    prompts.append({"name": name, "text": text, "ids": ids,
                    "top5_per_position": [topk(s, TOPK) for s in scores]})
  out = {"gguf": os.path.basename(args.gguf),
         "llama_cpp_python": getattr(llama_cpp, "__version__", "unknown"),
         "settings": "CPU, n_threads=2, f32 KV cache, flash attention off, use_extra_bufts=False, "
                     "logits_all; ids with special=True; prompts with add_bos=True",
         "tokenizer": tokenizer, "prompts": prompts}
  with open(args.out, "w") as f:
    json.dump(out, f, ensure_ascii=False, indent=1)
  print(f"wrote {args.out}: {len(tokenizer)} tokenizer cases, {len(prompts)} prompts")


if __name__ == "__main__":
  main()
