"""GSM8K prompts: zero-shot chat, 8-shot CoT (chat and text), shared prefixes."""

import re

from pipelines.tasks import gsm8k as task

Q1 = "Tom has 3 apples and buys 4 more. How many apples does Tom have now?"
Q2 = "  A farm has 12 cows. How many legs?\n"


def test_exemplars_are_eight_correct_worked_solutions():
  assert len(task.FEWSHOT_EXEMPLARS) == 8
  step = re.compile(r"(\d+(?: [-+*/] \d+)+) = (\d+)")
  for ex in task.FEWSHOT_EXEMPLARS:
    steps = step.findall(ex.reasoning)
    assert steps, ex.reasoning
    for expr, result in steps:
      # Only digits, spaces and + - * / reach eval (checked by the regex).
      assert eval(expr) == int(result), (expr, result)  # pylint: disable=eval-used
    assert steps[-1][1] == ex.answer
    assert ex.solution.endswith(f"The answer is {ex.answer}.")
    assert task.extract_strict(ex.solution) == ex.answer
  assert len({ex.question for ex in task.FEWSHOT_EXEMPLARS}) == 8


def test_exemplars_are_not_the_published_ones():
  published_markers = ("grove", "parking lot", "Leah", "Jason", "Shawn",
                       "server room", "golf balls", "Olivia", "bagels")
  text = " ".join(ex.question + ex.reasoning for ex in task.FEWSHOT_EXEMPLARS)
  assert not any(m in text for m in published_markers)


def test_text_prompt_prefix_is_byte_identical():
  p1, p2 = task.fewshot_prompt(Q1), task.fewshot_prompt(Q2)
  prefix = task.FEWSHOT_PREFIX
  assert p1.startswith(prefix) and p2.startswith(prefix)
  assert p1.encode()[:len(prefix.encode())] == p2.encode()[:len(prefix.encode())]
  assert p1 == prefix + f"Q: {Q1}\nA:"
  assert p2.endswith("Q: A farm has 12 cows. How many legs?\nA:")  # whitespace trimmed
  assert p1.count("Q: ") == 9 and p1.count("The answer is ") == 8
  assert prefix.startswith("Q: ") and prefix.endswith(".\n\n")


def test_fewshot_chat_messages_share_a_prefix():
  m1, m2 = task.fewshot_messages(Q1), task.fewshot_messages(Q2)
  assert len(m1) == len(m2) == 1 + 16 + 1
  assert m1[:-1] == m2[:-1]
  assert m1[0] == {"role": "system", "content": task.FEWSHOT_SYSTEM}
  roles = [m["role"] for m in m1[1:]]
  assert roles == ["user", "assistant"] * 8 + ["user"]
  assert m1[2]["content"] == task.FEWSHOT_EXEMPLARS[0].solution
  assert m1[-1] == {"role": "user", "content": Q1}
  assert m2[-1]["content"] == "A farm has 12 cows. How many legs?"
  assert task.fewshot_messages(Q1, system=None)[0]["role"] == "user"


def test_zero_shot_messages():
  msgs = task.zero_shot_messages(Q2)
  assert msgs == [{"role": "system", "content": task.ZERO_SHOT_SYSTEM},
                  {"role": "user", "content": "A farm has 12 cows. How many legs?"}]
  assert "The answer is N." in task.ZERO_SHOT_SYSTEM  # matches the strict pattern
  assert task.zero_shot_messages(Q1, system=None) == [{"role": "user", "content": Q1}]

