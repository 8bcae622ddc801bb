"""Suite category `summarization`: long generated reports with planted key facts.

Each document is a fictional town's annual report: 5 key facts (the mayor, the population,
the year a bridge opened, the main export, the budget) stated once each in the body, amid
generated paragraphs about districts, weather, events and services that repeat none of
them. Length: at least MIN_WORDS words; the embedded model's tokenizer (SmolLM2's BPE)
gives 1.2-1.4 tokens per word on this text, so every document is >= 1,500 tokens (the
tests count them with that tokenizer). The reference summary is one sentence per fact.

Scoring: ROUGE-L F1 against the reference (Google's `rouge-score` package,
`RougeScorer(["rougeL"], use_stemmer=True)`: its own tokenizer and the Porter stemmer,
no downloaded data) and key-fact recall: the share of facts whose key value appears in
the summary: a number by its value, written with or without thousands separators (commas
or spaces) and a multiplier word or not (5.0 million = 5 million = 5,000,000 = 5,000
thousand; 58,117 billion is not 58,117; not inside a longer number), a name
case-insensitively, spaces and hyphens alike. Headline: key-fact recall.
"""

from __future__ import annotations

import decimal
import functools
import random
import re

from pipelines.datasets.records import Example

CATEGORY = "summarization"
MIN_WORDS = 1300

_TOWN_A = ("Bel", "Cor", "Dun", "Ester", "Fal", "Gran", "Hollow", "Ivy", "Kel", "Lark", "Mor", "Pell")
_TOWN_B = ("brook", "mere", "ford", "wick", "haven", "stead", "moor", "cliff", "dale", "field")
_FIRST = ("Agnes", "Bastian", "Clara", "Dorian", "Elsbeth", "Florian", "Greta", "Hector", "Imke",
          "Jules", "Katrin", "Leopold", "Mirela", "Nikolai", "Odile", "Pavel")
_LAST = ("Aldana", "Brisbois", "Castellan", "Drummond", "Esterhazy", "Fontaine", "Galloway",
         "Hasselt", "Ingersoll", "Jablonski", "Kowalczyk", "Lindgren", "Montague", "Navarro")
_EXPORTS = ("copper wire", "wool blankets", "apple cider", "glass lenses", "oak furniture",
            "dried herbs", "ceramic tiles", "river salt", "linen thread", "smoked trout")
_DISTRICTS = ("the harbour quarter", "the old market", "the northern terraces", "the mill district",
              "the station area", "the riverside", "the hill streets", "the eastern fields")
_SERVICES = ("the bus service", "street lighting", "the public baths", "waste collection",
             "the lending library", "the night clinic", "the ferry timetable", "the water works")
_EVENTS = ("the spring fair", "the lantern parade", "the rowing regatta", "the harvest supper",
           "the chess tournament", "the choir festival", "the open studios weekend", "the kite day")
_ADJ = ("busy", "quiet", "steady", "mixed", "lively", "calm", "uneven", "encouraging", "modest")
_WEATHER = ("a wet spring", "a dry summer", "a windy autumn", "a mild winter", "a cold snap in March",
            "heavy fog in November", "an early frost", "a long warm spell")


def _sentences(rng: random.Random, town: str) -> list[str]:
  """One filler sentence per template, drawn fresh (a paragraph takes a few, no repeats)."""
  d, s, e = rng.choice(_DISTRICTS), rng.choice(_SERVICES), rng.choice(_EVENTS)
  a, w = rng.choice(_ADJ), rng.choice(_WEATHER)
  pct = rng.randint(2, 40)
  return [
      f"Residents of {d} described the year as {a}, and many asked for better {s}.",
      f"The council reviewed {s} twice and agreed on small changes after hearing from {d}.",
      f"{e.capitalize()} drew visitors from neighbouring villages, and local shops in {d} stayed open late.",
      f"After {w}, volunteers repaired paths and benches across {d}.",
      f"A survey found that about {pct} percent of households in {d} use {s} every week.",
      f"Plans for {e} were discussed at length, with several groups offering to help.",
      f"Staff who run {s} reported a {a} season and thanked residents for their patience.",
      f"In {d}, new planters and a painted mural changed the look of several streets.",
      f"Older residents recalled how {town} handled {w} in earlier decades.",
      f"The town's schools joined {e} for the first time, which teachers called a {a} success.",
      f"Traffic through {d} was {a} for most of the year, apart from the weeks of {e}.",
      f"Several letters to the council praised {s} while others asked for longer opening hours.",
  ]


def _paragraph(rng: random.Random, town: str) -> str:
  return " ".join(rng.sample(_sentences(rng, town), rng.randint(4, 7)))


def generate_item(seed: int, index: int) -> Example:
  rng = random.Random(f"suite/summarization:{seed}:{index}")
  town = rng.choice(_TOWN_A) + rng.choice(_TOWN_B)
  year = rng.randint(2031, 2049)
  mayor = f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"
  population = rng.randint(12_000, 95_000)
  bridge_year = year - rng.randint(1, 3)
  export = rng.choice(_EXPORTS)
  budget = rng.randint(11, 99) / 10
  facts = [
      {"name": "mayor", "value": mayor,
       "sentence": f"The mayor of {town} is {mayor}.",
       "body": f"{mayor}, who serves as mayor of {town}, opened the council's first meeting of the year."},
      {"name": "population", "value": f"{population:,}",
       "sentence": f"{town} has {population:,} residents.",
       "body": f"The census completed this year counted {population:,} residents in {town}."},
      {"name": "bridge", "value": str(bridge_year),
       "sentence": f"The new river bridge opened in {bridge_year}.",
       "body": f"The new river bridge, which opened in {bridge_year}, now carries most of the town's traffic."},
      {"name": "export", "value": export,
       "sentence": f"The town's main export is {export}.",
       "body": f"Trade figures confirm that {export} remain the main export of {town}."},
      {"name": "budget", "value": f"{budget:.1f} million",
       "sentence": f"The annual budget was {budget:.1f} million crowns.",
       "body": f"The council approved an annual budget of {budget:.1f} million crowns."},
  ]
  paragraphs = []
  while sum(len(p.split()) for p in paragraphs) < MIN_WORDS:
    paragraphs.append(_paragraph(rng, town))
  # One fact per paragraph slot, at spread-out positions (not all at the start).
  slots = sorted(rng.sample(range(len(paragraphs)), len(facts)))
  for slot, fact in zip(slots, facts):
    paragraphs[slot] = fact["body"] + " " + paragraphs[slot]
  document = f"Annual report of {town}, {year}\n\n" + "\n\n".join(paragraphs)
  reference = " ".join(f["sentence"] for f in facts)
  question = (f"{document}\n\nSummarize the report above in 3 to 5 sentences. Include the "
              f"key names, numbers and dates.")
  return Example(id=f"suite/summarization/{index}", dataset="suite", question=question,
                 reference=reference,
                 metadata={"category": CATEGORY, "town": town, "words": len(document.split()),
                           "key_facts": [{"name": f["name"], "value": f["value"]} for f in facts]})


def generate(n: int, seed: int) -> list[Example]:
  return [generate_item(seed, i) for i in range(n)]


def prompt(example: Example):
  return [{"role": "user", "content": example.question}], ()


@functools.lru_cache(maxsize=1)
def _scorer():
  from rouge_score import rouge_scorer
  return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)


def rouge_l(prediction: str, reference: str) -> float:
  return _scorer().score(reference, prediction)["rougeL"].fmeasure


# A number as a whole (not inside a longer one: 4.2 million is not 14.2 million, nor 48,213
# 148,213 or 48,213.5), its thousands grouped by commas or spaces, and one multiplier word
# after it, joined by spaces on its line or by one dash ("4.2-million", "4.2 millions",
# "2,900 thousand", "35bn"; not a bare "m": metres; "58,117 billion" is not 58,117; the
# plurals "hundreds"/"thousands"/"billions" start a new phrase: "in 2035 thousands came" is
# the year 2035, as is "2035\n- Hundred benches").
_MULTIPLIERS = {"hundred": 10**2, "thousand": 10**3, "million": 10**6, "millions": 10**6,
                "mln": 10**6, "billion": 10**9, "bn": 10**9, "trillion": 10**12}
_NUMBER = re.compile(r"(?<![\d.,])(\d{1,3}(?:[,\s\u00a0\u202f]\d{3})+(?![\d])|\d+)(\.\d+)?"
                     r"(?!\d)(?![.,]\d)(?:(?:[ \t\u00a0\u202f]+|[\-\u2010\u2011\u2013\u2014])?"
                     r"(hundred|thousand|millions?|mln|billion|bn|trillion)\b)?", re.IGNORECASE)
# A minus sign: one "-" or "\u2212" right before the number, at the start or after a space,
# "(", "[" or "=" (in "1990-2000" the "-" is a range's, in "population--53,325" a dash).
_MINUS = re.compile(r"(?:^|[\s(\[=])[-\u2212]$")
_SEPARATORS = re.compile(r"[\s\u00a0\u202f\-\u2010\u2011\u2013]+")


def _values(text: str) -> set[decimal.Decimal]:
  """The values of the numbers written in `text` ("5 million", "5.0 million",
  "5,000 thousand" and "5,000,000" are one value; "4.2 million million" is 4.2 million)."""
  out = set()
  for m in _NUMBER.finditer(text):
    whole, fraction, word = m.groups()
    value = decimal.Decimal(re.sub(r"\D", "", whole) + (fraction or ""))
    value *= _MULTIPLIERS[word.lower()] if word else 1
    # (-53325 is not a population of 53,325)
    out.add(-value if _MINUS.search(text[max(0, m.start() - 2):m.start()]) else value)
  return out


def _fact_found(value: str, text: str) -> bool:
  """A number by its value; a name or phrase case-insensitively, as a whole (a plural such
  as "copper wires" still counts; inside a longer word it does not: "xHector Navarroson"),
  spaces and hyphens alike."""
  if _NUMBER.fullmatch(value.strip()):
    return bool(_values(value) & _values(text))
  words = _SEPARATORS.sub(" ", value.lower()).strip()
  return re.search(rf"(?<!\w){re.escape(words)}(?:e?s)?(?!\w)",
                   _SEPARATORS.sub(" ", text.lower())) is not None


def facts_found(prediction: str, facts: list[dict]) -> list[str]:
  """The names of the facts whose value the prediction holds."""
  return [f["name"] for f in facts if _fact_found(f["value"], prediction)]


def key_fact_recall(prediction: str, facts: list[dict], found: list[str] | None = None) -> float:
  """The share of `facts` the prediction holds (`found`: `facts_found`'s answer, if known)."""
  found = facts_found(prediction, facts) if found is None else found
  return len(found) / len(facts) if facts else 0.0


def score(example: Example, text: str, stop: tuple[str, ...] = ()) -> dict:
  facts = example.metadata["key_facts"]
  found = facts_found(text, facts)
  recall = key_fact_recall(text, facts, found)
  rouge = rouge_l(text, example.reference)
  return {"answer": None, "correct": recall == 1.0, "facts_found": found,
          "rouge_l": round(rouge, 4), "key_fact_recall": round(recall, 4),
          "metrics": {"key_fact_recall": round(recall, 4), "rouge_l": round(rouge, 4)}}
