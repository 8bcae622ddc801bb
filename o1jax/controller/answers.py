"""Answer extraction and voting (host side; no dependency on pipelines).

`extract_number` reads the final numeric answer of a GSM-style trace: the first
number after the last answer prefix (the text after the prefix is read on its
own), else the last number in the whole text; None if there is none. Votes group
answers by this key, so it is defined once, here.

What is a number (`_NUMBER`): an optional sign ("-" or U+2212 "−"), an optional
"$", then either digits and commas starting with a digit ("1,200") with an
optional fraction ("." and digits), or a bare fraction: "." and digits (".5").
A "." right after a digit or after another "." does not start a bare fraction
(its digits start a number of their own): "1.2.3" is 1.2 then 3, "...5" is 5,
"5." is 5; anywhere else it does: ".5", "-.5", "$.5" and "step.5" hold 0.5.
Numbers are read left to right, each as long as it goes ("-$5" is -5, "$-5"
reads "-5", "1,2,3" is 123, "--5" is -5). A non-ASCII decimal digit is a digit
here (the in-loop key cannot read it: unknown there).

The key (`normalize_number`): the number's value written as a plain decimal.
Commas and "$" are dropped; a leading "-" or "−" is a minus; leading zeros of
the integer part are dropped (an empty integer part becomes "0"); trailing zeros
of the fraction are dropped, and a "." left with no digits; a zero value has no
minus. So "$1,200.00" = "1200" = "1200.0" = "01200" -> "1200"; ".5" = "0.50" ->
"0.5"; "-0" = "-0.00" = "−0" -> "0"; "−5" -> "-5". No exponent, no rounding,
any number of digits.
"""

from __future__ import annotations

import collections
import math
import re
from typing import Optional, Sequence

import numpy as np

_NUMBER = re.compile(r"[-\u2212]?\$?(?:\d[\d,]*(?:\.\d+)?|(?<![\d.])\.\d+)")


def normalize_number(raw: str) -> str:
  """The key of a number `_NUMBER` matched (see the module docstring)."""
  s = raw.replace(",", "").replace("$", "")
  negative = s[:1] in ("-", "\u2212")
  whole, _, frac = (s[1:] if negative else s).partition(".")
  whole, frac = whole.lstrip("0") or "0", frac.rstrip("0")
  out = whole + "." + frac if frac else whole
  return "-" + out if negative and out != "0" else out


def extract_number(text: str, prefix: str = "The answer is") -> Optional[str]:
  """The first number after the last `prefix`, else the last number; None if none."""
  at = text.rfind(prefix) if prefix else -1
  if at >= 0:
    # The text after the prefix is read on its own (a "." there may start ".5" whatever
    # the prefix ends with), as the loop's automaton reads it.
    found = _NUMBER.search(text[at + len(prefix):])
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
  return list(totals)[best_index(list(totals.values()))], dict(totals)


def best_index(scores: Sequence[float]) -> int:
  """Index of the highest score, the first among ties; a NaN score is no score (max() and
  np.argmax depend on where a NaN is); every score NaN: 0."""
  best = 0
  for j, v in enumerate(scores):
    if v > scores[best] or (math.isnan(scores[best]) and not math.isnan(v)):
      best = j
  return best


def majority_vote(answers: Sequence[Optional[str]]) -> tuple[Optional[str], dict[str, float]]:
  return weighted_vote(answers, None)


# --- answer keys inside the loop ------------------------------------------------------
#
# DeepConf's consensus stop has to know, on device, which finished traces agree. The
# loop reads the tokens after the answer prefix through a small automaton over
# character classes that gives `extract_number`'s key of the first number there (the
# rule above) and writes it as codes: 0-9 digits, 10 ".", 12 "-", with one change of
# layout: a zero integer part is left out, so "0.5" is [".", 5], "-0.5" is
# ["-", ".", 5] and the value 0 is no code at all (`key_text` / `text_key` convert).
# Nothing is written before a number has surely started; the minus is written with the
# number's first nonzero digit, or with the first digit of its fraction (then a zero
# value ends with no code committed: "-0.0" reads as 0); digits that may still turn
# out to be trailing zeros of the fraction are written but not committed. A prefix
# repeated in the answer restarts it (extract_number reads after the last prefix).
# Traces whose key cannot be followed (no number after the prefix, a token with too
# many characters or one the automaton cannot read) have an unknown key and count as
# wildcards, never as agreement.

DOT, COMMA, MINUS, DOLLAR, OTHER = 10, 11, 12, 13, 14
N_CLASSES = 15
# Automaton states. Before a number (< KEY_INT): searching; after a "." that may start
# a bare fraction; after a "." that may not (it followed a "."); after "-"; after "-$";
# after "-." / "-$.". In a number (>= KEY_INT, the key is known): integer part with a
# nonzero digit written; after its "."; in the fraction; integer part of zeros so far
# (nothing written); the same after a minus; after "-0."; past the number.
(KEY_SEARCH, KEY_POINT, KEY_POINTS, KEY_NEG, KEY_NEG_DOLLAR, KEY_NEG_POINT,
 KEY_INT, KEY_DOT, KEY_FRAC, KEY_ZERO, KEY_NEG_ZERO, KEY_NEG_ZERO_DOT, KEY_DONE) = range(13)
N_STATES = 13
PRE_CODES = 2  # codes a character may write before its own (e.g. "-" and "." before 5)
_CHAR_CLASS = {".": DOT, ",": COMMA, "-": MINUS, "\u2212": MINUS, "$": DOLLAR}


def char_classes(text: str) -> list[int] | None:
  """Classes of `text`'s characters, runs of OTHER merged (None: a non-ASCII digit,
  which the regex reads as a digit but the automaton cannot, or U+FFFD, the text of
  a token that holds part of a character, e.g. one byte of "−")."""
  out: list[int] = []
  for ch in text:
    if "0" <= ch <= "9":
      c = ord(ch) - ord("0")
    elif ch.isdecimal() or ch == "\ufffd":
      return None
    else:
      c = _CHAR_CLASS.get(ch, OTHER)
    if not (c == OTHER and out and out[-1] == OTHER):  # OTHER twice acts as once
      out.append(c)
  return out


def _key_tables():
  """NEXT[state, class]; PRE[state, class, PRE_CODES] (codes written before the
  character's own, -1 none); WRITE (the class is a digit that is written); COMMIT
  (the key so far counts: written up to and with it)."""
  nxt = np.zeros((N_STATES, N_CLASSES), np.int32)
  pre = np.full((N_STATES, N_CLASSES, PRE_CODES), -1, np.int32)
  write = np.zeros((N_STATES, N_CLASSES), bool)
  commit = np.zeros((N_STATES, N_CLASSES), bool)
  before = (KEY_SEARCH, KEY_POINT, KEY_POINTS, KEY_NEG, KEY_NEG_DOLLAR, KEY_NEG_POINT)
  for st in before:
    # Not in a number yet: "-" may start a negative one, "." a bare fraction unless it
    # follows a "."; "$" is dropped (after "-$" another "$" ends the minus); "," and
    # other characters start over.
    negative = st in (KEY_NEG, KEY_NEG_DOLLAR, KEY_NEG_POINT)
    nxt[st, :] = KEY_SEARCH
    nxt[st, MINUS] = KEY_NEG
    nxt[st, DOLLAR] = KEY_NEG_DOLLAR if st == KEY_NEG else KEY_SEARCH
    nxt[st, DOT] = (KEY_POINTS if st in (KEY_POINT, KEY_POINTS, KEY_NEG_POINT)
                    else KEY_NEG_POINT if st in (KEY_NEG, KEY_NEG_DOLLAR) else KEY_POINT)
    for d in range(10):
      if st in (KEY_POINT, KEY_NEG_POINT):  # a bare fraction: ".5"
        nxt[st, d], write[st, d], commit[st, d] = KEY_FRAC, True, d != 0
        pre[st, d] = [MINUS, DOT] if negative else [DOT, -1]
      elif d == 0:  # an integer part that may stay zero: nothing to write yet
        nxt[st, d] = KEY_NEG_ZERO if negative else KEY_ZERO
      else:
        nxt[st, d], write[st, d], commit[st, d] = KEY_INT, True, True
        pre[st, d, 0] = MINUS if negative else -1
  # In a number: the integer part takes digits and commas, "." may open a fraction
  # (written with its first digit), anything else ends it.
  for st in (KEY_INT, KEY_ZERO, KEY_NEG_ZERO):
    nxt[st, :] = KEY_DONE
    nxt[st, COMMA] = st
    nxt[st, DOT] = KEY_NEG_ZERO_DOT if st == KEY_NEG_ZERO else KEY_DOT
    for d in range(10):
      if st == KEY_INT or d != 0:  # a nonzero integer: written as it comes
        nxt[st, d], write[st, d], commit[st, d] = KEY_INT, True, True
        pre[st, d, 0] = MINUS if st == KEY_NEG_ZERO else -1
      else:  # a leading zero: dropped
        nxt[st, d] = st
  for st in (KEY_DOT, KEY_NEG_ZERO_DOT, KEY_FRAC):
    nxt[st, :] = KEY_DONE  # "." without a digit is not part of it
    for d in range(10):
      nxt[st, d], write[st, d], commit[st, d] = KEY_FRAC, True, d != 0  # trailing zeros wait
      pre[st, d] = ([MINUS, DOT] if st == KEY_NEG_ZERO_DOT else [DOT, -1] if st == KEY_DOT
                    else [-1, -1])
  nxt[KEY_DONE, :] = KEY_DONE
  return nxt, pre, write, commit


KEY_NEXT, KEY_PRE, KEY_WRITE, KEY_COMMIT = _key_tables()


def key_of_classes(classes) -> tuple[int, list[int]]:
  """Runs the automaton on the host: (final state, key codes; see `key_text`)."""
  st, codes, commit = KEY_SEARCH, [], 0
  for c in classes:
    for p in KEY_PRE[st, c]:
      if p >= 0:
        codes.append(int(p))
    if KEY_WRITE[st, c]:
      codes.append(int(c))
      if KEY_COMMIT[st, c]:
        commit = len(codes)
    st = int(KEY_NEXT[st, c])
  return st, codes[:commit]


def key_text(codes) -> str:
  """Key codes -> the key `extract_number` would return (a zero integer part is left
  out of the codes: none at all is "0", a leading "." is "0.")."""
  s = "".join("." if c == DOT else "-" if c == MINUS else str(int(c)) for c in codes)
  if s.startswith("-."):
    return "-0" + s[1:]
  return "0" + s if s[:1] in ("", ".") else s


def text_key(answer: str) -> list[int] | None:
  """A number (one `_NUMBER` reads whole, e.g. a key) -> its key codes; None if it is
  not one."""
  if not _NUMBER.fullmatch(answer):
    return None
  s = normalize_number(answer)
  negative = s.startswith("-")
  s = s.lstrip("-")
  s = "" if s == "0" else s[1:] if s.startswith("0.") else s
  return ([MINUS] if negative else []) + [DOT if ch == "." else ord(ch) - ord("0") for ch in s]
