"""Chat with a model from the terminal, streaming the answer (through the serving engine).

  python -m o1jax.generate --prompt "What is 12 times 7?"
  python -m o1jax.generate --model path/to/model.gguf --temperature 0.7 --seed 3 --prompt "..."
  python -m o1jax.generate --model gemma3-270m --raw --prompt "The capital of France is"
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import signal
import sys
import threading
import time

if __name__ == "__main__":  # before the imports below (~2 s): a Ctrl-C there is one line
  def _stopped_while_starting(signum, frame):
    # (a KeyboardInterrupt raised there could land in one of JAX's gc callbacks, where
    # Python ignores it: the whole answer was generated, exit 0)
    print("\nstopped by Ctrl-C", file=sys.stderr, flush=True)
    os._exit(128 + signum)

  signal.signal(signal.SIGINT, _stopped_while_starting)

from o1jax.checkpoint import EMBEDDED, CheckpointError, load_checkpoint
from o1jax.checkpoint.tokenizer import LONE_SURROGATE
from o1jax.compilation_cache import enable_compilation_cache
from o1jax.engine import Engine, EngineConfig, GenerationParams, Request
from o1jax.model import Llama
from o1jax.model.generation import encode_prompt
from o1jax.model.layers import MATMUL_DTYPES
from pallas_kernels.ops import check_backend_runs_here


# A prompt longer than this many prefill calls is announced: the terminal stays silent until
# its first token otherwise.
LONG_PROMPT_CHUNKS = 4


def load_model(model: str = EMBEDDED, backend: str = "auto", interpret: bool = False,
               matmul_dtype: str = "float32"):
  """(Llama, tokenizer) of a checkpoint, its backend checked against this machine first."""
  try:
    check_backend_runs_here(backend, interpret)
  except ValueError as e:
    raise ValueError(f"--{e}") from None
  ckpt = load_checkpoint(model)
  return (Llama(ckpt.config, ckpt.params, backend=backend, interpret=interpret,
                matmul_dtype=matmul_dtype), ckpt.tokenizer)


def chat_engine(model: Llama, tokenizer, tokens: int) -> Engine:
  """The serving engine for one stream of `tokens` prompt + new tokens: its chunked prefill
  and multi-token decode calls (the static-batch Generator took ~10 s to the first token of
  a 1,000-token prompt and decoded at a third of the speed, measured on 2 cores). The pool
  is sized as the pipelines size theirs (`min_tokens_per_slot`: the default pool, grown to
  a bucketed size when one sequence needs more), so prompts of other lengths reuse the
  compiled programs; a pool of exactly their blocks compiled again for each length."""
  return Engine(model, tokenizer, EngineConfig(max_slots=1, min_tokens_per_slot=tokens))


def _reader_gone() -> int:
  """stdout's reader went away (`| head`): stop quietly, as shell tools do."""
  os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
  return 141


def _stdout_failed(e: OSError) -> int:
  print(f"error: cannot write the answer to stdout: {e.strerror or e}", file=sys.stderr)
  return 1


def _check_stdout_encoding() -> None:
  """A stdout that cannot write every character (PYTHONIOENCODING=ascii, a latin-1
  terminal) failed at the answer's first such character, after the model had loaded,
  with the codec's message naming neither stdout nor a way out."""
  encoding = getattr(sys.stdout, "encoding", None) or "utf-8"
  try:
    "\u00e9\u4e2d\U0001f600".encode(encoding)
  except (UnicodeEncodeError, LookupError):
    raise ValueError(f"stdout's encoding is {encoding}, which cannot write every character "
                     f"of an answer: set PYTHONIOENCODING=utf-8") from None


def _decode_text(rate: float, tokens: int) -> str:
  if math.isfinite(rate):
    return f"decode {rate:.1f} tok/s"
  if not tokens:  # (stopped before the first token)
    return "decode tok/s: n/a (no tokens)"
  return "decode tok/s: n/a (every token came with the first call)"


def decode_rate(times: list[float], end: float) -> float:
  """Tokens per second after the first device call's tokens (they arrive together with the
  prefill: counting them would time the prefill as decoding)."""
  first = [t for t in times if t - times[0] < 1e-3] if times else []
  rest = len(times) - len(first)
  span = (times[-1] if rest else end) - first[-1] if first else 0.0
  return rest / span if rest and span > 0 else float("nan")


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
  if sys.stderr is None:  # (closed: print(file=None) wrote the numbers and errors into the answer)
    sys.stderr = open(os.devnull, "w")

  enable_compilation_cache()
  try:
    params = GenerationParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                              seed=args.seed)  # (checked before the model loads)
    if not args.prompt.strip():  # (the chat template alone made a prompt: "]]]" came back)
      raise ValueError("--prompt is empty: give the message to answer")
    if not args.model.strip():  # (was "directory holds neither ...", naming ".")
      raise ValueError("--model is empty: name a checkpoint ('embedded', a .gguf file, an "
                       "HF or orbax directory)")
    if sys.stdout is None:  # (closed: every token's write raised AttributeError)
      raise ValueError("stdout is closed: the answer has nowhere to go")
    _check_stdout_encoding()
    if args.raw and args.system is not None:  # (it was dropped without a word)
      raise ValueError("--system goes into the chat template, which --raw leaves out: put it "
                       "in the prompt, or drop --raw")
    for flag, text in (("--prompt", args.prompt), ("--system", args.system)):
      # (bytes that are not UTF-8 reach Python as lone surrogates: read as U+FFFD)
      if text is not None and LONE_SURROGATE.search(text):
        raise ValueError(f"{flag} is not valid UTF-8 text")
    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model, args.backend, matmul_dtype=args.matmul_dtype)
    load_s = time.perf_counter() - t0
    no_chat = None if args.raw else tokenizer.chat_unavailable()
    if no_chat is not None:  # (a base model: the flag that helps)
      raise ValueError(f"{no_chat}: send the prompt as text with --raw")
    if args.raw:
      prompt = args.prompt
    else:
      messages = ([{"role": "system", "content": args.system}] if args.system else [])
      prompt = messages + [{"role": "user", "content": args.prompt}]
    prompt_ids = encode_prompt(tokenizer, prompt, model.config.vocab_size)
    room = model.config.max_context - len(prompt_ids)
    if room < 1:
      raise ValueError(f"prompt has {len(prompt_ids)} tokens and the model's context is "
                       f"{model.config.max_context}: no room is left to generate")
    if args.max_new_tokens > room:
      left = f"{room} token{'s' if room != 1 else ''}"
      print(f"note: --max_new_tokens {args.max_new_tokens} is more than the {left} the "
            f"model's context has left after the prompt: at most {room} "
            f"{'are' if room != 1 else 'is'} generated", file=sys.stderr)
    new_tokens = min(args.max_new_tokens, room)
    engine = chat_engine(model, tokenizer, len(prompt_ids) + new_tokens)
    request = Request(prompt_ids, dataclasses.replace(params, max_new_tokens=new_tokens))
    chunk = engine.config.prefill_chunk
    if len(prompt_ids) > LONG_PROMPT_CHUNKS * chunk:  # (8k tokens: ~1 minute on 2 cores)
      print(f"[reading {len(prompt_ids):,} prompt tokens, {chunk} per call: the answer starts "
            f"after them]", file=sys.stderr, flush=True)
    times = []  # when each token reached us: the engine returns a call's tokens together
    t_start = time.perf_counter()
    stopped = None
    interrupted = []

    def interrupt(signum, frame):  # (a flag too: the exception may be lost in a gc callback)
      interrupted.append(signum)
      raise KeyboardInterrupt

    restore = (signal.signal(signal.SIGINT, interrupt)
               if threading.current_thread() is threading.main_thread() else None)
    try:
      for event in engine.stream(request):
        if interrupted:
          raise KeyboardInterrupt
        if event.token_id is not None:  # (not the sample's closing event: no token)
          times.append(time.perf_counter())
        # ("" while a multi-byte character is incomplete; the closing event carries what
        # was held back: an unfinished character's U+FFFD)
        if event.text:
          sys.stdout.write(event.text)
          sys.stdout.flush()
    except KeyboardInterrupt:  # Ctrl-C: the answer so far stays, with its numbers
      stopped = "stopped by Ctrl-C"
    finally:
      if restore is not None:  # (after a stop, a second Ctrl-C printed the stop again)
        signal.signal(signal.SIGINT, signal.SIG_IGN if stopped else restore)
    t_end = time.perf_counter()
  except (CheckpointError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:  # while loading: nothing to show
    print("\nstopped by Ctrl-C", file=sys.stderr)
    return 130
  except BrokenPipeError:
    return _reader_gone()
  except OSError as e:  # stdout on a full disk, /dev/full: one line, not a traceback
    return _stdout_failed(e)
  try:
    print(flush=True)  # (before the numbers on stderr)
  except BrokenPipeError:
    return _reader_gone()
  except OSError as e:
    return _stdout_failed(e)
  first = f"{times[0] - t_start:.2f}s (incl. compile)" if times else "none"
  try:  # (the answer is written: a stderr that cannot take the numbers changes no exit code)
    print(f"[{len(prompt_ids)} prompt tokens, {len(times)} generated; load {load_s:.1f}s, "
          f"first token {first}, {_decode_text(decode_rate(times, t_end), len(times))}]",
          file=sys.stderr)
    if stopped:
      print(f"[{stopped}]", file=sys.stderr)
  except OSError:
    pass
  return 130 if stopped else 0


if __name__ == "__main__":
  sys.exit(main())
