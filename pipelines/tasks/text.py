"""Small text helpers shared by tasks."""

from __future__ import annotations

import unicodedata
from typing import Optional, Sequence, TypedDict

from pipelines.datasets.records import normalize_answer


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


def text_answer_key(text: Optional[str]) -> Optional[str]:
  """What a free-text answer (custom task, answer_format=text) is matched and voted by:
  the GSM8K normalization (commas, ``$``, one trailing period), in Unicode's composed form
  (NFC: "café" typed two ways is one answer), case-folded (str.casefold: "STRASSE" is
  "straße", as lower() did not); None when nothing is left, so an empty reply is never an
  answer."""
  key = unicodedata.normalize("NFC", normalize_answer(text)).casefold() if text is not None else ""
  return key or None
