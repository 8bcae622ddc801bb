"""Offline GSM-style word problems with computed answers (the default GSM set).

Why: real GSM8K is hard for the embedded 135M model (~1.5%), and data must not
be downloaded at run time. This generator gives an always-available set with a
difficulty knob: level 1 is a single small-number step ("Tom has 3 apples and
buys 4 more"), levels 2-3 chain two/three steps (money, time, rates) and level
4 needs four or more (percentages, discounts, rates).

Records use GSM8K's own format: ``question`` and ``answer`` (a short worked
solution with ``<<a+b=c>>`` calculator annotations, ending in ``#### N``),
plus ``id``, ``level`` and ``template``.

Determinism: problem i depends only on (seed, i, levels), through its own RNG, and
on the problems before it (a question already asked is drawn again), so the first n
problems are the same whatever count is requested.

  python -m pipelines.datasets.gsm_synthetic --n 200 --seed 0 --out FILE.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import numbers
import os
import random
import sys
from fractions import Fraction
from typing import Callable, Iterator, Sequence

from pipelines.datasets.records import Example

DATASET = "gsm_synthetic"
LEVELS = (1, 2, 3, 4)

# --------------------------------------------------------------------------
# Vocabulary.

_PEOPLE = (
    ("Tom", "he", "him", "his"), ("Anna", "she", "her", "her"),
    ("Liam", "he", "him", "his"), ("Maya", "she", "her", "her"),
    ("Omar", "he", "him", "his"), ("Sofia", "she", "her", "her"),
    ("Ben", "he", "him", "his"), ("Chloe", "she", "her", "her"),
    ("Kenji", "he", "him", "his"), ("Priya", "she", "her", "her"),
    ("Lucas", "he", "him", "his"), ("Emma", "she", "her", "her"),
    ("Diego", "he", "him", "his"), ("Fatima", "she", "her", "her"),
    ("Noah", "he", "him", "his"), ("Grace", "she", "her", "her"),
    ("Samuel", "he", "him", "his"), ("Hana", "she", "her", "her"),
    ("Ethan", "he", "him", "his"), ("Zoe", "she", "her", "her"),
    ("Mateo", "he", "him", "his"), ("Lily", "she", "her", "her"),
    ("Jack", "he", "him", "his"), ("Aisha", "she", "her", "her"),
    ("Leo", "he", "him", "his"), ("Nora", "she", "her", "her"),
    ("Ravi", "he", "him", "his"), ("Elena", "she", "her", "her"),
    ("Owen", "he", "him", "his"), ("Mia", "she", "her", "her"),
    ("Felix", "he", "him", "his"), ("Ruby", "she", "her", "her"),
)

# Countable things a person can own, as (singular, plural).
_ITEMS = (
    ("apple", "apples"), ("pencil", "pencils"), ("marble", "marbles"),
    ("sticker", "stickers"), ("book", "books"), ("toy car", "toy cars"),
    ("seashell", "seashells"), ("stamp", "stamps"), ("balloon", "balloons"),
    ("crayon", "crayons"), ("bead", "beads"), ("trading card", "trading cards"),
    ("orange", "oranges"), ("button", "buttons"), ("rubber duck", "rubber ducks"),
    ("comic book", "comic books"), ("flower", "flowers"), ("coin", "coins"),
)
_FOODS = (
    ("cookie", "cookies"), ("grape", "grapes"), ("strawberry", "strawberries"),
    ("cupcake", "cupcakes"), ("cracker", "crackers"), ("muffin", "muffins"),
    ("dumpling", "dumplings"), ("carrot stick", "carrot sticks"),
)
_CONTAINERS = (
    ("box", "boxes"), ("bag", "bags"), ("basket", "baskets"), ("jar", "jars"),
    ("pack", "packs"), ("crate", "crates"), ("tray", "trays"), ("bucket", "buckets"),
)
# Things to buy, with a plausible whole-dollar price range.
_GOODS = (
    ("notebook", "notebooks", 2, 6), ("sandwich", "sandwiches", 4, 9),
    ("toy robot", "toy robots", 8, 25), ("T-shirt", "T-shirts", 6, 20),
    ("ball", "balls", 3, 12), ("comic book", "comic books", 2, 8),
    ("plant pot", "plant pots", 3, 10), ("movie ticket", "movie tickets", 7, 15),
    ("lunch box", "lunch boxes", 5, 14), ("puzzle", "puzzles", 6, 18),
    ("scarf", "scarves", 8, 20), ("water bottle", "water bottles", 4, 12),
)
_ACTIVITIES = ("practicing piano", "reading", "drawing", "running", "doing homework",
               "playing chess", "swimming", "gardening")
_DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")


@dataclasses.dataclass(frozen=True)
class _Person:
  name: str
  he: str
  him: str
  his: str

  @property
  def He(self) -> str:  # pylint: disable=invalid-name
    return self.he.capitalize()


class _Retry(Exception):
  """A template's random draw violated a constraint; draw again."""


class _Ctx:
  """Per-problem RNG plus vocabulary helpers, so templates stay short."""

  def __init__(self, rng: random.Random):
    self.rng = rng
    self._used_names: set[str] = set()

  def person(self) -> _Person:
    while True:
      p = _Person(*self.rng.choice(_PEOPLE))
      if p.name not in self._used_names:
        self._used_names.add(p.name)
        return p

  def n(self, lo: int, hi: int) -> int:
    return self.rng.randint(lo, hi)

  def pick(self, seq):
    return self.rng.choice(seq)


_PREC = {"+": 0, "-": 0, "*": 1, "/": 1}


def _calc(*tokens) -> tuple[int, str]:
  """Evaluate ``a op b [op c ...]`` exactly and return (value, solution text).

  The text is GSM8K style, ``3 + 4 = <<3+4=7>>7``. Evaluation is left to right,
  so the generator refuses expressions where that differs from usual operator
  precedence; non-integer or negative results ask the template to redraw.
  """
  nums = tokens[0::2]
  ops = tokens[1::2]
  for i in range(1, len(ops)):
    if _PREC[ops[i]] > _PREC[ops[i - 1]]:
      raise ValueError(f"ambiguous precedence in {tokens}")
  val = Fraction(nums[0])
  for op, x in zip(ops, nums[1:]):
    if op == "+":
      val += x
    elif op == "-":
      val -= x
    elif op == "*":
      val *= x
    elif op == "/":
      val /= x
    else:
      raise ValueError(op)
    if val.denominator != 1 or val < 0:
      raise _Retry()
  r = int(val)
  compact = "".join(str(t) for t in tokens)
  spaced = " ".join(str(t) for t in tokens)
  return r, f"{spaced} = <<{compact}={r}>>{r}"


def _count(n: int, one: str, many: str) -> str:
  """"1 mile", "3 miles": a count of something in a question's words."""
  return f"{n} {one if n == 1 else many}"


def _hours(h: int) -> str:
  return _count(h, "hour", "hours")


Template = Callable[[_Ctx], tuple[str, list[str], int]]
_TEMPLATES: dict[int, list[tuple[str, Template]]] = {lvl: [] for lvl in LEVELS}


def _template(level: int):
  def register(fn: Template) -> Template:
    _TEMPLATES[level].append((fn.__name__.lstrip("_"), fn))
    return fn
  return register


# --------------------------------------------------------------------------
# Level 1: one arithmetic step, small numbers.

@_template(1)
def _more(c: _Ctx):
  p, (_, items) = c.person(), c.pick(_ITEMS)
  a, b = c.n(2, 15), c.n(1, 10)
  verb = c.pick(("buys", "finds", "gets", "is given"))
  q = (f"{p.name} has {a} {items}. {p.He} {verb} {b} more. "
       f"How many {items} does {p.name} have now?")
  r, s = _calc(a, "+", b)
  return q, [f"{p.name} has {s} {items} now."], r


@_template(1)
def _give_away(c: _Ctx):
  p, f, (_, items) = c.person(), c.person(), c.pick(_ITEMS)
  b, left = c.n(1, 9), c.n(1, 12)
  a = b + left
  q = (f"{p.name} had {a} {items}. {p.He} gave {b} of them to {f.name}. "
       f"How many {items} does {p.name} have left?")
  r, s = _calc(a, "-", b)
  return q, [f"{p.name} has {s} {items} left."], r


@_template(1)
def _together(c: _Ctx):
  p, f, (_, items) = c.person(), c.person(), c.pick(_ITEMS)
  a, b = c.n(2, 15), c.n(2, 15)
  q = (f"{p.name} has {a} {items} and {f.name} has {b} {items}. "
       f"How many {items} do they have altogether?")
  r, s = _calc(a, "+", b)
  return q, [f"Together they have {s} {items}."], r


@_template(1)
def _groups(c: _Ctx):
  p, (_, items) = c.person(), c.pick(_ITEMS)
  (box, boxes) = c.pick(_CONTAINERS)
  g, k = c.n(2, 5), c.n(2, 10)
  q = (f"{p.name} has {g} {boxes}. Each {box} has {k} {items} in it. "
       f"How many {items} does {p.name} have?")
  r, s = _calc(g, "*", k)
  return q, [f"{p.name} has {s} {items}."], r


@_template(1)
def _split_evenly(c: _Ctx):
  p, (_, items) = c.person(), c.pick(_ITEMS)
  (box, boxes) = c.pick(_CONTAINERS)
  g, k = c.n(2, 5), c.n(2, 6)
  t = g * k
  q = (f"{p.name} puts {t} {items} into {g} {boxes}, with the same number in each "
       f"{box}. How many {items} are in each {box}?")
  r, s = _calc(t, "/", g)
  return q, [f"Each {box} has {s} {items}."], r


@_template(1)
def _eat(c: _Ctx):
  p, (_, foods) = c.person(), c.pick(_FOODS)
  b, left = c.n(1, 8), c.n(1, 12)
  a = b + left
  q = (f"There are {a} {foods} on a plate. {p.name} eats {b} of them. "
       f"How many {foods} are left on the plate?")
  r, s = _calc(a, "-", b)
  return q, [f"There are {s} {foods} left."], r


@_template(1)
def _older(c: _Ctx):
  p, f = c.person(), c.person()
  a, b = c.n(4, 15), c.n(2, 9)
  q = f"{p.name} is {a} years old. {f.name} is {b} years older than {p.name}. How old is {f.name}?"
  r, s = _calc(a, "+", b)
  return q, [f"{f.name} is {s} years old."], r


@_template(1)
def _two_prices(c: _Ctx):
  g1, g2 = c.rng.sample(_GOODS, 2)
  a, b = c.n(g1[2], min(g1[3], 15)), c.n(g2[2], min(g2[3], 15))
  q = (f"A {g1[0]} costs ${a} and a {g2[0]} costs ${b}. "
       f"How many dollars do the two cost together?")
  r, s = _calc(a, "+", b)
  return q, [f"Together they cost {s} dollars."], r


@_template(1)
def _pages(c: _Ctx):
  p = c.person()
  d1, d2 = c.rng.sample(_DAYS[:6], 2)
  a, b = c.n(3, 20), c.n(3, 20)
  q = (f"{p.name} read {a} pages on {d1} and {b} pages on {d2}. "
       f"How many pages did {p.he} read on those two days?")
  r, s = _calc(a, "+", b)
  return q, [f"{p.name} read {s} pages."], r


@_template(1)
def _fewer(c: _Ctx):
  p, f, (_, items) = c.person(), c.person(), c.pick(_ITEMS)
  b, r0 = c.n(2, 8), c.n(1, 12)
  a = b + r0
  q = (f"{p.name} has {a} {items}. {f.name} has {b} fewer {items} than {p.name}. "
       f"How many {items} does {f.name} have?")
  r, s = _calc(a, "-", b)
  return q, [f"{f.name} has {s} {items}."], r


@_template(1)
def _bus(c: _Ctx):
  a, b = c.n(3, 20), c.n(2, 10)
  vehicle = c.pick(("bus", "train car", "ferry", "tram"))
  q = (f"There are {a} people on a {vehicle}. At the next stop, {b} more people get on "
       f"and nobody gets off. How many people are on the {vehicle} now?")
  r, s = _calc(a, "+", b)
  return q, [f"There are {s} people on the {vehicle}."], r


@_template(1)
def _birds(c: _Ctx):
  b, left = c.n(2, 9), c.n(1, 12)
  a = b + left
  animal, place = c.pick((("birds", "on a fence"), ("ducks", "in a pond"),
                          ("squirrels", "in a tree"), ("frogs", "on a log")))
  q = f"There are {a} {animal} {place}. Then {b} of them leave. How many {animal} are still there?"
  r, s = _calc(a, "-", b)
  return q, [f"There are {s} {animal} still there."], r


# --------------------------------------------------------------------------
# Level 2: two steps.

@_template(2)
def _buy_then_give(c: _Ctx):
  p, f, (_, items) = c.person(), c.person(), c.pick(_ITEMS)
  a, b, g = c.n(5, 30), c.n(3, 20), c.n(2, 15)
  q = (f"{p.name} has {a} {items}. {p.He} buys {b} more and then gives {g} to {f.name}. "
       f"How many {items} does {p.name} have now?")
  t, s1 = _calc(a, "+", b)
  r, s2 = _calc(t, "-", g)
  return q, [f"After buying, {p.name} has {s1} {items}.",
             f"After giving some away, {p.he} has {s2} {items}."], r


@_template(2)
def _groups_plus_loose(c: _Ctx):
  p, (_, items), (box, boxes) = c.person(), c.pick(_ITEMS), c.pick(_CONTAINERS)
  g, k, e = c.n(2, 8), c.n(3, 12), c.n(1, 9)
  q = (f"{p.name} has {g} {boxes} with {k} {items} in each {box}, plus {e} more {items} "
       f"that are not in a {box}. How many {items} does {p.name} have in total?")
  t, s1 = _calc(g, "*", k)
  r, s2 = _calc(t, "+", e)
  return q, [f"The {boxes} hold {s1} {items}.", f"In total {p.he} has {s2} {items}."], r


@_template(2)
def _change(c: _Ctx):
  p = c.person()
  one, many, lo, hi = c.pick(_GOODS)
  n, price = c.n(2, 5), c.n(lo, hi)
  cost = n * price
  bill = next((b for b in (10, 20, 50, 100) if b > cost), None)
  if bill is None:
    raise _Retry()
  q = (f"{p.name} buys {n} {many} that cost ${price} each. {p.He} pays with a ${bill} bill. "
       f"How much change does {p.he} get, in dollars?")
  t, s1 = _calc(n, "*", price)
  r, s2 = _calc(bill, "-", t)
  return q, [f"The {many} cost {s1} dollars.", f"The change is {s2} dollars."], r


@_template(2)
def _twice_as_many(c: _Ctx):
  p, f, (_, items) = c.person(), c.person(), c.pick(_ITEMS)
  a = c.n(3, 25)
  q = (f"{p.name} has {a} {items}. {f.name} has twice as many {items} as {p.name}. "
       f"How many {items} do they have together?")
  b, s1 = _calc(a, "*", 2)
  r, s2 = _calc(a, "+", b)
  return q, [f"{f.name} has {s1} {items}.", f"Together they have {s2} {items}."], r


@_template(2)
def _save_then_spend(c: _Ctx):
  p = c.person()
  one, _, lo, hi = c.pick(_GOODS)
  s, w = c.n(3, 15), c.n(3, 10)
  x = c.n(lo, hi)
  if x >= s * w:
    raise _Retry()
  q = (f"{p.name} saves {s} dollars every week for {w} weeks. Then {p.he} spends ${x} on a {one}. "
       f"How many dollars does {p.he} have left?")
  t, s1 = _calc(s, "*", w)
  r, s2 = _calc(t, "-", x)
  return q, [f"{p.name} saves {s1} dollars.", f"{p.He} has {s2} dollars left."], r


@_template(2)
def _daily_minutes(c: _Ctx):
  p = c.person()
  act1, act2 = c.rng.sample(_ACTIVITIES, 2)
  a, b, d = c.n(10, 45), c.n(10, 45), c.n(2, 7)
  q = (f"Every day {p.name} spends {a} minutes {act1} and {b} minutes {act2}. "
       f"How many minutes does {p.he} spend on these two activities in {d} days?")
  t, s1 = _calc(a, "+", b)
  r, s2 = _calc(t, "*", d)
  return q, [f"Each day {p.he} spends {s1} minutes.", f"In {d} days that is {s2} minutes."], r


@_template(2)
def _bake_and_share(c: _Ctx):
  p, (_, foods) = c.person(), c.pick(_FOODS)
  g, each, e = c.n(2, 6), c.n(2, 8), c.n(1, 6)
  t = g * each + e
  q = (f"{p.name} had {t} {foods}. {p.He} ate {e} of them and shared the rest equally "
       f"among {g} friends. How many {foods} did each friend get?")
  rest, s1 = _calc(t, "-", e)
  r, s2 = _calc(rest, "/", g)
  return q, [f"{s1} {foods} were left to share.", f"Each friend got {s2} {foods}."], r


@_template(2)
def _half_then_buy(c: _Ctx):
  p, f, (_, items) = c.person(), c.person(), c.pick(_ITEMS)
  a, b = 2 * c.n(3, 20), c.n(2, 15)
  q = (f"{p.name} had {a} {items}. {p.He} gave half of them to {f.name} and then bought "
       f"{b} more. How many {items} does {p.name} have now?")
  h, s1 = _calc(a, "/", 2)
  r, s2 = _calc(h, "+", b)
  return q, [f"After giving half away, {p.he} had {s1} {items}.",
             f"After buying more, {p.he} has {s2} {items}."], r


@_template(2)
def _dozen_eggs(c: _Ctx):
  p = c.person()
  d = c.n(2, 5)
  u = c.n(3, 12 * d - 1)
  use = c.pick(("to bake a cake", "for breakfast this week", "to make pancakes"))
  q = (f"{p.name} buys {d} dozen eggs. {p.He} uses {u} eggs {use}. "
       f"How many eggs are left?")
  t, s1 = _calc(d, "*", 12)
  r, s2 = _calc(t, "-", u)
  return q, [f"{d} dozen eggs is {s1} eggs.", f"{s2} eggs are left."], r


@_template(2)
def _three_days_walk(c: _Ctx):
  p = c.person()
  a, b, d = c.n(1, 9), c.n(1, 9), c.n(1, 9)
  what = c.pick(("walked", "cycled", "jogged"))
  q = (f"{p.name} {what} {_count(a, 'mile', 'miles')} on Monday, {_count(b, 'mile', 'miles')} "
       f"on Tuesday and {_count(d, 'mile', 'miles')} on Wednesday. How many miles did {p.he} "
       f"cover in the three days?")
  t, s1 = _calc(a, "+", b)
  r, s2 = _calc(t, "+", d)
  return q, [f"On the first two days {p.he} covered {s1} miles.",
             f"With Wednesday that makes {s2} miles."], r


# --------------------------------------------------------------------------
# Level 3: three steps (money, time, rates).

@_template(3)
def _shopping(c: _Ctx):
  p = c.person()
  g1, g2 = c.rng.sample(_GOODS, 2)
  n1, n2 = c.n(2, 6), c.n(2, 6)
  p1, p2 = c.n(g1[2], g1[3]), c.n(g2[2], g2[3])
  q = (f"{p.name} buys {n1} {g1[1]} for ${p1} each and {n2} {g2[1]} for ${p2} each. "
       f"How many dollars does {p.he} spend in total?")
  a, s1 = _calc(n1, "*", p1)
  b, s2 = _calc(n2, "*", p2)
  r, s3 = _calc(a, "+", b)
  return q, [f"The {g1[1]} cost {s1} dollars.", f"The {g2[1]} cost {s2} dollars.",
             f"In total {p.he} spends {s3} dollars."], r


@_template(3)
def _budget(c: _Ctx):
  p = c.person()
  g1, g2 = c.rng.sample(_GOODS, 2)
  n, price, other = c.n(2, 5), c.n(g1[2], g1[3]), c.n(g2[2], g2[3])
  money = n * price + other + c.n(1, 30)
  q = (f"{p.name} has ${money}. {p.He} buys {n} {g1[1]} for ${price} each and a {g2[0]} "
       f"for ${other}. How many dollars does {p.he} have left?")
  a, s1 = _calc(n, "*", price)
  t, s2 = _calc(a, "+", other)
  r, s3 = _calc(money, "-", t)
  return q, [f"The {g1[1]} cost {s1} dollars.", f"Altogether {p.he} spends {s2} dollars.",
             f"{p.He} has {s3} dollars left."], r


@_template(3)
def _legs(c: _Ctx):
  a1, l1, a2, l2 = c.pick((("chickens", 2, "cows", 4), ("ducks", 2, "goats", 4),
                           ("spiders", 8, "beetles", 6), ("geese", 2, "horses", 4)))
  x, y = c.n(2, 15), c.n(2, 12)
  q = (f"A farm has {x} {a1} and {y} {a2}. Each of the {a1} has {l1} legs and each of the "
       f"{a2} has {l2} legs. How many legs do the animals have altogether?")
  a, s1 = _calc(x, "*", l1)
  b, s2 = _calc(y, "*", l2)
  r, s3 = _calc(a, "+", b)
  return q, [f"The {a1} have {s1} legs.", f"The {a2} have {s2} legs.",
             f"Altogether there are {s3} legs."], r


@_template(3)
def _two_speeds(c: _Ctx):
  who = c.pick(("A car", "A truck", "A bus", "A train"))
  s1_, h1, s2_, h2 = c.n(3, 8) * 10, c.n(1, 4), c.n(3, 8) * 10, c.n(1, 4)
  q = (f"{who} travels at {s1_} miles per hour for {_hours(h1)} and then at {s2_} miles per "
       f"hour for {_hours(h2)}. How many miles does it travel in total?")
  a, s1 = _calc(s1_, "*", h1)
  b, s2 = _calc(s2_, "*", h2)
  r, s3 = _calc(a, "+", b)
  return q, [f"First it travels {s1} miles.", f"Then it travels {s2} miles.",
             f"In total it travels {s3} miles."], r


@_template(3)
def _hours_minutes(c: _Ctx):
  p, act = c.person(), c.pick(_ACTIVITIES)
  h, m, d = c.n(1, 2), c.n(1, 5) * 5, c.n(2, 6)
  q = (f"{p.name} spends {_hours(h)} and {m} minutes {act} every day. "
       f"How many minutes does {p.he} spend {act} in {d} days?")
  a, s1 = _calc(h, "*", 60)
  b, s2 = _calc(a, "+", m)
  r, s3 = _calc(b, "*", d)
  return q, [f"{_hours(h)} is {s1} minutes.",
             f"Each day {p.he} spends {s2} minutes.", f"In {d} days that is {s3} minutes."], r


@_template(3)
def _class_groups(c: _Ctx):
  k, groups = c.n(2, 5), c.n(3, 8)
  total = k * groups
  boys = c.n(1, total - 1)
  girls = total - boys
  per, (_, items) = c.n(2, 6), c.pick(_ITEMS)
  q = (f"A class has {_count(boys, 'boy', 'boys')} and {_count(girls, 'girl', 'girls')}. "
       f"The teacher puts the children into "
       f"groups of {k}, and gives each group {per} {items}. How many {items} does the "
       f"teacher give out?")
  t, s1 = _calc(boys, "+", girls)
  g, s2 = _calc(t, "/", k)
  r, s3 = _calc(g, "*", per)
  return q, [f"There are {s1} children.", f"That makes {s2} groups.",
             f"The teacher gives out {s3} {items}."], r


@_template(3)
def _saving_goal(c: _Ctx):
  p, f = c.person(), c.person()
  one, _, _, _ = c.pick(_GOODS)
  s, weeks = c.n(2, 10), c.n(2, 8)
  have, gift = c.n(5, 30), c.n(5, 20)
  cost = have + gift + s * weeks
  q = (f"{p.name} wants a {one} that costs ${cost}. {p.He} has ${have} saved, and "
       f"{f.name} gives {p.him} ${gift}. If {p.he} saves {s} dollars each week, how many weeks "
       f"will it take {p.him} to have enough money?")
  a, s1 = _calc(cost, "-", have)
  b, s2 = _calc(a, "-", gift)
  r, s3 = _calc(b, "/", s)
  return q, [f"Before the gift {p.he} still needs {s1} dollars.", f"After the gift {p.he} needs {s2} dollars.",
             f"It takes {s3} weeks."], r


@_template(3)
def _two_day_sales(c: _Ctx):
  shop, (_, things) = c.pick(("bookstore", "toy shop", "market stall", "bakery")), c.pick(_ITEMS)
  b = c.n(3, 20)
  a = 3 * b + c.n(1, 40)
  q = (f"A {shop} has {a} {things}. It sells {b} on Monday and twice as many on Tuesday. "
       f"How many {things} are left?")
  t, s1 = _calc(b, "*", 2)
  u, s2 = _calc(b, "+", t)
  r, s3 = _calc(a, "-", u)
  return q, [f"On Tuesday it sells {s1} {things}.", f"Over both days it sells {s2}.",
             f"{s3} {things} are left."], r


@_template(3)
def _pizza(c: _Ctx):
  p = c.person()
  n, sl = c.n(2, 5), c.pick((6, 8, 10, 12))
  people, each = c.n(2, 6), c.n(1, 3)
  if people * each > n * sl:
    raise _Retry()
  q = (f"{p.name} orders {n} pizzas, and each pizza is cut into {sl} slices. {people} people "
       f"each eat {each} slice{'s' if each > 1 else ''}. How many slices are left?")
  a, s1 = _calc(n, "*", sl)
  b, s2 = _calc(people, "*", each)
  r, s3 = _calc(a, "-", b)
  return q, [f"There are {s1} slices.", f"{s2} slices are eaten.", f"{s3} slices are left."], r


# --------------------------------------------------------------------------
# Level 4: four or more steps, with percentages and rates.

@_template(4)
def _discount_change(c: _Ctx):
  p = c.person()
  one, many, lo, hi = c.pick(_GOODS)
  d = c.pick((10, 20, 25, 50))
  price = c.n(2 * lo, 3 * hi)
  if (price * d) % 100:
    raise _Retry()
  n = c.n(2, 4)
  disc = price * d // 100
  total = n * (price - disc)
  bill = ((total // 50) + 1) * 50
  q = (f"A {one} normally costs ${price}. This week it is {d}% off. {p.name} buys {n} {many} "
       f"and pays with ${bill}. How many dollars of change does {p.he} get?")
  a, s1 = _calc(price, "*", d, "/", 100)
  b, s2 = _calc(price, "-", a)
  t, s3 = _calc(n, "*", b)
  r, s4 = _calc(bill, "-", t)
  return q, [f"The discount is {s1} dollars.", f"Each {one} costs {s2} dollars.",
             f"{n} {many} cost {s3} dollars.", f"The change is {s4} dollars."], r


@_template(4)
def _wages_after_rent(c: _Ctx):
  p = c.person()
  rate, hours, days = c.n(8, 20), c.n(3, 8), c.n(3, 6)
  pct = c.pick((10, 20, 25, 50))
  what = c.pick(("rent", "a savings account", "groceries"))
  if (rate * hours * days * pct) % 100:
    raise _Retry()
  q = (f"{p.name} earns ${rate} per hour. {p.He} works {hours} hours a day for {days} days. "
       f"{p.He} puts {pct}% of the money toward {what}. How many dollars does {p.he} have left?")
  h, s1 = _calc(hours, "*", days)
  e, s2 = _calc(h, "*", rate)
  x, s3 = _calc(e, "*", pct, "/", 100)
  r, s4 = _calc(e, "-", x)
  return q, [f"{p.He} works {s1} hours.", f"{p.He} earns {s2} dollars.",
             f"{p.He} puts {s3} dollars toward {what}.", f"{p.He} has {s4} dollars left."], r


@_template(4)
def _bakery_half(c: _Ctx):
  (_, foods) = c.pick(_FOODS)
  b, k = c.n(2, 6), c.pick((6, 8, 10, 12))
  m = c.n(1, b * k - 2)
  if (b * k - m) % 2:
    raise _Retry()
  q = (f"A bakery makes {b} batches of {foods} with {k} in each batch. It sells {m} in the "
       f"morning and half of the remaining {foods} in the afternoon. How many {foods} are "
       f"left at the end of the day?")
  t, s1 = _calc(b, "*", k)
  rest, s2 = _calc(t, "-", m)
  half, s3 = _calc(rest, "/", 2)
  r, s4 = _calc(rest, "-", half)
  return q, [f"The bakery makes {s1} {foods}.", f"After the morning, {s2} are left.",
             f"In the afternoon it sells {s3}.", f"{s4} {foods} are left."], r


@_template(4)
def _trip_time(c: _Ctx):
  p = c.person()
  s1_, t1, s2_, t2 = c.n(4, 7) * 10, c.n(1, 3), c.n(3, 6) * 10, c.n(1, 4)
  dist = s1_ * t1 + s2_ * t2
  q = (f"{p.name} drives {dist} miles to visit family. {p.He} drives at {s1_} miles per hour "
       f"for the first {_hours(t1)}, then at {s2_} miles per hour for the "
       f"rest of the way. How many hours does the whole trip take?")
  a, x1 = _calc(s1_, "*", t1)
  b, x2 = _calc(dist, "-", a)
  t, x3 = _calc(b, "/", s2_)
  r, x4 = _calc(t1, "+", t)
  return q, [f"First {p.he} covers {x1} miles.", f"{x2} miles are left.",
             f"That part takes {x3} hours.", f"The whole trip takes {x4} hours."], r


@_template(4)
def _fair_profit(c: _Ctx):
  adults, kids = c.n(10, 40), c.n(10, 60)
  pa, pk = c.n(4, 10), c.n(1, 4)
  classes = c.n(2, 5)
  income = adults * pa + kids * pk
  profit = (income // 2 // classes) * classes
  if profit <= 0:
    raise _Retry()
  costs = income - profit
  q = (f"At a school fair, {adults} adult tickets are sold for ${pa} each and {kids} child "
       f"tickets for ${pk} each. The fair cost ${costs} to run. The profit is shared equally "
       f"among {classes} classes. How many dollars does each class get?")
  a, s1 = _calc(adults, "*", pa)
  b, s2 = _calc(kids, "*", pk)
  t, s3 = _calc(a, "+", b)
  u, s4 = _calc(t, "-", costs)
  r, s5 = _calc(u, "/", classes)
  return q, [f"Adult tickets bring {s1} dollars.", f"Child tickets bring {s2} dollars.",
             f"Ticket sales total {s3} dollars.", f"The profit is {s4} dollars.",
             f"Each class gets {s5} dollars."], r


@_template(4)
def _garden_survival(c: _Ctx):
  p = c.person()
  plant, crop = c.pick((("tomato", "tomatoes"), ("pepper", "peppers"),
                        ("strawberry", "strawberries"), ("bean", "beans")))
  rows, per = c.n(2, 6), c.pick((5, 10, 20))
  pct = c.pick((10, 20, 25, 50))
  each = c.n(2, 9)
  if (rows * per * pct) % 100:
    raise _Retry()
  q = (f"{p.name} plants {rows} rows of {plant} plants with {per} plants in each row. "
       f"{pct}% of the plants do not survive. Each surviving plant gives {each} {crop}. "
       f"How many {crop} does {p.name} harvest?")
  t, s1 = _calc(rows, "*", per)
  dead, s2 = _calc(t, "*", pct, "/", 100)
  alive, s3 = _calc(t, "-", dead)
  r, s4 = _calc(alive, "*", each)
  return q, [f"{p.name} plants {s1} plants.", f"{s2} plants do not survive.",
             f"{s3} plants survive.", f"The harvest is {s4} {crop}."], r


@_template(4)
def _percent_growth(c: _Ctx):
  shop, (_, things) = c.pick(("A shop", "A café", "A kiosk")), c.pick(_ITEMS)
  a, pct = c.n(2, 12) * 10, c.pick((10, 20, 30, 50))
  drop = c.n(1, 15)
  q = (f"{shop} sold {a} {things} in January. In February it sold {pct}% more than in "
       f"January. In March it sold {drop} fewer than in February. How many {things} did it "
       f"sell in the three months altogether?")
  inc, s1 = _calc(a, "*", pct, "/", 100)
  feb, s2 = _calc(a, "+", inc)
  mar, s3 = _calc(feb, "-", drop)
  r, s4 = _calc(a, "+", feb, "+", mar)
  return q, [f"February's increase is {s1}.", f"In February it sold {s2}.",
             f"In March it sold {s3}.", f"Altogether it sold {s4} {things}."], r


# --------------------------------------------------------------------------
# Public API.

@dataclasses.dataclass(frozen=True)
class SyntheticProblem:
  """One generated problem, in GSM8K's record format plus id/level/template."""
  id: str
  level: int
  template: str
  question: str
  answer: str  # worked solution ending in "#### N"
  final: int

  def to_record(self) -> dict:
    """The JSONL record the CLI writes (readable by `read_gsm8k_jsonl`)."""
    return {"id": self.id, "level": self.level, "template": self.template,
            "question": self.question, "answer": self.answer}

  def to_example(self) -> Example:
    solution = self.answer.rsplit("####", 1)[0].rstrip()
    return Example(id=self.id, dataset=DATASET, question=self.question,
                   reference=str(self.final),
                   metadata={"level": self.level, "template": self.template,
                             "solution": solution, "answer": self.answer})


def template_names(level: int) -> list[str]:
  """Names of the templates available at `level` (for reports and tests)."""
  return [name for name, _ in _TEMPLATES[level]]


def _check_level(level) -> int:
  if isinstance(level, bool) or not isinstance(level, numbers.Integral) or level not in _TEMPLATES:
    raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
  return int(level)


def generate_one(seed: int, index: int, level: int, redraw: int = 0) -> SyntheticProblem:
  """Problem `index` of the stream for `seed` at `level`; a pure function. redraw k > 0:
  the k-th other draw for that place (`generate` takes it where the first repeats an
  earlier problem's question)."""
  level = _check_level(level)
  rng = random.Random(f"{DATASET}:{seed}:{level}:{index}" + (f":{redraw}" if redraw else ""))
  for _ in range(1000):
    name, fn = rng.choice(_TEMPLATES[level])
    try:
      question, steps, final = fn(_Ctx(rng))
    except _Retry:
      continue
    answer = "\n".join(steps) + f"\n#### {final}"
    return SyntheticProblem(id=f"{DATASET}/s{seed}/{index}", level=level, template=name,
                            question=question, answer=answer, final=final)
  raise RuntimeError(f"could not generate problem {index} for seed {seed}")


def generate(n: int, seed: int = 0,
             levels: Sequence[int] = LEVELS) -> Iterator[SyntheticProblem]:
  """`n` problems; problem i has level ``levels[i % len(levels)]``.

  Problem i depends only on (seed, i, levels) and the problems before it, so asking for
  more problems extends the list without changing its first part. A question already
  asked is drawn again (`generate_one`'s redraw): a repeat counted twice in an accuracy
  and its interval (level 1 repeated 10-19 of 1,000).
  """
  levels = tuple(_check_level(level) for level in levels)
  if not levels:
    raise ValueError("levels must not be empty")
  asked: set[str] = set()
  for i in range(n):
    for redraw in range(1000):
      problem = generate_one(seed, i, levels[i % len(levels)], redraw)
      if problem.question not in asked:
        break
    else:
      raise RuntimeError(f"problem {i} of seed {seed} repeats an earlier one in 1000 draws")
    asked.add(problem.question)
    yield problem


def synthetic_examples(n: int, seed: int = 0,
                       levels: Sequence[int] = LEVELS) -> Iterator[Example]:
  """The generated problems as `Example`s (the default offline GSM dataset)."""
  for prob in generate(n, seed, levels):
    yield prob.to_example()


def write_jsonl(path: str, problems: Iterator[SyntheticProblem]) -> int:
  """Write problems as GSM8K-format JSONL; returns how many were written. The file
  appears whole (a temporary file renamed): a failure leaves an existing file as it was."""
  tmp = f"{path}.{os.getpid()}.tmp"
  count = 0
  try:
    with open(tmp, "w", encoding="utf-8") as f:
      for prob in problems:
        f.write(json.dumps(prob.to_record(), ensure_ascii=False) + "\n")
        count += 1
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)
  return count


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--n", type=int, default=200, help="number of problems")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--levels", default="1,2,3,4",
                      help="comma-separated levels, cycled over problem indices")
  parser.add_argument("--out", required=True, help="output JSONL path ('-' for stdout)")
  args = parser.parse_args(argv)
  try:  # (before the file is opened: a bad level had replaced it with a partial one)
    levels = tuple(_check_level(int(x)) for x in args.levels.split(",") if x.strip())
  except ValueError:
    parser.error(f"--levels {args.levels!r}: expected comma-separated levels from {LEVELS}")
  if not levels:
    parser.error(f"--levels {args.levels!r}: expected comma-separated levels from {LEVELS}")
  if args.n < 1:
    parser.error(f"--n {args.n}: expected a count >= 1")
  if args.out != "-" and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
    parser.error(f"--out {args.out}: its directory does not exist")
  problems = generate(args.n, args.seed, levels)
  if args.out == "-":
    for prob in problems:
      sys.stdout.write(json.dumps(prob.to_record(), ensure_ascii=False) + "\n")
    return 0
  count = write_jsonl(args.out, problems)
  print(f"wrote {count} problems to {args.out}", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
