"""Thinking spans of reasoning models: the markers, where to find them, and where a
sample's answer begins.

A reasoning model (Qwen3, DeepSeek-R1 distills, ...) thinks inside a span such as
`<think> ... </think>` and answers after it. Everything that generates text reads it
through this module:

  - the engine and the generator (`SpanReader`): a sample's text is the answer after
    the span, its thinking is kept beside it, and stop strings apply to the answer only
    (a stop string inside the thinking does not end the sample). The span is the one the
    chat template opens: a prompt that ends inside it (`<think>\n` from the template), or
    a sample whose first words are the open marker. A sample that never closes it has no
    answer (empty text);
  - the reasoning controller (o1jax/controller): the span is its thinking phase (budgets,
    "Wait", the forced close; see docs/controller.md).

Settings (the `model.thinking` config value): "auto" (the markers found in the chat
template, none if it has none), "off" (no span; a template that can turn thinking off,
Qwen3's `enable_thinking`, renders chat prompts with it off: `template_kwargs`), "on" (as
auto, but a template without known markers is an error), or the two markers separated by
a space ("<think> </think>").
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

# (open, close) pairs of the chat templates we know; a template naming both has a span.
KNOWN_MARKERS = (
    ("<think>", "</think>"),  # Qwen3, QwQ, DeepSeek-R1 and its distills
    ("<seed:think>", "</seed:think>"),  # Seed-OSS
    ("[THINK]", "[/THINK]"),  # Magistral
    ("◁think▷", "◁/think▷"),  # Kimi
    ("<|begin_of_thought|>", "<|end_of_thought|>"),  # Sky-T1 style
)
SETTINGS = ("auto", "on", "off")


@dataclasses.dataclass(frozen=True)
class ThinkingSpan:
  """The markers that open and close a model's thinking."""

  open: str = "<think>"
  close: str = "</think>"

  def __post_init__(self):
    for name, marker in (("open", self.open), ("close", self.close)):
      if not marker or marker != marker.strip() or any(c.isspace() for c in marker):
        raise ValueError(f"thinking {name} marker {marker!r} must be non-empty text without "
                         f"spaces")
    if self.open == self.close:
      raise ValueError(f"thinking markers must differ, got {self.open!r} twice")


def check_setting(setting: str) -> str | ThinkingSpan:
  """"auto" / "on" / "off", or the ThinkingSpan the setting spells; one-line errors."""
  text = str(setting).strip()
  if text in SETTINGS:
    return text
  parts = text.split()
  if len(parts) != 2:
    raise ValueError(f"model.thinking={setting!r}: use one of {list(SETTINGS)} or the two "
                     f"markers separated by a space, e.g. '<think> </think>'")
  return ThinkingSpan(*parts)


def template_markers(template: str | None) -> ThinkingSpan | None:
  """The known markers a chat template names (both of a pair), or None."""
  for open_, close in KNOWN_MARKERS:
    if template and open_ in template and close in template:
      return ThinkingSpan(open_, close)
  return None


def resolve(setting: str | ThinkingSpan | None, tokenizer) -> ThinkingSpan | None:
  """The span a controller uses for `tokenizer` under `setting` (see the module doc)."""
  if setting is None or isinstance(setting, ThinkingSpan):
    return setting
  value = check_setting(setting)
  if isinstance(value, ThinkingSpan) or value == "off":
    return None if value == "off" else value
  template = getattr(tokenizer, "chat_template", None)
  if not getattr(tokenizer, "has_chat_template", bool(template)):
    template = None
  found = template_markers(template)
  if found is None and value == "on":
    known = ", ".join(f"{o} {c}" for o, c in KNOWN_MARKERS)
    raise ValueError("model.thinking='on' but the chat template names no known thinking "
                     f"markers ({known}): give the markers, e.g. '<think> </think>'")
  return found


def template_kwargs(setting, tokenizer) -> dict:
  """The chat template variables a thinking `setting` asks for: "off" with a template that
  can turn thinking off (Qwen3's `enable_thinking`) renders it off, an empty span the model
  answers after (it thought anyway, its span read as its answer); otherwise none (the
  template's default)."""
  if not (isinstance(setting, str) and setting.strip() == "off"):
    return {}
  template = getattr(tokenizer, "chat_template", None)
  if not getattr(tokenizer, "has_chat_template", bool(template)) or not template:
    return {}
  return {"enable_thinking": False} if "enable_thinking" in template else {}


# Tokens re-decoded to look for the close marker: more than any marker's token count.
_CLOSE_WINDOW = 32


class SpanReader:
  """Where one sample's answer begins in its generated tokens, read as they arrive.

  `update(generated)` after each appended token; `answer_start` is the index of the
  answer's first token once the span closed, 0 when the sample did not think (it does not
  begin with the open marker and its prompt is not inside the span), None while it is
  thinking or undecided (only whitespace or the start of the open marker so far). Markers
  are found in decoded text (special tokens kept), so a marker that is one added token
  and one spelled in several tokens read alike. A marker spelled in ordinary tokens may
  end inside a token that also holds the answer's first characters (SmolLM2 writes
  "</think>.5" as '</', 'think', '>.', '5'): that token is the answer's first, and
  `answer_skip` the characters of it the marker takes (they were cut from the answer:
  ".5" read "5", a minus sign could go).
  """

  def __init__(self, span: ThinkingSpan, decode: Callable[[Sequence[int]], str],
               prompt_ids: Sequence[int]):
    self.span = span
    self.decode = decode  # ids -> text with special tokens kept
    self.opened = prompt_inside(span, decode, prompt_ids)
    self.answer_start: int | None = None
    self.answer_skip = 0  # characters of the answer's first token that the marker takes
    self._closed_at: int | None = None  # tokens up to the one completing the close marker

  def update(self, generated: Sequence[int]) -> int | None:
    if self.answer_start is not None:
      return self.answer_start
    if not self.opened:
      head = self.decode(list(generated[:_CLOSE_WINDOW])).lstrip()
      if not head or self.span.open.startswith(head):
        return None  # nothing but whitespace, or part of the open marker, so far
      if not head.startswith(self.span.open):
        self.answer_start = 0
        return 0
      self.opened = True
    lo = max(0, len(generated) - _CLOSE_WINDOW)
    if self.span.close in self.decode(list(generated[lo:])):
      # The first close: earlier ones would have been seen by an earlier update.
      a, b = lo + 1, len(generated)
      while a < b:
        mid = (a + b) // 2
        if self.span.close in self.decode(list(generated[lo:mid])):
          b = mid
        else:
          a = mid + 1
      self._closed_at = self.answer_start = a
      text = self.decode(list(generated[lo:a]))
      end = text.find(self.span.close) + len(self.span.close)
      if end < len(text):  # token a - 1 holds answer text too (a first byte of it at least)
        skip = end - len(self.decode(list(generated[lo:a - 1])))  # the marker's part of it
        if 0 < skip <= len(self.span.close) and self.decode(list(generated[a - 1:a])).startswith(
            self.span.close[-skip:]):
          self.answer_start, self.answer_skip = a - 1, skip
    return self.answer_start

  @property
  def closed(self) -> bool:
    """The span closed: the answer follows it (its leading newlines dropped)."""
    return self._closed_at is not None

  def finish(self, generated: Sequence[int]) -> int | None:
    """The answer's start once the sample ended: undecided (whitespace only) is no span."""
    self.update(generated)
    if self.answer_start is None and not self.opened:
      self.answer_start = 0
    return self.answer_start

  def thinking_tokens(self, generated: Sequence[int]) -> int:
    """Generated tokens before the answer's first, markers included (all of them while
    it is open; 0 when the sample did not think)."""
    if self.answer_start is None:
      return len(generated) if self.opened else 0
    return self.answer_start

  def thinking_text(self, generated: Sequence[int]) -> str:
    """The thinking, markers removed ("" when the sample did not think)."""
    if not self.opened:
      return ""
    end = len(generated) if self._closed_at is None else self._closed_at
    text = self.decode(list(generated[:end])).strip()
    if text.startswith(self.span.open):
      text = text[len(self.span.open):]
    if self._closed_at is not None:  # (up to the marker: its token may hold answer text)
      text = text[:text.rfind(self.span.close)] if self.span.close in text else text
    return text.strip()


def prompt_inside(span: ThinkingSpan, decode: Callable[[Sequence[int]], str],
                  prompt_ids: Sequence[int]) -> bool:
  """The prompt ends inside the span: its open marker, then only spaces (a chat template
  that opens thinking for the model). A prompt ending with a closed span is not inside."""
  tail = decode(list(prompt_ids[-_CLOSE_WINDOW:])).rstrip()
  return tail.endswith(span.open)


def answer_text(reader: SpanReader | None, generated: Sequence[int],
                decode_visible: Callable[..., str], before: int | None = None) -> str:
  """A sample's text: all of it without a span; with one, the answer after the close
  (its leading newlines dropped), "" while thinking or when the span never closed.
  decode_visible: ids -> text without special tokens; a text from the sample's start is
  decoded as the continuation of `before` (the prompt's last token: `decode_visible(ids,
  before)`, `Tokenizer.continuation`) where that is given."""
  start = 0 if reader is None else reader.answer_start
  if start is None:
    return ""
  return _visible_from(reader, generated, start, decode_visible, before)


def _visible_from(reader: SpanReader | None, generated: Sequence[int], lo: int,
                  decode_visible: Callable[..., str], before: int | None) -> str:
  """The text of generated[lo:]; from the answer's start (`reader.answer_start`) the
  answer's own (the marker's characters and, after a closed span, the leading newlines
  off), and from the sample's first token the continuation of `before` where given."""
  start = 0 if reader is None else reader.answer_start
  if lo == 0 and before is not None and not (reader and reader.answer_skip):
    text = decode_visible(list(generated), before)
  else:
    text = decode_visible(list(generated[lo:]))
    text = text[reader.answer_skip:] if reader is not None and lo == start else text
  return text.lstrip("\n") if lo == start and reader is not None and reader.closed else text


# Leading characters of a decoded window that may differ from the full text's (a character
# cut by the window's start reads as U+FFFD; a tokenizer may drop a first token's space):
# a stop string is looked for after them only.
_FRONT = 8


def cut_at_stop(text: str, stop: Sequence[str], final: bool = False) -> str:
  """`text` up to (not including) the earliest stop string in it. While the sample runs,
  a character still unfinished at its end (U+FFFD) is no text a stop string can end in, as
  in `hits_stop`; once it has finished (`final`), what it ended on is its text."""
  seen = text if final else text.rstrip("\ufffd")
  return text[:min((i for i in (seen.find(s) for s in stop if s) if i >= 0), default=len(text))]


def hits_stop(reader: SpanReader | None, generated: Sequence[int], stop: Sequence[str],
              decode_visible: Callable[..., str],
              decode: Callable[[Sequence[int]], str] | None = None,
              before: int | None = None) -> bool:
  """Whether the last generated token completes a stop string in the sample's text: its
  answer, as `answer_text` reads it (special tokens skipped, the newlines that lead the
  answer dropped; nothing while thinking), so the text is cut where the sample stopped.
  Also when the last token is a special token whose spelling (`decode`: special tokens
  kept) is a stop string: stop="<|im_end|>" ends a sample at that token where it is not
  an eos id (the token adds nothing to the text); a stop string that is only part of a
  spelling ("i", "m") is text, which a special token does not add to (it ended every
  sample at the first special token).

  Decodes a window of the last tokens, grown until the text after its uncertain front
  holds any stop string the last token can complete (of any length: a stop string
  spanning more tokens than a fixed window is still seen). Earlier tokens were checked
  when they were appended, so only this one's matches count. An unfinished UTF-8
  character reads as U+FFFD, as in the text; at the text's end it matches nothing yet. before: as `answer_text`'s (a window from
  the text's start reads as the text does: a stop string its first space begins)."""
  start = 0 if reader is None else reader.answer_start
  if start is None or not stop or not generated:
    return False
  n = len(generated)
  last = decode_visible(list(generated[-1:]))
  if decode is not None and not last and n > start:
    if decode(list(generated[-1:])) in stop:
      return True
  # The characters the last token can have changed: its own, and one it completed.
  need = max(map(len, stop)) + len(last) + 1
  width = 2 * need + _FRONT
  while True:
    lo = max(start, n - width)
    text = _visible_from(reader, generated, lo, decode_visible, before)
    if lo == start:
      break
    text = text[_FRONT:]
    # (newlines at its front may lead the answer, which drops them: look further back)
    if len(text) >= need and not text.startswith("\n"):
      break
    width *= 2
  # A character still unfinished at the end reads U+FFFD: not text yet (a stop "\ufffd",
  # meant for bad bytes, cut every sample at the first byte of its first CJK character or
  # emoji). A real U+FFFD there is seen with the next token. (`cut_at_stop`'s rule.)
  return len(cut_at_stop(text, stop)) < len(text)
