"""Chat with a model from the terminal, streaming the answer.

  python -m o1jax.generate --prompt "What is 12 times 7?"
  python -m o1jax.generate --model path/to/model.gguf --temperature 0.7 --seed 3 --prompt "..."
  python -m o1jax.generate --model gemma3-270m --raw --prompt "The capital of France is"
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from o1jax.checkpoint import EMBEDDED, CheckpointError, load_checkpoint
from o1jax.compilation_cache import enable_compilation_cache
from o1jax.model import Generator, Llama, SamplingParams
from o1jax.model.layers import MATMUL_DTYPES
from pallas_kernels.ops import check_backend_runs_here


def build_generator(model: str = EMBEDDED, backend: str = "auto", interpret: bool = False,
                    matmul_dtype: str = "float32") -> Generator:
  try:
    check_backend_runs_here(backend, interpret)
  except ValueError as e:
    raise ValueError(f"--{e}") from None
  ckpt = load_checkpoint(model)
  return Generator(Llama(ckpt.config, ckpt.params, backend=backend, interpret=interpret,
                         matmul_dtype=matmul_dtype), ckpt.tokenizer)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--prompt", required=True, help="the user message")
  parser.add_argument("--system", default=None, help="optional system message")
  parser.add_argument("--raw", action="store_true", help="send the prompt as-is, without the chat template")
  parser.add_argument("--model", default=EMBEDDED, help="'embedded' (SmolLM2-135M), 'gemma3-270m', a .gguf file, "
                      "an HF or orbax directory")
  parser.add_argument("--max_new_tokens", type=int, default=256)
  parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
  parser.add_argument("--top_k", type=int, default=0)
  parser.add_argument("--top_p", type=float, default=1.0)
  parser.add_argument("--min_p", type=float, default=0.0)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--backend", default="auto", choices=("auto", "pallas", "reference"))
  parser.add_argument("--matmul_dtype", default="float32", choices=MATMUL_DTYPES,
                      help="float32 = exact; int8 = the fast CPU mode (see the README)")
  args = parser.parse_args(argv)

  enable_compilation_cache()
  try:
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            min_p=args.min_p, seed=args.seed)
    t0 = time.perf_counter()
    gen = build_generator(args.model, args.backend, matmul_dtype=args.matmul_dtype)
    load_s = time.perf_counter() - t0
    if args.raw:
      prompt = args.prompt
    else:
      messages = ([{"role": "system", "content": args.system}] if args.system else [])
      prompt = messages + [{"role": "user", "content": args.prompt}]
    prompt_ids = gen.encode_prompt(prompt)
    printed, tokens = "", []
    t_start = time.perf_counter()
    t_first = None
    room = gen.config.max_context - len(prompt_ids)
    if args.max_new_tokens > room:  # (the generator stops at the context's end anyway)
      print(f"note: --max_new_tokens {args.max_new_tokens} is more than the {room} tokens the "
            f"model's context has left after the prompt: at most {room} are generated",
            file=sys.stderr)
    stopped = None
    try:
      for tok in gen.stream(prompt_ids, args.max_new_tokens, params):
        t_first = t_first or time.perf_counter()
        tokens.append(tok)
        text = gen.tokenizer.decode(tokens, skip_special=True)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
          sys.stdout.write(text[len(printed):])
          sys.stdout.flush()
          printed = text
    except KeyboardInterrupt:  # Ctrl-C: the answer so far stays, with its numbers
      stopped = "stopped by Ctrl-C"
    t_end = time.perf_counter()
  except (CheckpointError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:  # while loading: nothing to show
    print("\nstopped by Ctrl-C", file=sys.stderr)
    return 130
  except BrokenPipeError:  # the reader went away (`| head`): stop quietly, as shell tools do
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 141
  try:
    print()
  except BrokenPipeError:
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 141
  decode_s = t_end - (t_first or t_end)
  rate = (len(tokens) - 1) / decode_s if len(tokens) > 1 and decode_s > 0 else float("nan")
  print(f"[{len(prompt_ids)} prompt tokens, {len(tokens)} generated; load {load_s:.1f}s, "
        f"first token {(t_first or t_end) - t_start:.2f}s (incl. compile), decode {rate:.1f} tok/s]",
        file=sys.stderr)
  if stopped:
    print(f"[{stopped}]", file=sys.stderr)
    return 130
  return 0


if __name__ == "__main__":
  sys.exit(main())
