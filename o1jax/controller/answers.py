"""Answer extraction and voting (host side; no dependency on pipelines).

`extract_number` reads the final numeric answer of a GSM-style trace: the
first number after the answer prefix if the prefix is present, else the last
number in the text; commas, "$" and trailing zeros of decimals are removed so
"1,200.00" and "1200" vote together.
"""

from __future__ import annotations

import collections
import math
import re
from typing import Callable, Optional, Sequence

import numpy as np

_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")

AnswerExtractor = Callable[[str], Optional[str]]


def normalize_number(raw: str) -> str:
  s = raw.replace(",", "").replace("$", "")
  if "." in s:
    s = s.rstrip("0").rstrip(".")
  return s or "0"


def extract_number(text: str, prefix: str = "The answer is") -> Optional[str]:
  """The answer after `prefix` (first number), else the last number; None if none."""
  at = text.rfind(prefix) if prefix else -1
  if at >= 0:
    found = _NUMBER.search(text, at + len(prefix))
    if found:
      return normalize_number(found.group())
  found = _NUMBER.findall(text)
  return normalize_number(found[-1]) if found else None


def weighted_vote(answers: Sequence[Optional[str]],
                  weights: Sequence[float] | None = None) -> tuple[Optional[str], dict[str, float]]:
  """Answer with the largest total weight (ties: the one seen first); None answers abstain.

  A NaN total (a NaN weight, or inf + -inf) is no number: it never beats one, and wins
  only when every total is NaN (then the first seen). Returns (winner, {answer: total weight})."""
  weights = [1.0] * len(answers) if weights is None else list(weights)
  totals: dict[str, float] = collections.OrderedDict()
  for a, w in zip(answers, weights):
    if a is not None:
      totals[a] = totals.get(a, 0.0) + float(w)
  if not totals:
    return None, {}
  winner = None  # (max() with a NaN depends on the order, and `v == nan` never holds)
  for a, v in totals.items():
    if winner is None or v > totals[winner] or (math.isnan(totals[winner]) and not math.isnan(v)):
      winner = a
  return winner, dict(totals)


def majority_vote(answers: Sequence[Optional[str]]) -> tuple[Optional[str], dict[str, float]]:
  return weighted_vote(answers, None)


# --- answer keys inside the loop ------------------------------------------------------
#
# DeepConf's consensus stop has to know, on device, which finished traces agree. The
# loop reads the tokens after the answer prefix through a small automaton over
# character classes that mirrors `extract_number` (first number after the prefix,
# commas and "$" dropped, trailing zeros of a decimal dropped) and writes the
# normalized number as codes: 0-9 digits, 10 ".", 12 "-". A prefix repeated in the
# answer restarts it (extract_number reads after the last prefix). Traces whose key
# cannot be followed (no number after the prefix, a token with too many characters)
# have an unknown key and count as wildcards, never as agreement.

DOT, COMMA, MINUS, DOLLAR, OTHER = 10, 11, 12, 13, 14
N_CLASSES = 15
# Automaton states: before a number, after "-" / "-$", in the integer part, after
# ".", in the fraction, past the number.
(KEY_SEARCH, KEY_NEG, KEY_NEG_DOLLAR, KEY_INT, KEY_DOT, KEY_FRAC, KEY_DONE) = range(7)
_CHAR_CLASS = {".": DOT, ",": COMMA, "-": MINUS, "$": DOLLAR}


def char_classes(text: str) -> list[int] | None:
  """Classes of `text`'s characters, runs of OTHER merged (None: a non-ASCII digit,
  which the regex reads as a digit but the automaton cannot)."""
  out: list[int] = []
  for ch in text:
    if "0" <= ch <= "9":
      c = ord(ch) - ord("0")
    elif ch.isdecimal():
      return None
    else:
      c = _CHAR_CLASS.get(ch, OTHER)
    if not (c == OTHER and out and out[-1] == OTHER):  # OTHER twice acts as once
      out.append(c)
  return out


def _key_tables():
  """NEXT[state, class], PRE (code written before the digit, -1 none), WRITE (the
  class is a digit that is written), COMMIT (it counts in the normalized key)."""
  n_states = 7
  nxt = np.zeros((n_states, N_CLASSES), np.int32)
  pre = np.full((n_states, N_CLASSES), -1, np.int32)
  write = np.zeros((n_states, N_CLASSES), bool)
  commit = np.zeros((n_states, N_CLASSES), bool)
  digits = range(10)
  for c in range(N_CLASSES):
    d = c in digits
    # Before a number: "-" and "-$" may start a negative one; "$" alone is dropped.
    nxt[KEY_SEARCH, c] = KEY_INT if d else KEY_NEG if c == MINUS else KEY_SEARCH
    nxt[KEY_NEG, c] = (KEY_INT if d else KEY_NEG_DOLLAR if c == DOLLAR
                       else KEY_NEG if c == MINUS else KEY_SEARCH)
    nxt[KEY_NEG_DOLLAR, c] = KEY_INT if d else KEY_NEG if c == MINUS else KEY_SEARCH
    # Integer part: digits and commas; "." may open a fraction; anything else ends it.
    nxt[KEY_INT, c] = KEY_INT if d or c == COMMA else KEY_DOT if c == DOT else KEY_DONE
    nxt[KEY_DOT, c] = KEY_FRAC if d else KEY_DONE  # "." without a digit is not part of it
    nxt[KEY_FRAC, c] = KEY_FRAC if d else KEY_DONE
    nxt[KEY_DONE, c] = KEY_DONE
    if d:
      for st in (KEY_SEARCH, KEY_NEG, KEY_NEG_DOLLAR, KEY_INT, KEY_DOT, KEY_FRAC):
        write[st, c] = True
        commit[st, c] = st not in (KEY_DOT, KEY_FRAC) or c != 0  # trailing zeros wait
      pre[KEY_NEG, c] = pre[KEY_NEG_DOLLAR, c] = MINUS
      pre[KEY_DOT, c] = DOT
  return nxt, pre, write, commit


KEY_NEXT, KEY_PRE, KEY_WRITE, KEY_COMMIT = _key_tables()


def key_of_classes(classes) -> tuple[int, list[int]]:
  """Runs the automaton on the host: (final state, normalized key codes)."""
  st, codes, commit = KEY_SEARCH, [], 0
  for c in classes:
    if KEY_PRE[st, c] >= 0:
      codes.append(int(KEY_PRE[st, c]))
    if KEY_WRITE[st, c]:
      codes.append(int(c))
      if KEY_COMMIT[st, c]:
        commit = len(codes)
    st = int(KEY_NEXT[st, c])
  return st, codes[:commit]


def key_text(codes) -> str:
  """Key codes -> the normalized number string `extract_number` would return."""
  return "".join("." if c == DOT else "-" if c == MINUS else str(int(c)) for c in codes)


def text_key(answer: str) -> list[int] | None:
  """A normalized number string -> key codes (None if it is not one)."""
  out = []
  for ch in answer:
    if "0" <= ch <= "9":
      out.append(ord(ch) - ord("0"))
    elif ch in ".-":
      out.append(DOT if ch == "." else MINUS)
    else:
      return None
  return out
