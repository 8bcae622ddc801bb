"""Small text helpers shared by tasks."""

from __future__ import annotations

from typing import Sequence, TypedDict


class ChatMessage(TypedDict):
  """One chat turn; the model layer renders a list of these with its chat template."""
  role: str  # "system" | "user" | "assistant"
  content: str


def truncate_at_stop(text: str, stop_sequences: Sequence[str]) -> str:
  """Cut `text` at the earliest occurrence of any stop sequence (exclusive).

  Engines may overshoot a stop by a few tokens or not stop at all; applying
  this after generation makes scoring independent of where decoding halted.
  """
  cut = len(text)
  for stop in stop_sequences:
    if not stop:
      continue
    i = text.find(stop)
    if 0 <= i < cut:
      cut = i
  return text[:cut]
