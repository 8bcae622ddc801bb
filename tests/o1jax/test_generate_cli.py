"""`python -m o1jax.generate` when the user stops it, pipes it, or picks what cannot run here."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

COMMAND = [sys.executable, "-m", "o1jax.generate", "--raw", "--prompt", "1, 2, 3, 4, 5,"]


def test_compiled_pallas_kernels_on_a_cpu_are_one_line_naming_the_flag():
  # Before: JAX's "Only interpret mode is supported on CPU backend." after the model loaded.
  out = subprocess.run(COMMAND + ["--backend", "pallas"], capture_output=True, text=True,
                       timeout=300)
  assert out.returncode == 2, out.stderr
  assert out.stderr.strip().splitlines() == [
      "error: --backend='pallas' runs the Pallas kernels compiled for a GPU, and this machine "
      "has none (a CPU runs them only interpreted, for tests): use backend 'auto' (this CPU's "
      "native kernels) or 'reference'"]


def test_a_reader_that_goes_away_stops_it_quietly():
  # Before: a BrokenPipeError traceback and exit code 1 (`... | head -c 20`).
  proc = subprocess.Popen(COMMAND + ["--max_new_tokens", "16"], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  proc.stdout.close()  # before the first token is written
  _, err = proc.communicate(timeout=300)
  assert proc.returncode == 141, err
  assert "Traceback" not in err


def test_ctrl_c_keeps_the_answer_so_far_and_its_numbers():
  # Before: a 14-line KeyboardInterrupt traceback, the answer without its stats line.
  proc = subprocess.Popen(COMMAND + ["--max_new_tokens", "4000"], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  first = proc.stdout.read(8)  # tokens are streaming
  proc.send_signal(signal.SIGINT)
  rest, err = proc.communicate(timeout=300)
  assert proc.returncode == 130, err
  assert (first + rest).startswith(" 6, 7,")
  assert "Traceback" not in err
  assert re.match(r"^\[14 prompt tokens, \d+ generated; load .*tok/s.*\]$",
                  err.strip().splitlines()[-2])
  assert err.strip().splitlines()[-1] == "[stopped by Ctrl-C]"


@pytest.mark.parametrize("after_s", [0.3, 0.7, 1.2, 2.5])
def test_ctrl_c_while_starting_is_one_line_and_exit_130(after_s):
  # Before: at 0.5-0.8 s the KeyboardInterrupt landed in one of JAX's gc callbacks, where
  # Python ignores it ("Exception ignored in ..."): the whole answer came, exit 0; during
  # the imports a full traceback, exit -2.
  proc = subprocess.Popen(COMMAND + ["--max_new_tokens", "4000"], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  time.sleep(after_s)
  proc.send_signal(signal.SIGINT)
  _, err = proc.communicate(timeout=300)
  assert proc.returncode == 130, err
  assert "Traceback" not in err and "Exception ignored" not in err
  assert err.strip().splitlines()[-1] in ("stopped by Ctrl-C", "[stopped by Ctrl-C]")


def test_more_new_tokens_than_the_context_holds_is_said():
  # Before: clamped to the context without a word.
  proc = subprocess.Popen(COMMAND + ["--max_new_tokens", "100000000"], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
  try:
    line = proc.stderr.readline()  # printed before the first token
  finally:
    proc.kill()
    proc.communicate(timeout=60)
  assert line == ("note: --max_new_tokens 100000000 is more than the 8178 tokens the model's "
                  "context has left after the prompt: at most 8178 are generated\n")


def test_a_long_prompt_is_announced_before_its_prefill():
  # Before: nothing until the first token (an 8,101-token prompt: ~1 minute here).
  prompt = " ".join(str(i) for i in range(400))  # 1,000+ tokens
  proc = subprocess.Popen(COMMAND[:-1] + [prompt], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
  try:
    line = proc.stderr.readline()
  finally:
    proc.kill()
    proc.communicate(timeout=60)
  assert re.fullmatch(r"\[reading 1,\d{3} prompt tokens, 128 per call: the answer starts after "
                      r"them\]\n", line), line


def test_the_decode_rate_leaves_out_the_tokens_of_the_first_call():
  from o1jax.generate import decode_rate
  # 2 tokens with the prefill's call, 2 more 0.5 s and 1 s after them
  assert abs(decode_rate([10.0, 10.0002, 10.5, 11.0], 11.0) - 2 / 0.9998) < 1e-9
  assert decode_rate([10.0, 10.0002], 10.5) != decode_rate([10.0, 10.0002], 10.5)  # NaN: no rate
  assert decode_rate([], 1.0) != decode_rate([], 1.0)
  from o1jax.generate import _decode_text
  # (stopped before the first token: "every token came with the first call" was said)
  assert _decode_text(decode_rate([], 1.0), 0) == "decode tok/s: n/a (no tokens)"
  assert "first call" in _decode_text(decode_rate([10.0, 10.0002], 10.5), 2)


def test_a_system_message_with_raw_is_refused():
  # Before: --system was dropped without a word (the prompt was the raw text alone).
  out = subprocess.run(COMMAND + ["--system", "Answer in French."], capture_output=True,
                       text=True, timeout=300)
  assert out.returncode == 2 and out.stderr.strip().splitlines()[-1] == (
      "error: --system goes into the chat template, which --raw leaves out: put it in the "
      "prompt, or drop --raw")


def test_a_prompt_that_is_not_utf8_is_refused_before_the_model_loads():
  # Before: the byte read as U+FFFD and the model answered that prompt (exit 0).
  out = subprocess.run([sys.executable, "-m", "o1jax.generate", "--prompt", b"ab\xffcd"],
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 2
  assert out.stderr.strip().splitlines() == ["error: --prompt is not valid UTF-8 text"]


@pytest.mark.parametrize("args, stdout, message", [
    # Before: the chat template alone was the prompt ("]]]", exit 0); "directory holds
    # neither ..." naming "."; AttributeError and OSError tracebacks (exit 1).
    (["--prompt", ""], None, "error: --prompt is empty: give the message to answer"),
    (["--prompt", " \n"], None, "error: --prompt is empty: give the message to answer"),
    (["--prompt", "hi", "--model", ""], None, "error: --model is empty: name a checkpoint "),
    (["--prompt", "hi", "--max_new_tokens", "2"], "closed", "error: stdout is closed: "),
    (["--prompt", "hi", "--max_new_tokens", "2"], "/dev/full",
     "error: cannot write the answer to stdout: No space left on device"),
    # Before: the answer up to its first non-ASCII character, then the codec's message
    # (exit 2 after the model had loaded); now before it loads.
    (["--prompt", "Say café"], "ascii",
     "error: stdout's encoding is ascii, which cannot write every character of an answer: "
     "set PYTHONIOENCODING=utf-8"),
])
def test_an_empty_prompt_or_model_and_a_stdout_that_cannot_be_written_are_one_line(
    args, stdout, message):
  if stdout == "/dev/full" and not os.path.exists("/dev/full"):
    pytest.skip("needs /dev/full")
  target = subprocess.DEVNULL if stdout is None else (
      open("/dev/full", "w") if stdout == "/dev/full" else None)
  run = dict(stdout=target) if stdout != "closed" else dict(
      stdout=None, preexec_fn=lambda: os.close(1))
  if stdout == "ascii":
    run = dict(stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONIOENCODING": "ascii"})
  out = subprocess.run([sys.executable, "-m", "o1jax.generate", *args], stderr=subprocess.PIPE,
                       text=True, timeout=300, **run)
  assert out.returncode in (1, 2) and out.stderr.strip().splitlines()[-1].startswith(message), \
      out.stderr[-2000:]


def test_with_stderr_closed_the_answer_is_all_stdout_holds():
  """print(file=sys.stderr) with fd 2 closed wrote to stdout: the numbers line (and any
  error) came after the answer, in the answer's file."""
  out = subprocess.run(COMMAND + ["--max_new_tokens", "4"], stdout=subprocess.PIPE, text=True,
                       timeout=300, preexec_fn=lambda: os.close(2))
  assert out.returncode == 0
  assert "[" not in out.stdout and "prompt tokens" not in out.stdout and out.stdout.strip(), out.stdout


def test_the_text_a_closing_event_carries_is_written(tmp_path, monkeypatch, capsys):
  """The closing event (eos after an unfinished character) carries what was held back
  (its U+FFFD); the CLI skipped every event without a token, so its stdout ended short of
  the engine's text."""
  import numpy as np

  from o1jax import generate
  from o1jax.checkpoint import load_checkpoint
  from o1jax.engine import GenerationParams, Request
  from o1jax.model import Llama
  from o1jax.model.generation import encode_prompt
  from o1jax.testing import tiny_config, write_hf_checkpoint
  write_hf_checkpoint(tmp_path / "tiny", tiny_config(max_context=256), seed=3)
  ck = load_checkpoint(tmp_path / "tiny")
  params = dict(ck.params)
  params["embed"] = np.asarray(params["embed"]) * 0.05  # (spread-out logits: bytes get sampled)
  model = Llama(ck.config, params)
  monkeypatch.setattr(generate, "load_model", lambda *a, **k: (model, ck.tokenizer))
  ids = encode_prompt(ck.tokenizer, "hello", model.config.vocab_size)
  checked = 0
  for seed in range(80, 120):
    request = Request(ids, GenerationParams(max_new_tokens=30, temperature=5.0, seed=seed))
    events = list(generate.chat_engine(model, ck.tokenizer, len(ids) + 30).stream(request))
    if not any(e.token_id is None and e.text for e in events):
      continue
    assert generate.main(["--raw", "--prompt", "hello", "--temperature", "5", "--seed", str(seed),
                          "--max_new_tokens", "30"]) == 0
    assert capsys.readouterr().out == "".join(e.text for e in events) + "\n", seed
    checked += 1
  assert checked  # (seeds 90, 100 and 104 end with an unfinished character)


def test_a_stderr_that_cannot_take_the_numbers_does_not_fail_a_written_answer():
  # Before: the answer written, then an OSError from the numbers' line and exit code 1.
  with open("/dev/full", "w") as full:
    proc = subprocess.run(COMMAND + ["--max_new_tokens", "4"], stdout=subprocess.PIPE,
                          stderr=full, text=True, timeout=300)
  assert proc.returncode == 0 and proc.stdout.strip()
