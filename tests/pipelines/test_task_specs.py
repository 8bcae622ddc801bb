"""`build_task`: config sections the tasks read, checked when the plan is built."""

import pytest

from configs import custom as custom_config
from configs import humaneval as humaneval_config
from pipelines.task_specs import build_task


@pytest.mark.parametrize("key, value, message", [
    ("timeout_s", 0.0,
     r"^sandbox\.timeout_s=0\.0 must be a finite number > 0 \(seconds per program\)$"),
    ("memory_mb", 8, r"^sandbox\.memory_mb=8 must be >= 16 \(address space per program\)$"),
    ("workers", -1, r"^sandbox\.workers=-1 must be an int >= 0 \(0 = one per usable CPU\)$"),
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
  custom task's answer format (number, the default, adds nothing: older stores stay
  valid)."""
  def task(module, **sections):
    config = module.get_config()
    for section, values in sections.items():
      config[section].update(values)
    return build_task(config)

  base = task(humaneval_config).scoring_identity()
  assert base == task(humaneval_config, sandbox={"workers": 7}).scoring_identity()
  assert base != task(humaneval_config, sandbox={"timeout_s": 99.0}).scoring_identity()
  assert task(custom_config, dataset={"answer_format": "number"}).scoring_identity() == {}
  assert task(custom_config, dataset={"answer_format": "text"}).scoring_identity() == {
      "answer_format": "text"}


@pytest.mark.parametrize("section, key, value, message", [
    ("prompt", "style", "completon", r"^prompt\.style='completon': the custom task takes \['chat', 'completion'\]$"),
    ("prompt", "template", "Q: {qestion}", r"^prompt\.template='Q: \{qestion\}': unknown field 'qestion' \(the one"),
    ("prompt", "template", "{question.x}", r"^prompt\.template='\{question\.x\}': 'str' object has no attribute"),
    ("prompt", "template", "Q: {", r"^prompt\.template='Q: \{': Single '\{' encountered in format string \("),
    ("prompt", "template", "{0}", r"^prompt\.template='\{0\}': Replacement index 0 out of range"),
    ("dataset", "answer_format", "nums", r"^dataset\.answer_format='nums': expected one of \['number', "),
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
  hold their sandbox limits as before (the pool size aside)."""
  from pipelines.beam.pipeline import scoring_identity
  task = type("OwnTask", (), {"sandbox_cfg": {"timeout_s": 3.0, "memory_mb": 512, "workers": 4}})()
  assert scoring_identity(task) == {"timeout_s": 3.0, "memory_mb": 512}
  assert scoring_identity(type("Bare", (), {})()) == {}
