"""Where a sample's answer begins (`SpanReader`) and what the generator returns with a span:
hand-made token tables, then the generator on a tiny random Qwen3-shaped GGUF against the
same generator without a span (the tokens are the same; only the split differs)."""

from o1jax.model import Generator, SamplingParams, SpanReader, ThinkingSpan, thinking

VOCAB = ["<think>", "</think>", "\n", "\n\n", " a", " b", "42", "</", "think", ">", "<", "Q:",
         " ", "x", ">.", "5", " is", ">-", ">\n", ">\xc3", "\xa9t\xc3\xa9", "</think>\n\n5", "\xff"]
ID = {s: i for i, s in enumerate(VOCAB)}
SPAN = ThinkingSpan()


def ids(*pieces):
  return [ID[p] for p in pieces]


def decode(token_ids):
  """Tokens of bytes (written as latin-1 characters): a character split between two
  tokens reads U+FFFD when one of them is decoded alone."""
  return "".join(VOCAB[i] for i in token_ids).encode("latin-1").decode("utf-8", "replace")


def read(prompt, generated, finish=True):
  """The reader fed one token at a time, as the engine and the generator feed it."""
  reader = SpanReader(SPAN, decode, prompt)
  starts = [reader.update(generated[:k]) for k in range(1, len(generated) + 1)]
  if finish:
    reader.finish(generated)
  return reader, starts


def test_a_prompt_inside_the_span_thinks_until_the_close():
  gen = ids(" a", " b", "</think>", "\n\n", "42")
  reader, starts = read(ids("Q:", "<think>", "\n"), gen)
  assert starts == [None, None, 3, 3, 3]  # decided at the close, never changed after
  assert reader.answer_start == 3 and reader.thinking_tokens(gen) == 3
  assert reader.thinking_text(gen) == "a b"
  assert thinking.answer_text(reader, gen, decode) == "42"  # leading newlines dropped
  assert thinking.hits_stop(reader, gen, ["42"], decode)
  assert not thinking.hits_stop(reader, gen, [" b"], decode)  # inside the thinking: no stop


def test_a_sample_that_opens_the_span_itself():
  gen = ids("\n", "<think>", " a", "</think>", " b")
  reader, starts = read(ids("Q:"), gen)
  assert starts == [None, None, None, 4, 4]
  assert reader.thinking_text(gen) == "a" and reader.thinking_tokens(gen) == 4
  assert thinking.answer_text(reader, gen, decode) == " b"


def test_a_marker_spelled_in_several_tokens_ends_at_its_last_token():
  gen = ids(" a", "</", "think", ">", "x")
  reader, starts = read(ids("Q:", "<", "think", ">", " "), gen)
  assert starts == [None, None, None, 4, 4]
  assert thinking.answer_text(reader, gen, decode) == "x" and reader.thinking_text(gen) == "a"
  # The open marker in pieces at the start of a sample: undecided until it is whole.
  reader, starts = read(ids("Q:"), ids("<", "think", ">", " a", "</think>"))
  assert starts == [None, None, None, None, 5]


def test_a_marker_that_ends_inside_a_token_of_the_answer_leaves_the_answer_whole():
  # SmolLM2 spells "</think>.5" '</', 'think', '>.', '5': the answer read "5" (and
  # "</think>-3" would read "3"), the thinking "a</think>.".
  for last, answer in ((">.", ".5 is"), (">-", "-5 is"), (">\n", "5 is")):
    gen = ids(" a", "</", "think", last, "5", " is")
    reader, starts = read(ids("Q:", "<think>", "\n"), gen)
    assert starts == [None, None, None, 3, 3, 3]  # the token holding the answer's start
    assert thinking.answer_text(reader, gen, decode) == answer
    assert reader.thinking_text(gen) == "a" and reader.thinking_tokens(gen) == 3
    assert thinking.hits_stop(reader, gen, [answer[:3]], decode)
    assert not thinking.hits_stop(reader, gen[:4], ["k>"], decode)  # the marker is no answer
  # A first character split between the marker's token and the next: read whole.
  gen = ids(" a", "</", "think", ">\xc3", "\xa9t\xc3\xa9")
  reader, _ = read(ids("Q:", "<think>", "\n"), gen)
  assert thinking.answer_text(reader, gen, decode) == "été" and reader.thinking_text(gen) == "a"
  # The marker and the answer in the first generated token: the leading newlines go too.
  gen = ids("</think>\n\n5", " is")
  reader, _ = read(ids("Q:", "<think>", "\n"), gen)
  assert reader.answer_start == 0 and thinking.answer_text(reader, gen, decode) == "5 is"
  assert thinking.hits_stop(reader, gen, ["5 i"], decode)


def test_a_character_still_unfinished_completes_no_stop():
  # The first byte of "é" reads U+FFFD alone: a stop "\ufffd" (for bad bytes) ended the
  # sample there, at the first byte of every multi-byte character.
  assert not thinking.hits_stop(None, ids(" a", ">\xc3"), ["\ufffd"], decode)
  assert not thinking.hits_stop(None, ids(" a", ">\xc3", "\xa9t\xc3\xa9"), ["\ufffd"], decode)
  assert thinking.hits_stop(None, ids(" a", ">\xc3"), [" a>"], decode)  # the text before it
  # A byte that starts no character is a real U+FFFD: seen with the next token.
  assert not thinking.hits_stop(None, ids(" a", "\xff"), ["\ufffd"], decode)
  assert thinking.hits_stop(None, ids(" a", "\xff", " b"), ["\ufffd"], decode)
  assert thinking.hits_stop(None, ids(" a", "\xff", " b"), ["\ufffd b"], decode)


def test_a_sample_that_does_not_think_is_all_answer():
  gen = ids(" a", "</think>", "42")
  reader, starts = read(ids("Q:"), gen)
  assert starts == [0, 0, 0] and reader.thinking_text(gen) == "" and reader.thinking_tokens(gen) == 0
  assert thinking.answer_text(reader, gen, decode) == " a</think>42"  # no span: left as written
  assert thinking.hits_stop(reader, gen, ["</think>4"], decode)  # no span: plain text
  # Whitespace only, then the end: no span either.
  reader, starts = read(ids("Q:"), ids("\n", " "))
  assert starts == [None, None] and reader.answer_start == 0


def test_a_span_that_never_closes_has_no_answer():
  gen = ids(" a", " b", "Q:")
  reader, _ = read(ids("<think>", "\n"), gen)
  assert reader.answer_start is None and reader.thinking_tokens(gen) == 3
  assert thinking.answer_text(reader, gen, decode) == ""
  assert not thinking.hits_stop(reader, gen, ["Q:"], decode)  # stop strings wait for the answer
  assert reader.thinking_text(gen) == "a bQ:"


def test_a_prompt_with_a_closed_span_is_not_inside():
  # A template's "thinking off" (an empty span in the prompt): the sample is all answer.
  assert not thinking.prompt_inside(SPAN, decode, ids("<think>", "\n\n", "</think>", "\n\n"))
  assert thinking.prompt_inside(SPAN, decode, ids("Q:", "<think>", "\n"))
  reader, starts = read(ids("<think>", "</think>", "\n\n"), ids("42"))
  assert starts == [0]


# -- the generator on a tiny Qwen3-shaped GGUF --------------------------------------------


def pick_markers(tok, ref):
  """(k, close, inside): a token k of `ref` whose one printable ASCII character occurs once in
  the sample's text, to serve as the close marker, and a character of the thinking before
  it that the answer after it lacks, to serve as a stop string."""
  chars = [tok.decode(ref[i:i + 1], skip_special=True) for i in range(len(ref))]
  whole = tok.decode(ref, skip_special=True)
  printable = lambda c: len(c) == 1 and 33 <= ord(c) <= 126
  for k in range(4, len(ref) - 4):
    if printable(chars[k]) and whole.count(chars[k]) == 1:
      answer = tok.decode(ref[k + 1:], skip_special=True)
      inside = [c for c in chars[:k] if printable(c) and c not in answer]
      if inside:
        return k, chars[k], inside[0]
  raise AssertionError(f"no usable markers in {whole!r}")


# Flat sampling (a huge temperature): the tiny random model's greedy output is one token
# repeated; this gives varied tokens, the same for every generator (seeded by request id).
FLAT = SamplingParams(temperature=1e4)


def test_generator_splits_at_the_close_and_stops_only_in_the_answer(tiny_qwen3):
  llama, tok = tiny_qwen3
  plain = Generator(llama, tok, thinking="off")
  prompt = tok.encode("Q: 2+3?<think>\n")  # ends inside the span (as R1 templates do)
  ref = plain.generate([prompt], 32, FLAT)[0].token_ids
  k, close, inside = pick_markers(tok, ref)
  gen = Generator(llama, tok, thinking=ThinkingSpan("<think>", close))
  out = gen.generate([prompt], 32, FLAT)[0]
  assert out.token_ids == ref  # the span changes what is returned, never what is sampled
  assert out.thinking_tokens == k + 1
  assert out.text == tok.decode(ref[k + 1:], skip_special=True).lstrip("\n")
  assert out.thinking == tok.decode(ref[:k + 1]).strip()[:-1].strip()
  # A stop string inside the thinking does not end the sample; one in the answer cuts it.
  stopped = gen.generate([prompt], 32, FLAT, stop=[inside])[0]
  assert stopped.token_ids == ref and stopped.finish_reason == "length"
  assert plain.generate([prompt], 32, FLAT, stop=[inside])[0].finish_reason == "stop"
  last = out.text.rstrip()[-1]
  cut = gen.generate([prompt], 32, FLAT, stop=[last])[0]
  assert cut.finish_reason == "stop" and cut.text == out.text[:out.text.index(last)]
  # auto: the template names <think>/</think>; greedy, this model never writes </think>.
  auto = Generator(llama, tok).generate([prompt], 8, SamplingParams())[0]
  assert auto.text == "" and auto.thinking_tokens == 8 and auto.finish_reason == "length"


def test_cut_at_stop_ends_before_the_earliest_stop_in_the_text():
  assert thinking.cut_at_stop("ab cd ab", [" a", "cd"]) == "ab "  # the earliest, not the first listed
  assert thinking.cut_at_stop("abc", ["x"]) == "abc"
  # While the sample runs an unfinished character at the end is no text yet; once it has
  # finished, what it ended on is (a stop "\ufffd" kept it in the final text), and a real
  # U+FFFD before the end cuts either way.
  assert thinking.cut_at_stop("ab\ufffd", ["\ufffd"]) == "ab\ufffd"
  assert thinking.cut_at_stop("ab\ufffd", ["\ufffd"], final=True) == "ab"
  assert thinking.cut_at_stop("a\ufffdb\ufffd", ["\ufffd"]) == "a"
