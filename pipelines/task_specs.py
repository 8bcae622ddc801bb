"""Evaluation tasks by name: where examples come from, how they are prompted and scored.

  task = build_task(config)           # "gsm8k" | "humaneval" | "custom" | "suite"
  for rec in task.load(): ...         # Example | DeadLetter | Duplicate, in file order
  task.source                         # the dataset file (or generator), for messages
  prompt, stop = task.prompt(example)
  scores = task.score_batch([(example, text, stop), ...])   # one dict per sample

Data flow: 1. `load` reads the dataset through `pipelines.datasets` (bad lines
come back as `DeadLetter`s with file and line); 2. `prompt` renders the chat
messages or completion text plus stop sequences; 3. `score_batch` turns
completions into per-sample scores (HumanEval programs run in the sandbox, a
pool per batch); every score dict has `answer` and `correct`, plus task extras.
Beam-free, so tests and tools can use it directly.
"""

from __future__ import annotations

import dataclasses
import re
import string
from typing import Any, Iterator, Mapping, Optional, Sequence, Union

from o1jax.registry import Registry
from pipelines.datasets import (DeadLetter, Example, read_custom_jsonl, read_gsm8k_jsonl,
                                synthetic_examples)
from pipelines.datasets.custom_jsonl import ANSWER_FORMATS
from pipelines.datasets.gsm_synthetic import LEVELS as SYNTHETIC_LEVELS
from pipelines.datasets.humaneval import load_humaneval
from pipelines.suite.task import SuiteTask
from pipelines.tasks import (COMPLETION_STOP_SEQUENCES, fewshot_messages, fewshot_prompt,
                             score_gsm8k, zero_shot_messages)
from pipelines.tasks import humaneval
from pipelines.datasets.records import text_answer_key

Prompt = Union[str, list]  # completion text, or chat messages [{"role", "content"}]

# One short sentence keeps the 135M embedded model from rambling past its budget.
SHORT_ANSWER_SYSTEM = (
    "Solve the math problem. Answer in one short sentence that ends with "
    "\"The answer is N.\" where N is a number.")
SYSTEM_PROMPTS = {"short_answer": SHORT_ANSWER_SYSTEM, "tutor": None, "none": ""}
# short_answer for the custom task's text answers (a reply is matched by its last line:
# "The answer is Paris." never matched a gold "Paris").
SHORT_TEXT_ANSWER_SYSTEM = (
    "Answer the question. End your reply with a line that holds only the answer: a word or "
    "a short phrase, with no sentence around it.")

# "shortshot": four one-line worked examples (one per operation) as prior chat turns.
# Written for this project; they show the model the length and the final sentence.
SHORT_SHOTS: tuple[tuple[str, str], ...] = (
    ("A farmer has 23 cows and buys 9 more cows. How many cows does the farmer have now?",
     "The farmer has 23 + 9 = 32 cows. The answer is 32."),
    ("A jar holds 40 marbles. Ben takes out 15 marbles. How many marbles are in the jar?",
     "The jar has 40 - 15 = 25 marbles. The answer is 25."),
    ("There are 6 boxes with 4 pencils in each box. How many pencils are there?",
     "There are 6 * 4 = 24 pencils. The answer is 24."),
    ("Ana shares 18 stickers equally among 3 friends. How many stickers does each friend get?",
     "Each friend gets 18 / 3 = 6 stickers. The answer is 6."),
)


def shortshot_messages(question: str, system: Optional[str]) -> list:
  msgs = [{"role": "system", "content": system}] if system else []
  for q, a in SHORT_SHOTS:
    msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
  return msgs + [{"role": "user", "content": question.strip()}]


class MissingConfigKey(KeyError, ValueError):
  """A key a task reads is not in its config section (a config file of one's own): a
  ValueError, so the launcher shows it as one line; a KeyError to code that expects one."""

  def __str__(self) -> str:
    return str(self.args[0])


class ConfigSection(dict):
  """A task's plain copy of a config section that names the key a lookup misses."""

  def __init__(self, name: str, values: Mapping[str, Any]):
    super().__init__(values)
    self.name = name

  def __missing__(self, key):
    raise MissingConfigKey(f"config key {self.name}.{key} is missing: the {self.name} section "
                           f"has {sorted(self)} (the shipped configs/*.py show every key)")

  def __reduce__(self):  # pickled into the workers with the task
    return (ConfigSection, (self.name, dict(self)))


def _plain(cfg_section, name: str) -> ConfigSection:
  return ConfigSection(name, cfg_section.to_dict() if hasattr(cfg_section, "to_dict")
                       else dict(cfg_section))


def _system(name: str) -> Optional[str]:
  """Named system prompt; 'tutor' is the task module's default, other text is used as is."""
  if name == "tutor":
    from pipelines.tasks.gsm8k import ZERO_SHOT_SYSTEM
    return ZERO_SHOT_SYSTEM
  return SYSTEM_PROMPTS.get(name, name) or None


GSM_PROMPT_STYLES = ("shortshot", "zero_shot", "fewshot", "fewshot_chat")


@dataclasses.dataclass(frozen=True)
class GSMTask:
  """GSM8K-style math: synthetic or GSM8K JSONL; strict + flexible exact match."""
  dataset: Mapping[str, Any]
  prompt_cfg: Mapping[str, Any]
  name: str = "gsm8k"

  @property
  def source(self) -> str:
    """The dataset file, or the generator's name (for messages)."""
    return self.dataset["path"] if self.dataset["name"] == "gsm8k_jsonl" else self.dataset["name"]

  def load(self) -> Iterator[Union[Example, DeadLetter]]:
    ds = self.dataset
    check_gsm_config(ds)  # (build_task checks it too; a task may be built directly)
    if ds["name"] == "gsm_synthetic":
      yield from synthetic_examples(ds["n"], seed=ds["seed"], levels=tuple(ds["levels"]))
      return
    if not ds["path"]:  # gsm8k_jsonl
      raise ValueError("dataset.name=gsm8k_jsonl needs --config.dataset.path=FILE.jsonl")
    yield from _first_n(read_gsm8k_jsonl(ds["path"]), ds["n"])

  def warnings(self, sampling) -> list[str]:
    """A file cut at `dataset.n`, said: the config's n (48) is the generated set's size,
    and the official test file's 1,319 problems were scored as their first 48 without a
    word."""
    del sampling
    ds = self.dataset
    if ds["name"] != "gsm8k_jsonl" or not ds["n"]:
      return []
    more = sum(isinstance(r, Example) for r in _first_n(read_gsm8k_jsonl(ds["path"]), ds["n"] + 1))
    if more <= ds["n"]:
      return []
    return [f"dataset.n={ds['n']}: only the first {ds['n']} examples of {ds['path']} are scored "
            f"(--config.dataset.n=0 scores them all)"]

  def prompt(self, example: Example) -> tuple[Prompt, tuple[str, ...]]:
    style = self.prompt_cfg["style"]
    if style == "shortshot":
      return shortshot_messages(example.question, _system(self.prompt_cfg["system"])), ()
    if style == "zero_shot":
      return zero_shot_messages(example.question, system=_system(self.prompt_cfg["system"])), ()
    if style == "fewshot_chat":
      return fewshot_messages(example.question), ()
    if style == "fewshot":
      return fewshot_prompt(example.question), COMPLETION_STOP_SEQUENCES
    raise ValueError(f"prompt.style={style!r}: expected one of {list(GSM_PROMPT_STYLES)}")

  def scoring_identity(self) -> dict:
    """What, beside the output, decides a verdict (part of every sample's content key)."""
    return {}

  def score_batch(self, items: Sequence[tuple[Example, str, tuple[str, ...]]]) -> list[dict]:
    out = []
    for example, text, stop in items:
      s = score_gsm8k(text, example.reference, stop_sequences=tuple(stop))
      out.append({"answer": s.strict_answer if s.strict_answer is not None else s.flexible_answer,
                  "correct": s.strict_correct, **s.to_dict()})
    return out


def sandbox_config(c: Mapping[str, Any]):
  """The `SandboxConfig` of a config's `sandbox` section (timeout_s, memory_mb, workers),
  its limits checked (when the plan is built, and again where a worker builds its
  sandbox): a timeout <= 0 would fail every program as timed out (pass@1 = 0.0 that looks
  like a result), and too small a memory limit stops the interpreter before the sandbox
  can start."""
  from pipelines.sandbox import SandboxConfig
  from pipelines.sandbox.config import MIN_MEMORY_MB, RLIMIT_MAX
  if int(c["memory_mb"]) < MIN_MEMORY_MB:  # the section's unit; SandboxConfig's is bytes
    raise ValueError(f"sandbox.memory_mb={c['memory_mb']} must be >= {MIN_MEMORY_MB} "
                     f"(address space per program)")
  if int(c["memory_mb"]) > RLIMIT_MAX >> 20:
    raise ValueError(f"sandbox.memory_mb={c['memory_mb']} must be <= {RLIMIT_MAX >> 20} "
                     f"(address space per program)")
  try:  # SandboxConfig checks its own limits; its message gets the section's name
    return SandboxConfig(timeout_s=float(c["timeout_s"]), memory_bytes=int(c["memory_mb"]) << 20,
                         workers=int(c["workers"]))
  except ValueError as e:
    key = str(e).partition("=")[0].removeprefix("SandboxConfig.")
    hint = {"timeout_s": "seconds per program", "workers": "0 = one per usable CPU"}.get(key)
    message = str(e).replace("SandboxConfig.", "sandbox.", 1)
    raise ValueError(f"{message} ({hint})" if hint else message) from None


# What the sandbox counts as a pass, by version: 2 runs the completion as its own module (a
# `__main__` block does not run), serves stand-ins of signal/_posixsubprocess, keeps a
# program that prints past 1 MiB running, and accepts containers' subclasses (2026-12-06).
# Verdicts of one version are not resumed under another: samples are computed again.
SANDBOX_RULES = 2


def sandbox_identity(c: Mapping[str, Any]) -> dict:
  """The sandbox limits that can change a verdict (the pool size cannot), and its rules."""
  return {**{k: v for k, v in c.items() if k != "workers"}, "rules": SANDBOX_RULES}


def sandbox_from_config(c: Mapping[str, Any]):
  """A `Sandbox` from a config's `sandbox` section."""
  from pipelines.sandbox import Sandbox
  return Sandbox(sandbox_config(c))


_EVALPLUS_FIELDS = frozenset({"plus_input", "base_input", "atol", "contract"})


@dataclasses.dataclass(frozen=True)
class HumanEvalTask:
  """HumanEval: the problem's code, asked for in a chat turn (`prompt.style=chat`) or as a
  completion prompt (`completion`: HumanEval's original protocol, for base models); the
  programs run in the sandbox (`pipelines/tasks/humaneval.py`)."""
  dataset: Mapping[str, Any]
  prompt_cfg: Mapping[str, Any]
  sandbox_cfg: Mapping[str, Any]
  name: str = "humaneval"

  def __post_init__(self):
    self.style  # a bad prompt.style fails when the plan is built

  @property
  def style(self) -> str:
    return humaneval.check_style(str(self.prompt_cfg.get("style", "chat")))

  @property
  def source(self) -> str:
    return self.dataset["path"] or "the packaged HumanEval.jsonl.gz"

  def load(self) -> Iterator[Union[Example, DeadLetter]]:
    path = self.dataset["path"] or None
    yield from _first_n(load_humaneval(path), self.dataset["n"])

  def warnings(self, sampling) -> list[str]:
    """A HumanEval+ (EvalPlus) file, said: its records' extra inputs are not run, only
    each record's `test` (it was scored as plain HumanEval under its name, without a word)."""
    del sampling
    path = self.dataset["path"]
    if not path:
      return []
    from pipelines.datasets.jsonl import JsonLine, dataset_files, iter_records
    first = next((r for r in iter_records(dataset_files(path)[0]) if isinstance(r, JsonLine)), None)
    extra = sorted(set(getattr(first, "obj", {})) & _EVALPLUS_FIELDS)
    if not extra:
      return []
    return [f"{path} holds EvalPlus fields ({', '.join(extra)}): only each record's `test` is "
            f"run (HumanEval's own tests), not the HumanEval+ inputs"]

  def prompt(self, example: Example) -> tuple[Prompt, tuple[str, ...]]:
    return humaneval.code_prompt(example, self.style)

  def sandbox(self):
    return sandbox_from_config(self.sandbox_cfg)

  def scoring_identity(self) -> dict:
    return sandbox_identity(self.sandbox_cfg)

  def check_policy(self, policy) -> None:
    if policy.controller:
      raise ValueError(f"policy {policy.name!r} is a reasoning-controller policy; HumanEval needs "
                       f"code completions with stop sequences and pass@k over samples: use "
                       f"policy=greedy or policy=sample_n")

  def score_batch(self, items, sandbox=None) -> list[dict]:
    """Runs every item's program in the sandbox, as a pool (`humaneval.run_programs`)."""
    return humaneval.run_programs(items, sandbox or self.sandbox(), self.style)


@dataclasses.dataclass(frozen=True)
class CustomTask:
  """Any JSONL mapped by field names; numbers are read like GSM8K and compared by value
  (``answer_format=number``) or by the harness's string match (``gsm8k``), text by exact
  match."""
  dataset: Mapping[str, Any]
  prompt_cfg: Mapping[str, Any]
  name: str = "custom"

  @property
  def source(self) -> str:
    return self.dataset["path"]

  def load(self) -> Iterator[Union[Example, DeadLetter]]:
    ds = self.dataset
    if not ds["path"]:
      raise ValueError("task custom needs --config.dataset.path=FILE.jsonl")
    mapping = {"question": ds["question_field"], "answer": ds["answer_field"]}
    if ds["id_field"]:
      mapping["id"] = ds["id_field"]
    yield from _first_n(read_custom_jsonl(ds["path"], mapping, dataset=ds["name"],
                                          answer_format=ds["answer_format"]), ds["n"])

  def prompt(self, example: Example) -> tuple[Prompt, tuple[str, ...]]:
    template = self.prompt_cfg["template"]
    if self.prompt_cfg["style"] == "completion":
      return template.format(question=example.question), stop_strings(self.prompt_cfg)
    user = template.format(question=example.question)
    system = self.prompt_cfg["system"]
    text = system == "short_answer" and self.dataset["answer_format"] == "text"
    return (zero_shot_messages(user, system=SHORT_TEXT_ANSWER_SYSTEM if text else _system(system)),
            stop_strings(self.prompt_cfg))

  def check_policy(self, policy) -> None:
    """Controller policies vote, stop and answer by the number after 'The answer is':
    text answers (matched on the reply's last line) reject them."""
    if policy.controller and self.dataset["answer_format"] == "text":
      raise ValueError(f"policy {policy.name!r} is a reasoning-controller policy (it votes on the "
                       f"number after 'The answer is'); dataset.answer_format=text rejects it: use "
                       f"policy=sample_n (the summary's majority vote reads the text answers) or "
                       f"policy=greedy")

  def scoring_identity(self) -> dict:
    """What, beside the output, decides a verdict (part of every sample's content key).
    ``number`` once added nothing (it scored by the harness's string match); it compares by
    value now, so its identity says so and a store's verdicts scored the old way are not
    reused."""
    fmt = self.dataset["answer_format"]
    return {"answer_format": fmt, **({"answer_match": "value"} if fmt == "number" else {})}

  def score_batch(self, items) -> list[dict]:
    """``number``: the GSM8K extractions (strict and flexible), each compared with the
    reference by numeric value ("4" matches 4.0, `pipelines.tasks.gsm8k.values_match`);
    the score says ``"answer_match": "value"`` so the summary's vote keys the answers by
    value too. ``gsm8k``: the harness's string match (as the GSM8K task). ``text``: the
    reply's last line, by `text_answer_key`. `correct` is the flexible verdict."""
    out = []
    fmt = self.dataset["answer_format"]
    for example, text, stop in items:
      if fmt in ("number", "gsm8k"):
        by_value = fmt == "number"
        s = score_gsm8k(text, example.reference, stop_sequences=tuple(stop), by_value=by_value)
        answer = s.strict_answer if s.strict_answer is not None else s.flexible_answer
        out.append({"answer": answer, "correct": s.flexible_correct, **s.to_dict(),
                    **({"answer_match": "value"} if by_value else {})})
      else:
        answer = text.strip().splitlines()[-1].strip() if text.strip() else ""
        key = text_answer_key(answer)  # the summary's vote uses the same key
        out.append({"answer": answer, "correct": key is not None and key == text_answer_key(example.reference)})
    return out


def _first_n(records, n: int):
  """Pass dead letters and skipped duplicates through; stop after `n` examples (0 = all)."""
  kept = 0
  for rec in records:
    if isinstance(rec, Example):
      if n and kept >= n:
        return
      kept += 1
    yield rec


TASKS = Registry("task")  # (a module of `imports` adds its own: TASKS[name] = cls)
TASKS.update({"gsm8k": GSMTask, "humaneval": HumanEvalTask, "custom": CustomTask, "suite": SuiteTask})


def build_task(config) -> Union[GSMTask, HumanEvalTask, CustomTask, SuiteTask]:
  """The task named by `config.task`, holding plain copies of the sections it reads."""
  name = config.task
  if name not in TASKS:
    raise ValueError(f"task={name!r}: registered tasks are {sorted(TASKS)}")
  kwargs = {"dataset": _plain(config.dataset, "dataset"),
            "prompt_cfg": _plain(config.prompt, "prompt")}
  n = kwargs["dataset"].get("n")
  if n is not None and int(n) < 0:  # a negative count would silently drop examples
    raise ValueError(f"dataset.n={n} must be >= 0 (0 = every example)")
  if name in ("humaneval", "suite"):
    if "sandbox" not in config:
      raise ValueError(f"config has no sandbox section: task {name} runs programs in the "
                       f"sandbox (configs/{name}.py: timeout_s, memory_mb, workers)")
    kwargs["sandbox_cfg"] = _plain(config.sandbox, "sandbox")
    sandbox_config(kwargs["sandbox_cfg"])  # its limits, before any work
  if name == "custom":
    check_custom_config(kwargs["dataset"], kwargs["prompt_cfg"])
  if name == "gsm8k":
    check_gsm_config(kwargs["dataset"])
  if name in ("custom", "gsm8k"):
    check_system_prompt(kwargs["prompt_cfg"].get("system"))
  return TASKS[name](**kwargs)


def check_system_prompt(system) -> None:
  """prompt.system is a named prompt or a literal text; a lone word that is no name
  ("short_answers", "Tutor") was sent to the model as its whole system prompt."""
  names = tuple(SYSTEM_PROMPTS)
  if system is None or (isinstance(system, str) and (system in names or " " in system.strip()
                                                     or not system)):  # ("": none)
    return
  if not isinstance(system, str) or re.fullmatch(r"[A-Za-z_-]+", system.strip()):
    raise ValueError(f"prompt.system={system!r} is not a named system prompt ({', '.join(names)}); "
                     f"a literal system prompt is text of more than one word")


# The generator makes ~40k problems/s here and holds them all (the launcher's scan): more
# than this is a typo, not a dataset (1e9 grew without end, without a word).
MAX_SYNTHETIC = 1_000_000


def check_gsm_config(dataset: Mapping[str, Any]) -> None:
  """A file named for the generated dataset would be ignored without a word (the README's
  gsm8k_jsonl example with `dataset.name` left out scored generated problems)."""
  name = dataset.get("name")
  if name not in ("gsm_synthetic", "gsm8k_jsonl"):
    raise ValueError(f"dataset.name={name!r}: expected gsm_synthetic or gsm8k_jsonl")
  if name == "gsm_synthetic" and dataset.get("path"):
    raise ValueError(f"dataset.path={dataset['path']!r} is set but dataset.name=gsm_synthetic "
                     f"generates its problems: add --config.dataset.name=gsm8k_jsonl to read "
                     f"the file")
  if name == "gsm_synthetic" and dataset.get("n") == 0:  # (0 = every example of a file)
    raise ValueError(f"dataset.n=0 reads every example of a file; gsm_synthetic generates "
                     f"problems: give their number (1 to {MAX_SYNTHETIC:,})")
  if name == "gsm_synthetic" and int(dataset.get("n") or 0) > MAX_SYNTHETIC:
    raise ValueError(f"dataset.n={dataset['n']}: the generated dataset holds at most "
                     f"{MAX_SYNTHETIC:,} problems")
  if name == "gsm_synthetic":
    levels = dataset.get("levels")
    ok = isinstance(levels, (list, tuple)) and levels and all(
        type(v) is int and v in SYNTHETIC_LEVELS for v in levels)  # (bool is no level)
    if not ok:
      raise ValueError(f"dataset.levels={levels!r}: the generator's levels are a non-empty "
                       f"list of {list(SYNTHETIC_LEVELS)}")
  else:  # a file is read as it is: the generator's settings would be ignored without a word
    from configs.gsm8k import SYNTHETIC_DEFAULTS  # (their defaults are set by every config)
    for key, default in SYNTHETIC_DEFAULTS.items():
      value = dataset.get(key, default)
      if (tuple(value) if isinstance(value, (list, tuple)) else value) != default:
        raise ValueError(f"dataset.{key}={value!r} chooses generated problems, but "
                         f"dataset.name=gsm8k_jsonl reads the file as it is (dataset.n takes "
                         f"its first n): leave dataset.{key} out")


def stop_strings(prompt_cfg: Mapping[str, Any]) -> tuple[str, ...]:
  """prompt.stop as the engine will take it (one str is one stop string), checked by the
  engine's own rule (`GenerationParams`) with the key named."""
  from o1jax.engine import GenerationParams
  try:
    return GenerationParams(stop=prompt_cfg.get("stop") or ()).stop
  except ValueError as e:
    raise ValueError(f"prompt.stop={prompt_cfg.get('stop')!r}: {e}") from None


CUSTOM_STYLES = ("chat", "completion")


def check_custom_config(dataset: Mapping[str, Any], prompt_cfg: Mapping[str, Any]) -> None:
  """The custom task's choices, named before any work: a mistyped prompt.style would
  silently run as chat, a template naming another field stopped the launcher's scan with a
  KeyError traceback, and an unknown answer_format was an error without the key's name."""
  if dataset.get("answer_format") not in ANSWER_FORMATS:
    raise ValueError(f"dataset.answer_format={dataset.get('answer_format')!r}: expected one of "
                     f"{list(ANSWER_FORMATS)}")
  style = prompt_cfg.get("style")
  if style not in CUSTOM_STYLES:
    raise ValueError(f"prompt.style={style!r}: the custom task takes {list(CUSTOM_STYLES)}")
  template = prompt_cfg.get("template", "{question}")
  try:
    str(template).format(question="")
  except (KeyError, IndexError, AttributeError, ValueError) as e:
    reason = f"unknown field {e}" if isinstance(e, KeyError) else str(e)
    raise ValueError(f"prompt.template={template!r}: {reason} (the one field is {{question}}; "
                     f"a literal brace is written {{{{ or }}}})") from None
  fields = [(field, spec, conversion)
            for _, field, spec, conversion in string.Formatter().parse(str(template)) if field]
  if not any(field == "question" for field, _, _ in fields):
    raise ValueError(f"prompt.template={template!r} has no {{question}} field: every example "
                     f"would get the same prompt")
  shaped = next((f for f in fields if f[1] or f[2]), None)
  if shaped is not None:  # ({question:.0} gave every example the same prompt; :.20 cut them)
    raise ValueError(f"prompt.template={template!r}: write the field as {{question}}, without "
                     f"a format spec or conversion ({{question{'!' + shaped[2] if shaped[2] else ''}"
                     f"{':' + shaped[1] if shaped[1] else ''}}} would cut or change the question)")
  stop_strings(prompt_cfg)
