"""Thinking spans of reasoning models: the markers, and where the controller finds them.

A reasoning model (Qwen3, DeepSeek-R1 distills, ...) thinks inside a span such as
`<think> ... </think>` and answers after it. With a `ThinkingSpan` the controller's
loop treats the span as its thinking phase:

  - the prompt ends inside the span (the open marker and a newline are appended
    when the prompt does not already end with it);
  - thinking tokens (min/max budgets, steps, backtracks) are the tokens inside it;
  - the model closing the span ends thinking: below the thinking minimum the close
    is rolled back and "Wait" is forced inside the span (s1's budget forcing);
  - at the budget (or at end of sequence, early exit, out of steps) the controller
    closes the span itself;
  - after the close, the answer prefix follows ("\\n\\n" + prefix, forced when the
    model closed the span itself), so every trace's answer reads the same way;
  - the answer is extracted from the text after the span only; a trace that never
    closed it has no answer.

Settings (the `controller.thinking` config value): "auto" (the markers found in the
chat template, none if it has none), "off", "on" (as auto, but a template without
known markers is an error), or the two markers separated by a space ("<think> </think>").
"""

from __future__ import annotations

import dataclasses

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
    raise ValueError(f"controller.thinking={setting!r}: use one of {list(SETTINGS)} or the two "
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
    raise ValueError("controller.thinking='on' but the chat template names no known thinking "
                     f"markers ({known}): give the markers, e.g. '<think> </think>'")
  return found
