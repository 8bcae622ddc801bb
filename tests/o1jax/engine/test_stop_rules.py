"""Stop rules against a reference cut: a request's output with stop strings / stop ids / eos
equals its free run (no stops, ignore_eos) cut at the first stop condition, for every
decode call length, with speculative decoding, n > 1 and streaming.

The reference (`reference_cut`): eos (unless ignore_eos) or a stop id ends the output before
that token (neither is in token_ids nor in the text); a stop string ends it at the token that
completes it in the decoded text of the generated tokens (special tokens skipped, as in
`text`): token_ids keep that token, the text is cut before the stop string's first
occurrence (a character still unfinished at the text's end, U+FFFD, completes none
while the sample runs; the finished text ends before any stop string, that one too);
else max_new_tokens ends it ("length"). The tiny byte-level tokenizer makes one
token per byte, so flat sampling writes partial UTF-8 characters (decoded as U+FFFD) and
the eos token (ignore_eos: it stays in token_ids but not in the text)."""

import pytest

from o1jax.engine import Engine, EngineConfig, GenerationParams, Request
from o1jax.engine.speculative import SpeculativeConfig
from o1jax.model import ThinkingSpan, thinking

N = 40
EOS = 2
RID = 7


def visible(tok, ids):
  return tok.decode(list(ids), skip_special=True)


def reference_cut(tok, ref, stop=(), stop_ids=(), ignore_eos=True, max_new=N):
  """(token_ids, text, finish_reason, tokens sampled) of the free run `ref` under these
  stop rules (the eos / stop id that ends a sample was sampled: the metrics count it)."""
  out = []
  def final(text):  # a finished sample's text: what it ended on is text (a U+FFFD too)
    hits = [text.find(s) for s in stop if s in text]
    return text[:min(hits, default=len(text))]
  for t in ref[:max_new]:
    if (t in tok.eos_ids and not ignore_eos) or t in stop_ids:  # (<|endoftext|> too)
      return out, final(visible(tok, out)), "stop", len(out) + 1
    out.append(t)
    text = visible(tok, out)
    seen = text.rstrip("\ufffd")  # a character still unfinished at the end is no text yet
    hits = [seen.find(s) for s in stop if s in seen]
    if hits or (t == EOS and tok.decode([t]) in stop):  # a special token's spelling
      return out, text[:min(hits, default=len(text))], "stop", len(out)
  return out, final(visible(tok, out)), "length", len(out)


@pytest.fixture(scope="module")
def engines(tiny):
  make = lambda steps: Engine(tiny.model, tiny.tokenizer,
                              EngineConfig(max_slots=8, num_blocks=128, decode_steps=steps))
  return {1: make(1), 3: make(3), 8: make(8)}


@pytest.fixture(scope="module")
def free_run(tiny, make_prompts, engines):
  """(prompt, the free run of samples 0 and 1): flat sampling, N tokens, eos among them."""
  prompt = make_prompts(6, 11, 5, 30)[0]
  params = GenerationParams(temperature=1e4, seed=5, max_new_tokens=N, ignore_eos=True, n=2)
  result = engines[1].generate([Request(prompt, params, request_id=RID)])[0]
  return prompt, [s.token_ids for s in result.samples]


def _partial_char_pair(tok, ref):
  """The last two characters of the first prefix that ends with a completed multi-byte
  character: a stop string that runs through a partial character while it is sampled."""
  for k in range(2, len(ref)):
    text = visible(tok, ref[:k])
    if len(text) >= 2 and ord(text[-1]) > 127 and text[-1] != "\ufffd" and \
        visible(tok, ref[:k - 1]).endswith("\ufffd"):
      return (text[-2:],)
  raise AssertionError("no multi-byte character in the free run")


def _around_eos(tok, ref):
  e = ref.index(EOS)  # the free run samples the eos token (ignore_eos keeps it)
  return (visible(tok, ref[e - 2:e + 3]),)


def _only_in_prompt(tok, refs, prompt):
  text, p = visible(tok, refs[0] + refs[1]), visible(tok, prompt)
  return (next(p[i:i + 2] for i in range(len(p) - 1) if p[i:i + 2] not in text),)


def _twice(tok, refs):
  text = visible(tok, refs[1])  # (sample 1's: sample 0 repeats only U+FFFD)
  return (next(c for c in text if text.count(c) >= 2 and c != "\ufffd"),)


# name -> stop strings chosen from the free run (tok, the samples' tokens, prompt).
STOPS = {
    "one_char": lambda tok, r, p: (visible(tok, r[0])[13],),
    "three_tokens": lambda tok, r, p: (visible(tok, r[0][20:23]),),
    "occurs_twice": lambda tok, r, p: _twice(tok, r),
    "prefix_of_another": lambda tok, r, p: (visible(tok, r[0][15:19]), visible(tok, r[0][15:17])),
    "later_listed_first": lambda tok, r, p: (visible(tok, r[0][25:27]), visible(tok, r[0][8:10])),
    # was: missed (the check decoded special tokens, the text skips them): "length", text cut
    "across_eos": lambda tok, r, p: _around_eos(tok, r[0]),
    # was: streamed its first character before the partial one completed the match
    "through_partial_char": lambda tok, r, p: _partial_char_pair(tok, r[0]),
    "replacement_char": lambda tok, r, p: ("\ufffd",),
    "special_token": lambda tok, r, p: ("<|im_end|>",),  # the eos token, ignore_eos
    "only_in_prompt": _only_in_prompt,
    "whitespace": lambda tok, r, p: (" ", "\t"),
}
# (decode_steps, speculative, n, others in the batch)
RUNS = [(1, False, 1, 0), (3, True, 2, 2), (8, False, 2, 0), (8, True, 1, 0)]


def _check(tok, engine, prompt, refs, params, others=0):
  reqs = [Request(prompt, params, request_id=RID)]
  reqs += [Request([9 + j, 40, 41], GenerationParams(temperature=1.0, max_new_tokens=5 + 7 * j),
                   request_id=100 + j) for j in range(others)]
  result = engine.generate(reqs)[0]
  events = list(engine.stream(reqs[0]))
  counted = 0
  for sample in result.samples:
    want = reference_cut(tok, refs[sample.index], params.stop, params.stop_token_ids,
                         params.ignore_eos, params.max_new_tokens)
    assert (sample.token_ids, sample.text, sample.finish_reason) == want[:3]
    assert len(sample.logprobs) == len(sample.token_ids)
    mine = [e for e in events if e.sample == sample.index]
    streamed = ""
    for e in mine:  # nothing past the stop string, nor what the final text lacks, is sent
      streamed += e.text
      assert sample.text.startswith(streamed)
    assert streamed == sample.text
    assert [e.token_id for e in mine if e.token_id is not None] == sample.token_ids
    assert [e.finish_reason for e in mine if e.finish_reason] == [sample.finish_reason]
    counted += want[3]
  assert result.metrics.generated_tokens == counted


@pytest.mark.parametrize("run", RUNS, ids=lambda r: f"steps{r[0]}-spec{int(r[1])}-n{r[2]}-o{r[3]}")
@pytest.mark.parametrize("kind", list(STOPS))
def test_stop_strings_cut_like_the_reference(tiny, engines, free_run, kind, run):
  prompt, refs = free_run
  steps, spec, n, others = run
  engine = engines[steps]
  engine.set_speculative(SpeculativeConfig(adaptive=False) if spec else None)
  try:
    stop = STOPS[kind](tiny.tokenizer, refs, prompt)
    params = GenerationParams(temperature=1e4, seed=5, max_new_tokens=N, ignore_eos=True, n=n,
                              stop=stop, logprobs=True)
    _check(tiny.tokenizer, engine, prompt, refs, params, others)
    # max_new_tokens ending at the token that completes the match: "stop"
    k = len(reference_cut(tiny.tokenizer, refs[0], stop)[0])
    _check(tiny.tokenizer, engine, prompt, refs,
           GenerationParams(temperature=1e4, seed=5, max_new_tokens=k, ignore_eos=True,
                            stop=stop, logprobs=True))
  finally:
    engine.set_speculative(None)


def test_a_sample_ending_on_an_unfinished_character_is_cut_at_a_replacement_stop(
    tiny, engines, free_run):
  # max_new_tokens ends the sample at a character's first byte: its U+FFFD is the text's
  # last character, and a stop "\ufffd" must cut it there (it was left in the final text:
  # the running check waits for the next token, which never came).
  prompt, refs = free_run
  tok = tiny.tokenizer
  k = next(k for k in range(1, N) if visible(tok, refs[0][:k]).endswith("\ufffd")
           and "\ufffd" not in visible(tok, refs[0][:k])[:-1])
  params = GenerationParams(temperature=1e4, seed=5, max_new_tokens=k, ignore_eos=True,
                            stop=("\ufffd",), logprobs=True)
  sample = engines[1].generate([Request(prompt, params, request_id=RID)])[0].samples[0]
  assert (sample.text, sample.finish_reason) == (visible(tok, refs[0][:k])[:-1], "length")
  _check(tok, engines[3], prompt, refs, params)


@pytest.mark.parametrize("steps", [1, 3, 8])
def test_stop_ids_and_eos_cut_like_the_reference(tiny, engines, free_run, steps):
  prompt, refs = free_run
  tok = tiny.tokenizer
  for params in (GenerationParams(temperature=1e4, seed=5, max_new_tokens=N, n=2, logprobs=True),
                 GenerationParams(temperature=1e4, seed=5, max_new_tokens=N, n=2, logprobs=True,
                                  ignore_eos=True, stop_token_ids=(refs[0][N // 2],)),
                 GenerationParams(temperature=1e4, seed=5, max_new_tokens=N, logprobs=True,
                                  ignore_eos=True, stop_token_ids=(refs[0][N // 2],),
                                  stop=(visible(tok, refs[0][N // 2 - 3:N // 2 - 1]),))):
    _check(tok, engines[steps], prompt, refs, params)


# --- the stop-string check itself, on hand-made tokens (one token per byte) -----------------


def _first_hit(tok, ids, stop, reader=None):
  """The number of tokens at which `hits_stop` first fires (None: never)."""
  for k in range(1, len(ids) + 1):
    if reader is not None:
      reader.update(ids[:k])
    if thinking.hits_stop(reader, ids[:k], stop, lambda t: visible(tok, t), tok.decode):
      return k
  return None


@pytest.mark.parametrize("text, stop, want", [
    ("x" * 30 + "0123456789" * 10 + "tail", ("0123456789" * 10,), 130),  # was: 64-token window
    ("ab<|im_end|>cd", ("bc",), 4),  # the special token is not in the text (was: never)
    ("ab<|im_end|>cd", ("<|im_end|>",), 3),  # a special token's spelling matches it
    ("ab<|im_end|>cd", ("b<|im_end|>",), None),  # but not text around it
    ("ab<|im_end|>cd", ("i",), None),  # nor a part of it (was: 3, at the special token)
    ("ab<|im_end|>cd", ("im_end",), None),
    ("xa\u00e9!", ("a\u00e9",), 4),  # through a character split over two tokens
    # Its first byte alone reads as U+FFFD, which is no text yet (was: 3, a stop "\ufffd"
    # cut every sample at its first multi-byte character).
    ("xa\u00e9!", ("a\ufffd",), None),
    ("a\n\nb", ("\nb",), 4),
])
def test_hits_stop_reads_the_visible_text(tiny, text, stop, want):
  tok = tiny.tokenizer
  ids = tok.encode(text)
  for special in ("<|im_end|>",):
    if special in text:  # the special token itself, not its spelling in bytes
      head, tail = text.split(special)
      ids = tok.encode(head) + [EOS] + tok.encode(tail)
  assert _first_hit(tok, ids, stop) == want


@pytest.mark.parametrize("answer, stop, want", [
    ("\n\nHi\nyo", ("\n",), 5),  # the newlines that lead the answer are not in it (was: 1)
    ("\n\nHi\nyo", ("\nH",), None),
    ("\n" * 150 + "Hi", ("\nH",), None),  # more than any window of them
    ("\n" * 150 + "Hi", ("Hi",), 152),
])
def test_hits_stop_in_the_answer_after_thinking(tiny, answer, stop, want):
  tok = tiny.tokenizer
  span = ThinkingSpan("<think>", "</think>")
  thought = tok.encode("hmm\n</think>")
  reader = thinking.SpanReader(span, tok.decode, tok.encode("Q?<think>\n"))
  ids = thought + tok.encode(answer)
  hit = _first_hit(tok, ids, stop, reader)
  assert (None if hit is None else hit - len(thought)) == want


def test_the_newline_that_leads_the_answer_is_no_stop(tiny):
  """Seed 14's free run has "{" then "\n" (and no other "\n"): with "{" as the close marker,
  the answer's leading newline is dropped from its text, and a "\n" stop string does not
  end it there (was: stop after the close, empty text)."""
  tok = tiny.tokenizer
  prompt = tok.encode("Q: 2+3?<think>\n")
  params = lambda **kw: GenerationParams(temperature=1e4, seed=14, max_new_tokens=N,
                                         ignore_eos=True, **kw)
  config = EngineConfig(max_slots=2, num_blocks=32, decode_steps=8)
  free = Engine(tiny.model, tok, config, thinking="off").generate(
      [Request(prompt, params(), request_id=3)])[0].token_ids
  close = free.index(tok.encode("{")[0])
  assert tok.decode(free[close + 1:close + 2]) == "\n" and "\n" not in visible(tok, free[close + 2:])
  engine = Engine(tiny.model, tok, config, thinking=ThinkingSpan("<think>", "{"))
  request = Request(prompt, params(stop=("\n",)), request_id=3)
  result = engine.generate([request])[0]
  answer = visible(tok, free[close + 1:]).lstrip("\n")
  assert (result.token_ids, result.text, result.finish_reason) == (free, answer, "length")
  assert "".join(e.text for e in engine.stream(request)) == answer
