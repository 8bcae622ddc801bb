"""Suite category `code`: HumanEval's 164 problems plus 36 generated function-writing tasks.

Every item is a HumanEval-format problem: `question` is the code prompt (signature and
docstring), `metadata` holds `test` (defines `check(candidate)`), `entry_point` and the
canonical solution. Prompted and scored as the HumanEval task does
(`pipelines/tasks/humaneval.py`), in the style `prompt.code_style` names: chat (the
default, for instruction-tuned models) or completion (HumanEval's original protocol).
Scoring is HumanEval's: prompt + code + test + `check(entry_point)` run in the sandbox
(`pipelines/sandbox`); a sample passes when the sandbox's sentinel proves every assert
ran. The summary reports pass@1 (greedy) and pass@k for every k <= n (policy=sample_n).

The generated tasks come from 12 templates, 3 instances each, with parameters drawn from a
seeded RNG (`random.Random(f"suite/code:{seed}:{index}")`, drawn again where a function
repeats an earlier one). The docstring shows two
examples; the hidden test checks 6 other inputs, not all with one output (a constant
answer never passes). Expected outputs are computed by running
the template's own reference solution (project text, not model output) in this process.
"""

from __future__ import annotations

import random
from typing import Callable, Sequence

from pipelines.datasets.humaneval import humaneval_examples
from pipelines.datasets.records import Example
from pipelines.tasks import humaneval

CATEGORY = "code"
HIDDEN_TESTS = 6


def _ints(rng: random.Random, n: int, lo: int = -20, hi: int = 40) -> list[int]:
  return [rng.randint(lo, hi) for _ in range(n)]


def _words(rng: random.Random, n: int) -> str:
  vocab = ("river", "stone", "a", "quiet", "lantern", "of", "oak", "delta", "ember", "fig",
           "harbor", "ink", "jade", "kite", "moss", "north", "pearl", "reed", "sun", "tide")
  return " ".join(rng.choice(vocab) for _ in range(n))


# Each template: (make(rng) -> params, name pattern, signature, docstring, body, inputs(rng, params)).
# The body is Python source indented by 4 spaces; `inputs` returns argument tuples.
def _t_sum_multiples(rng):
  k = rng.randint(2, 7)
  return dict(name=f"sum_of_multiples_of_{k}", sig="(nums: list) -> int",
              doc=f"Return the sum of the numbers in nums that are divisible by {k}.",
              body=f"    return sum(x for x in nums if x % {k} == 0)\n",
              inputs=lambda r: (_ints(r, r.randint(0, 8)),))


def _t_rotate(rng):
  k = rng.randint(1, 4)
  return dict(name=f"rotate_left_by_{k}", sig="(items: list) -> list",
              doc=f"Return items rotated left by {k} positions (wrapping around); an empty list "
                  f"stays empty.",
              body=f"    if not items:\n        return []\n    s = {k} % len(items)\n"
                   f"    return items[s:] + items[:s]\n",
              inputs=lambda r: (_ints(r, r.randint(0, 7)),))


def _t_clamp(rng):
  lo = rng.randint(-5, 5)
  hi = lo + rng.randint(3, 15)
  return dict(name=f"clamp_between_{lo}_and_{hi}".replace("-", "minus_"), sig="(nums: list) -> list",
              doc=f"Return a new list where every number below {lo} becomes {lo} and every number "
                  f"above {hi} becomes {hi}.",
              body=f"    return [min(max(x, {lo}), {hi}) for x in nums]\n",
              inputs=lambda r: (_ints(r, r.randint(0, 8)),))


def _t_arithmetic(rng):
  a, d = rng.randint(-5, 10), rng.randint(2, 9)
  return dict(name=f"sequence_term_start_{a}_step_{d}".replace("-", "minus_"), sig="(n: int) -> int",
              doc=f"Return the n-th term (n >= 1) of the sequence that starts at {a} and grows by "
                  f"{d} at each step.",
              body=f"    return {a} + (n - 1) * {d}\n",
              inputs=lambda r: (r.randint(1, 60),))


def _t_replace_char(rng):
  old, new = rng.sample("aeiorst", 2)
  return dict(name=f"replace_{old}_with_{new}", sig="(text: str) -> str",
              doc=f"Return text with every lowercase '{old}' replaced by '{new}'.",
              body=f"    return text.replace({old!r}, {new!r})\n",
              inputs=lambda r: (_words(r, r.randint(0, 6)),))


def _t_long_words(rng):
  n = rng.randint(3, 5)
  return dict(name=f"words_longer_than_{n}", sig="(text: str) -> list",
              doc=f"Return the words of text (split on whitespace) that have more than {n} "
                  f"letters, in their original order.",
              body=f"    return [w for w in text.split() if len(w) > {n}]\n",
              inputs=lambda r: (_words(r, r.randint(0, 8)),))


def _t_prefix_sums(rng):
  start = rng.randint(0, 10)
  return dict(name=f"running_totals_from_{start}", sig="(nums: list) -> list",
              doc=f"Return the running totals of nums, starting from {start}: element i of the "
                  f"result is {start} plus the sum of nums[0..i].",
              body=f"    out, total = [], {start}\n    for x in nums:\n        total += x\n"
                   f"        out.append(total)\n    return out\n",
              inputs=lambda r: (_ints(r, r.randint(0, 7)),))


def _t_fizz(rng):
  a, b = rng.sample((2, 3, 4, 5, 7), 2)
  return dict(name=f"fizz_{a}_buzz_{b}", sig="(n: int) -> list",
              doc=f"Return a list of strings for 1..n: 'Fizz' for multiples of {a}, 'Buzz' for "
                  f"multiples of {b}, 'FizzBuzz' for multiples of both, else the number as text.",
              body=f"    out = []\n    for i in range(1, n + 1):\n        s = ('Fizz' if i % {a} == 0 "
                   f"else '') + ('Buzz' if i % {b} == 0 else '')\n        out.append(s or str(i))\n"
                   f"    return out\n",
              inputs=lambda r: (r.randint(0, 25),))


def _t_caesar(rng):
  k = rng.randint(1, 25)
  return dict(name=f"shift_letters_by_{k}", sig="(text: str) -> str",
              doc=f"Shift every lowercase letter of text {k} places forward in the alphabet, "
                  f"wrapping from 'z' to 'a'; other characters stay as they are.",
              body=f"    return ''.join(chr((ord(c) - 97 + {k}) % 26 + 97) if 'a' <= c <= 'z' else c "
                   f"for c in text)\n",
              inputs=lambda r: (_words(r, r.randint(0, 5)),))


def _t_count_digits(rng):
  d = rng.randint(2, 7)
  return dict(name=f"count_digits_above_{d}", sig="(n: int) -> int",
              doc=f"Return how many decimal digits of the non-negative integer n are greater "
                  f"than {d}.",
              body=f"    return sum(int(c) > {d} for c in str(n))\n",
              inputs=lambda r: (r.randint(0, 10 ** r.randint(1, 9)),))


def _t_differences(rng):
  step = rng.randint(1, 3)
  return dict(name=f"gaps_every_{step}", sig="(nums: list) -> list",
              doc=f"Return the list of nums[i + {step}] - nums[i] for every i where both exist.",
              body=f"    return [nums[i + {step}] - nums[i] for i in range(len(nums) - {step})]\n",
              inputs=lambda r: (_ints(r, r.randint(0, 8)),))


def _t_chunks(rng):
  size = rng.randint(2, 4)
  return dict(name=f"chunk_sums_of_{size}", sig="(nums: list) -> list",
              doc=f"Split nums into consecutive chunks of {size} (the last may be shorter) and "
                  f"return the sum of each chunk.",
              body=f"    return [sum(nums[i:i + {size}]) for i in range(0, len(nums), {size})]\n",
              inputs=lambda r: (_ints(r, r.randint(0, 9)),))


TEMPLATES: tuple[Callable, ...] = (
    _t_sum_multiples, _t_rotate, _t_clamp, _t_arithmetic, _t_replace_char, _t_long_words,
    _t_prefix_sums, _t_fizz, _t_caesar, _t_count_digits, _t_differences, _t_chunks)


def _reference_function(source: str, name: str):
  namespace: dict = {}
  exec(compile(source, f"<suite reference {name}>", "exec"), namespace)  # project text, not model output
  return namespace[name]


def generated_task(seed: int, index: int, redraw: int = 0) -> Example:
  """Generated task `index` (0-based): template index % 12, its own RNG; a pure function.
  redraw k > 0: the k-th other draw (`generate` takes it where the first repeats an
  earlier task's function)."""
  rng = random.Random(f"suite/code:{seed}:{index}" + (f":{redraw}" if redraw else ""))
  spec = TEMPLATES[index % len(TEMPLATES)](rng)
  name = spec["name"]
  fn = _reference_function(f"def {name}{spec['sig']}:\n{spec['body']}", name)
  # Distinct inputs: two for the docstring, HIDDEN_TESTS for the test.
  seen, cases = set(), []
  for _ in range(200):
    args = spec["inputs"](rng)
    if repr(args) not in seen:
      seen.add(repr(args))
      cases.append((args, fn(*args)))
    if len(cases) == 2 + HIDDEN_TESTS:
      break
  shown, hidden = cases[:2], cases[2:]
  # Hidden cases that all expect one output pass a constant (`return []`): the last is
  # swapped for an input with another output (an item whose outputs differ is unchanged).
  outputs = {repr(r) for _, r in hidden}
  for _ in range(200 if len(outputs) == 1 else 0):
    args = spec["inputs"](rng)
    if repr(args) not in seen:
      seen.add(repr(args))
      result = fn(*args)
      if repr(result) not in outputs:
        hidden[-1] = (args, result)
        break
  examples = "".join(f"    >>> {name}({', '.join(map(repr, a))})\n    {r!r}\n" for a, r in shown)
  prompt = f"def {name}{spec['sig']}:\n    \"\"\"{spec['doc']}\n{examples}    \"\"\"\n"
  test = "def check(candidate):\n" + "".join(
      f"    assert candidate({', '.join(map(repr, a))}) == {r!r}\n" for a, r in hidden)
  return Example(id=f"suite/code/generated/{index}", dataset="suite", question=prompt,
                 reference=spec["body"],
                 metadata={"category": CATEGORY, "source": "generated", "template": spec["name"],
                           "entry_point": name, "test": test, "canonical_solution": spec["body"]})


def generate(n: int, seed: int) -> list[Example]:
  """HumanEval's problems first (all 164 when n >= 164), then generated tasks up to n."""
  out = []
  for ex in humaneval_examples()[:n]:
    out.append(Example(id=f"suite/code/{ex.id}", dataset="suite", question=ex.question,
                       reference=ex.reference,
                       metadata={**ex.metadata, "category": CATEGORY, "source": "humaneval"}))
  named: set[str] = set()
  for i in range(max(n - len(out), 0)):
    # A function asked for again (same name, same docstring) counted twice; drawn again
    # while its template has parameters left (a template has 3 or more).
    task = next((t for t in (generated_task(seed, i, k) for k in range(100))
                 if t.metadata["entry_point"] not in named), None) or generated_task(seed, i)
    named.add(task.metadata["entry_point"])
    out.append(task)
  return out


STYLE_KEY = "prompt.code_style"


def check_style(style: str) -> str:
  return humaneval.check_style(style, STYLE_KEY)


def prompt(example: Example, style: str = "chat"):
  """(prompt, stop sequences) in `style`: HumanEval's `code_prompt`."""
  return humaneval.code_prompt(example, check_style(style))


def score_many(items: Sequence[tuple[Example, str, tuple[str, ...]]], sandbox,
               style: str = "chat") -> list[dict]:
  """HumanEval's scoring (`run_programs`) plus the suite's per-item metric."""
  return [{**score, "metrics": {"pass": float(score["correct"])}}
          for score in humaneval.run_programs(items, sandbox, style, STYLE_KEY)]
