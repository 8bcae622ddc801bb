"""Multi-hop QA: the gold answer is the end of the question's path; SQuAD EM and F1 by hand."""

from pipelines.suite import multihop_qa as qa


def test_normalisation_exact_match_and_f1_follow_squad():
  assert qa.normalize("The  Ulga Guild!") == "ulga guild"
  assert qa.exact_match("the Ulga guild.", "Ulga Guild")
  assert not qa.exact_match("Ulga", "Ulga Guild")
  # pred {ulga, guild, hq} vs gold {ulga, guild}: P = 2/3, R = 1, F1 = 2 * (2/3) / (5/3) = 0.8
  assert abs(qa.token_f1("Ulga Guild HQ", "Ulga Guild") - 0.8) < 1e-9
  assert qa.token_f1("nothing", "Ulga Guild") == 0.0


def test_answer_extraction_takes_the_first_line_without_answer_prefix():
  assert qa.extract_answer("\n  Answer: Ostal\nbecause ...") == "Ostal"
  assert qa.extract_answer("**Answer:** Ostal") == "Ostal"
  assert qa.extract_answer("") is None


def test_gold_answer_is_the_end_of_the_path_through_the_stated_facts():
  for index in range(12):
    ex = qa.generate_item(0, index)
    assert ex.metadata["hops"] == (2, 3, 4)[index % 3] == len(ex.metadata["path"])
    # Walk the path using only the fact sentences in the prompt.
    facts = ex.question.split("Facts: ", 1)[1].split("\n\nQuestion:", 1)[0]
    entity = ex.metadata["start"]
    for rel in ex.metadata["path"]:
      template = qa.RELATIONS[rel][2]
      before, after = template.split("{b}")
      head = before.format(a=entity)
      start = facts.index(head) + len(head)
      entity = facts[start:facts.index(after, start)] if after else facts[start:]
    assert entity == ex.reference


def test_right_and_wrong_answers_score_as_expected():
  ex = qa.generate_item(0, 5)
  right = qa.score(ex, f"{ex.reference}\n")
  wrong = qa.score(ex, "I do not know.")
  assert right["correct"] and right["metrics"] == {"exact_match": 1.0, "f1": 1.0}
  assert not wrong["correct"] and wrong["metrics"]["exact_match"] == 0.0
