"""Suite category `qa`: multi-hop questions over a small generated world given in the context.

Each item has its own world: 8 people, 4 organisations, 4 cities, 3 countries, all with
invented names (the model cannot answer from memory). Every relation is a function, so each
question has exactly one answer:

  person --works_for--> organisation    person --mentor--> person
  person --born_in--> city              organisation --headquartered_in--> city
  organisation --founder--> person      city --in_country--> country

The context lists every fact as one sentence, shuffled. A question follows a random path of
2-4 relations from a person (the item's `hops`, cycled 2, 3, 4) and names the end entity:
"Name the country that the city where the organisation that Ilsa Varn works for is
headquartered is in." is 3 hops.

Scoring follows SQuAD v1.1's evaluation script: normalise (lowercase, drop punctuation,
drop the articles a/an/the, collapse whitespace), then exact match and token F1 against the
single gold answer. The prediction is the response's first non-empty line with a leading
"Answer:" removed (the prompt asks for the name alone). A response that restates the
question first ("The founder of Ulga Guild is Ilsa Varn.") answers with what follows the
restated phrase and its "is"/"was", up to the sentence's end ("Ilsa Varn"): small models
answer that way, and the name is their answer. The headline is exact match.
"""

from __future__ import annotations

import collections
import random
import re
import string
from typing import Optional

from pipelines.datasets.records import Example

CATEGORY = "qa"
HOPS = (2, 3, 4)

_FIRST = ("Ilsa", "Toren", "Maelis", "Corvin", "Anouk", "Bertil", "Ysolde", "Dagny", "Evander",
          "Fenna", "Gideon", "Halvard", "Idris", "Jorun", "Kaspar", "Liesel", "Matthis", "Neve",
          "Osric", "Petra", "Quill", "Runa", "Soren", "Tamsin", "Ulric", "Vesna", "Wendel", "Xanthe")
_LAST = ("Varn", "Quist", "Holloway", "Brannock", "Ekwall", "Faircloth", "Grimsby", "Hartigan",
         "Ivers", "Jessop", "Kettering", "Lindqvist", "Marwood", "Northcott", "Oakes", "Penrose",
         "Ravensworth", "Stroud", "Thornbury", "Underhill", "Vance", "Whitlock", "Yardley")
_SYLLABLES = ("bar", "cel", "dor", "ven", "mir", "tal", "os", "rin", "kes", "lun", "var", "zen",
              "pol", "quor", "sab", "tir", "ul", "wen", "yth", "ga")
_ORG_KINDS = ("Labs", "Group", "Foundry", "Institute", "Collective", "Works", "Trust", "Guild")

# relation name -> (from kind, to kind, fact sentence, noun phrase describing the target of X)
RELATIONS = {
    "works_for": ("person", "org", "{a} works for {b}.", "the organisation that {x} works for"),
    "mentor": ("person", "person", "The mentor of {a} is {b}.", "the mentor of {x}"),
    "born_in": ("person", "city", "{a} was born in {b}.", "the city where {x} was born"),
    "headquartered_in": ("org", "city", "{a} is headquartered in {b}.",
                         "the city where {x} is headquartered"),
    "founder": ("org", "person", "{a} was founded by {b}.", "the founder of {x}"),
    "in_country": ("city", "country", "{a} is a city in {b}.", "the country that {x} is in"),
}


def _place(rng: random.Random, syllables: int) -> str:
  return "".join(rng.choice(_SYLLABLES) for _ in range(syllables)).capitalize()


def _unique(rng: random.Random, make, count: int, taken: set) -> list[str]:
  out = []
  while len(out) < count:
    name = make()
    if name not in taken:
      taken.add(name)
      out.append(name)
  return out


def build_world(rng: random.Random) -> dict:
  """Entities by kind and every relation as a dict entity -> entity."""
  taken: set = set()
  people = _unique(rng, lambda: f"{rng.choice(_FIRST)} {rng.choice(_LAST)}", 8, taken)
  orgs = _unique(rng, lambda: f"{_place(rng, 2)} {rng.choice(_ORG_KINDS)}", 4, taken)
  cities = _unique(rng, lambda: _place(rng, rng.choice((2, 3))), 4, taken)
  countries = _unique(rng, lambda: _place(rng, 2) + rng.choice(("ia", "land", "mark")), 3, taken)
  rel = {
      "works_for": {p: rng.choice(orgs) for p in people},
      "mentor": {p: rng.choice([q for q in people if q != p]) for p in people},
      "born_in": {p: rng.choice(cities) for p in people},
      "headquartered_in": {o: rng.choice(cities) for o in orgs},
      "founder": {o: rng.choice(people) for o in orgs},
      "in_country": {c: rng.choice(countries) for c in cities},
  }
  return {"entities": {"person": people, "org": orgs, "city": cities, "country": countries},
          "relations": rel}


def _path(rng: random.Random, hops: int) -> list[str]:
  """A random relation path of `hops` steps from a person, each step typed to the last."""
  while True:
    kind, path = "person", []
    for _ in range(hops):
      options = [r for r, (src, _, _, _) in RELATIONS.items() if src == kind]
      if not options:
        break
      r = rng.choice(options)
      path.append(r)
      kind = RELATIONS[r][1]
    # Two mentor steps in a row read poorly and add no reasoning over one; avoid them.
    if len(path) == hops and "mentor,mentor" not in ",".join(path):
      return path


def generate_item(seed: int, index: int) -> Example:
  rng = random.Random(f"suite/qa:{seed}:{index}")
  hops = HOPS[index % len(HOPS)]
  world = build_world(rng)
  path = _path(rng, hops)
  people = list(world["entities"]["person"])
  while True:  # a path back to the person the question names answers itself: redrawn
    start = rng.choice(people)
    entity, phrase = start, start
    for r in path:
      entity = world["relations"][r][entity]
      phrase = RELATIONS[r][3].format(x=phrase)
    if entity != start or len(people) == 1:
      break
    people.remove(start)
  facts = [RELATIONS[r][2].format(a=a, b=b) for r, m in world["relations"].items() for a, b in m.items()]
  rng.shuffle(facts)
  question = f"Name {phrase}."
  context = " ".join(facts)
  text = (f"Read the facts and answer the question.\n\nFacts: {context}\n\nQuestion: {question}\n"
          f"Answer with the name only.")
  return Example(id=f"suite/qa/{index}", dataset="suite", question=text, reference=entity,
                 metadata={"category": CATEGORY, "hops": hops, "path": path, "start": start,
                           "level": hops})


def generate(n: int, seed: int) -> list[Example]:
  return [generate_item(seed, i) for i in range(n)]


def prompt(example: Example):
  return [{"role": "user", "content": example.question}], ()


# -- SQuAD v1.1 scoring ----------------------------------------------------------------

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize(text: str) -> str:
  """SQuAD's normalize_answer: lowercase, no punctuation, no articles, single spaces."""
  text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
  return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, gold: str) -> bool:
  return normalize(prediction) == normalize(gold)


def token_f1(prediction: str, gold: str) -> float:
  pred, ref = normalize(prediction).split(), normalize(gold).split()
  common = collections.Counter(pred) & collections.Counter(ref)
  same = sum(common.values())
  if same == 0:
    return 0.0
  precision, recall = same / len(pred), same / len(ref)
  return 2 * precision * recall / (precision + recall)


_QUESTION = re.compile(r"\nQuestion: Name (.+?)\.\n")


def question_phrase(example: Example) -> Optional[str]:
  """The noun phrase the question asks to name ("the founder of ...")."""
  match = _QUESTION.search(example.question)
  return match.group(1) if match else None


# A line that only announces the answer ("Answer:", "**Answer:**", "The answer is:"): the
# answer is on the next line. (Written so no two repeats can share a run of punctuation: the
# form "\W*(...)?[\W_]*" took quadratic time, 3 minutes on a 100,000-character line.)
_HEADER = re.compile(r"(?:\W*(?:the\s+)?(?:final\s+)?answer(?:\s+is)?)?[\W_]*", re.IGNORECASE)


_LABEL = re.compile(r"^[*_\s]*(?:the\s+)?(?:final\s+)?answer[*_\s]*(?::|\s[-\u2013\u2014](?=\s))"
                    r"[*_\s]*", re.IGNORECASE)


def extract_answer(text: str, phrase: Optional[str] = None) -> Optional[str]:
  """First non-empty line, without a leading label ('Answer:', 'Final Answer:', 'The
  answer:', 'Answer -', in bold too); None for an empty response. A
  line that only announces the answer ("**Answer:**", "The answer is:") or has no word
  passes the turn to the next one. When the line says "The (final) answer is X" or
  restates `phrase` followed by "is"/"was", what follows up to the sentence's end."""
  for line in text.splitlines():
    line = line.strip()
    if line and not _HEADER.fullmatch(line):
      # A leading label: "Answer:", "Final Answer:", "**Final Answer:**", "The answer:",
      # "Answer - " (only "Answer:" was taken off: "Final Answer: X" scored EM 0).
      line = _LABEL.sub("", line).strip()
      stated = re.match(r"^\W*(?:the\s+)?(?:final\s+)?answer\s+is\s*:?\s*(.+?)(?:\.(?:\s|$)|$)",
                        line, flags=re.IGNORECASE)
      if stated:  # "The answer is Sabga Group." (was compared whole: EM 0)
        return stated.group(1).strip()
      if phrase:
        words = r"\W+".join(re.escape(w) for w in phrase.split())
        restated = re.match(rf"^\W*(?:the\s+)?{words}\s+(?:is|was)\s+(.+?)(?:\.(?:\s|$)|$)",
                            line, flags=re.IGNORECASE)
        if restated:
          return restated.group(1).strip()
      return line
  return None


def score(example: Example, text: str, stop: tuple[str, ...] = ()) -> dict:
  answer = extract_answer(text, question_phrase(example)) or ""
  em, f1 = exact_match(answer, example.reference), token_f1(answer, example.reference)
  return {"answer": answer, "correct": em, "exact_match": em, "f1": round(f1, 4),
          "metrics": {"exact_match": float(em), "f1": round(f1, 4)}}
