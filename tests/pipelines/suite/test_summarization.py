"""Summarization: documents >= 1,500 tokens (embedded tokenizer), ROUGE-L and key-fact recall."""

import pytest

from pipelines.suite import summarization as summ


def test_key_fact_recall_and_rouge_l_on_hand_made_summaries():
  ex = summ.generate_item(0, 0)
  facts = {f["name"]: f["value"] for f in ex.metadata["key_facts"]}
  assert len(facts) == 5 and all(v in ex.question for v in facts.values())
  perfect = summ.score(ex, ex.reference)
  assert perfect["correct"] and perfect["metrics"] == {"key_fact_recall": 1.0, "rouge_l": 1.0}
  # Two of five facts, the population written without its thousands separator.
  partial = f"The mayor is {facts['mayor']}. About {facts['population'].replace(',', '')} people live there."
  s = summ.score(ex, partial)
  assert s["facts_found"] == ["mayor", "population"] and s["key_fact_recall"] == 0.4
  assert 0.0 < s["rouge_l"] < 1.0
  assert summ.score(ex, "Nothing relevant.")["metrics"]["key_fact_recall"] == 0.0


def test_rouge_l_is_the_rouge_score_package_lcs_f_measure():
  # LCS("the cat sat on the mat", "the cat lay on a mat") = the cat on mat = 4 tokens;
  # P = 4/6, R = 4/6, F = 0.6667.
  assert summ.rouge_l("the cat lay on a mat", "the cat sat on the mat") == pytest.approx(4 / 6)


@pytest.mark.slow
def test_every_document_is_at_least_1500_tokens_of_the_embedded_tokenizer():
  from o1jax.checkpoint import load_checkpoint
  items = summ.generate(200, seed=0)
  assert all(ex.metadata["words"] >= summ.MIN_WORDS for ex in items)
  # Tokenizing all 200 takes ~10 s on a busy machine: the 10 with the fewest words suffice.
  tokenizer = load_checkpoint("embedded").tokenizer
  for ex in sorted(items, key=lambda ex: ex.metadata["words"])[:10]:
    document = ex.question.rsplit("\n\nSummarize", 1)[0]
    assert len(tokenizer.encode(document)) >= 1500, ex.id


def test_rouge_l_equals_the_package_on_empty_unicode_and_punctuation():
  from rouge_score import rouge_scorer
  scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
  pairs = [("", ""), ("", "The mayor is Clara Aldana."), ("The mayor is Clara Aldana.", ""),
           ("Zoë’s café — opened in 2034!", "Zoe's cafe opened in 2034."), ("!!! ... ???", "!!!"),
           ("Bridges opened; mayors served.", "The bridge opened and the mayor served."),
           ("48,213 residents", "48213 residents")]
  for prediction, reference in pairs:
    want = scorer.score(reference, prediction)["rougeL"].fmeasure  # score(target, prediction)
    assert summ.rouge_l(prediction, reference) == want, (prediction, reference)
  assert summ.rouge_l("", "") == 0.0  # no tokens: 0, not NaN


def test_a_key_number_inside_a_longer_number_is_not_found():
  ex = summ.generate_item(0, 0)
  facts = {f["name"]: f["value"] for f in ex.metadata["key_facts"]}
  pop, budget, year = facts["population"], facts["budget"], facts["bridge"]
  longer = f"About 1{pop} people ({pop}.5 on average), a budget of 1{budget}, a bridge from 1{year}."
  assert summ.score(ex, longer)["facts_found"] == []
  plain = f"About {pop.replace(',', '')} people, a budget of ${budget}, a bridge from {year}."
  assert summ.score(ex, plain)["facts_found"] == ["population", "bridge", "budget"]
  assert summ.score(ex, f"It exports {facts['export']}s.")["facts_found"] == ["export"]  # a plural counts


@pytest.mark.parametrize("value, text, found", [
    # Before: the first four were missed (a match by the written string).
    ("5.0 million", "a budget of 5 million crowns", True),
    ("2.9 million", "a budget of 2,900,000 crowns", True),
    ("58,117", "it has 58 117 residents", True),
    ("Greta Vos", "Mayor Greta\u00a0Vos opened", True),
    ("smoked trout", "its smoked-trout exports", True),
    ("48,213", "48213 residents", True),
    ("5.0 million", "5.01 million", False),
    ("4.2 million", "a 4.2-million budget, 4.2 millions", True),
    ("2035", "a bridge 2035 m long", True),  # (metres: not 2,035,000,000)
    ("48,213", "48,213m of road", True),
    ("4.2 million", "14.2 million", False),
    ("48,213", "148,213 or 48,213.5", False),
    ("2035", "in 20351", False),
    # Before: found inside longer words, a negative number for a positive one, an en dash
    # before "million" not read.
    ("Hector Navarro", "xHector Navarroson", False),
    ("oak furniture", "unoak furnitureness", False),
    ("Hector Navarro", "Mayor Hector Navarro's term", True),
    ("53,325", "a change of -53325", False),
    ("53,325", "from 1990-53,325", True),  # (a range's dash)
    ("53,325", "the population--53,325--grew", True), ("53,325", "Population:-53,325", True),
    ("12", "a change (-12)", False),
    ("2.6 million", "a 2.6\u2013million budget", True),
    # Before: a multiplier word other than "million" was not read ("58,117 billion" counted
    # as 58,117, "2,900 thousand" missed 2.9 million).
    ("58,117", "58,117 thousand residents, 58,117 billion, 58,117 hundred", False),
    ("2035", "opened in 2035 thousand", False),
    ("2.9 million", "a budget of 2,900 thousand crowns", True),
    ("2.9 million", "0.0029 billion", True), ("3000", "3 thousand", True),
    ("2.9 million", "2.9 billion, 2.9 bn", False), ("35,000,000,000", "35bn", True),
    # A plural starts a new phrase; a multiplier on the next line or after a spaced dash
    # is not the number's; a stutter reads the first word.
    ("2035", "in 2035 thousands of people came, 2040 billions of crowns later", True),
    ("2040", "in 2040 billions of crowns later", True),
    ("2040", "- Bridge: opened 2040\n- Hundred new benches", True),
    ("2040", "opened 2040 \u2014 hundred visitors", True),
    ("4.2 million", "a budget of 4.2 million million crowns", True),
])
def test_a_key_number_is_found_by_its_value_and_a_name_across_spaces_and_hyphens(value, text, found):
  assert summ.key_fact_recall(text, [{"name": "x", "value": value}]) == float(found)
