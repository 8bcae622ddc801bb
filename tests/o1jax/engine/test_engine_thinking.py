"""The engine with a reasoning model's thinking span: a sample's text is the answer after
the span, stop strings act in the answer only, streaming sends the answer; checked on a tiny
random Qwen3-shaped GGUF against the same engine without a span (same tokens, sliced by
hand)."""

import pytest

from o1jax.engine import Engine, EngineConfig, GenerationParams, Request
from o1jax.model import ThinkingSpan
from tests.o1jax.model.test_thinking import pick_markers

CONFIG = EngineConfig(max_slots=4, block_size=8, num_blocks=64, decode_steps=4)


def request(prompt, request_id=7, **params):
  # Flat sampling (a huge temperature): varied tokens from the tiny random model.
  return Request(prompt=prompt, request_id=request_id,
                 params=GenerationParams(temperature=1e4, max_new_tokens=32, **params))


def test_engine_splits_at_the_close_and_stops_only_in_the_answer(tiny_qwen3):
  llama, tok = tiny_qwen3
  plain = Engine(llama, tok, CONFIG, thinking="off")
  prompt = tok.encode("Q: 2+3?<think>\n")
  ref = plain.generate([request(prompt, n=2)])[0].samples
  k, close, inside = pick_markers(tok, ref[0].token_ids)
  engine = Engine(llama, tok, CONFIG, thinking=ThinkingSpan("<think>", close))
  result = engine.generate([request(prompt, n=2)])[0]
  for got, want in zip(result.samples, ref):  # both forks of the prompt
    assert got.token_ids == want.token_ids
  first = result.samples[0]
  assert first.thinking_tokens == k + 1
  assert first.text == tok.decode(ref[0].token_ids[k + 1:], skip_special=True).lstrip("\n")
  assert first.thinking == tok.decode(ref[0].token_ids[:k + 1]).strip()[:-1].strip()
  # A stop string inside the thinking does not end the sample; without a span it does.
  stopped = engine.generate([request(prompt, stop=(inside,))])[0].samples[0]
  assert stopped.token_ids == ref[0].token_ids and stopped.finish_reason == "length"
  assert plain.generate([request(prompt, stop=(inside,))])[0].samples[0].finish_reason == "stop"
  # One in the answer cuts it there, as without a span.
  last = first.text.rstrip()[-1]
  cut = engine.generate([request(prompt, stop=(last,))])[0].samples[0]
  assert cut.finish_reason == "stop" and cut.text == first.text[:first.text.index(last)]
  # Streaming sends the answer (nothing while thinking); its pieces make the final text.
  events = list(engine.stream(request(prompt)))
  assert "".join(e.text for e in events) == first.text
  assert all(e.text == "" for e in events[:k + 1])


def test_auto_reads_the_template_and_an_open_span_has_no_answer(tiny_qwen3):
  llama, tok = tiny_qwen3
  engine = Engine(llama, tok, CONFIG)  # auto: the template names <think> / </think>
  assert engine.thinking == ThinkingSpan()
  prompt = tok.encode("Q: 2+3?<think>\n")
  greedy = Request(prompt=prompt, params=GenerationParams(max_new_tokens=8))
  sample = engine.generate([greedy])[0].samples[0]  # this model never writes </think>
  assert sample.text == "" and sample.thinking_tokens == 8 and sample.finish_reason == "length"
  # A prompt without a span (the template's enable_thinking=false closes an empty one):
  # the sample is all answer, as with thinking="off".
  closed = tok.encode("Q: 2+3?<think>\n\n</think>\n\n")
  off = Engine(llama, tok, CONFIG, thinking="off")
  want = off.generate([request(closed)])[0].samples[0]
  got = engine.generate([request(closed)])[0].samples[0]
  assert (got.text, got.thinking, got.thinking_tokens) == (want.text, "", 0)


def test_thinking_off_renders_a_template_that_can_turn_it_off_with_it_off(tiny_qwen3):
  # Qwen3's template thinks unless enable_thinking is false: with thinking="off" the model
  # still thought, and its whole <think>...</think> was read (and scored) as the answer.
  from o1jax.controller import Controller, ContiguousLlama
  from o1jax.model import Generator
  from o1jax.model.thinking import template_kwargs
  llama, tok = tiny_qwen3
  chat = [{"role": "user", "content": "2+3?"}]
  assert template_kwargs("off", tok) == {"enable_thinking": False}
  assert template_kwargs("auto", tok) == template_kwargs(ThinkingSpan(), tok) == {}
  closed = tok.encode_chat(chat, enable_thinking=False)
  assert tok.decode(closed).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
  assert tok.decode(tok.encode_chat(chat)).endswith("<|im_start|>assistant\n")
  for make in (lambda t: Engine(llama, tok, CONFIG, thinking=t),
               lambda t: Generator(llama, tok, thinking=t)):
    assert make("off").encode_prompt(chat) == closed
    assert make("auto").encode_prompt(chat) == tok.encode_chat(chat)
  assert Controller(ContiguousLlama(llama), tok, thinking="off").encode(chat) == closed
  with pytest.raises(ValueError, match=r"chat template variable\(s\) \['bos_token'\] are set by "
                                       r"apply_chat_template itself"):
    tok.apply_chat_template(chat, bos_token="<s>")
