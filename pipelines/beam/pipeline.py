"""The evaluation job as a Beam graph: read → samples → skip finished → RunInference → score → store.

  plan = build_plan(config, output_dir)
  with beam.Pipeline(options=...) as p:
    build_pipeline(p, plan)

Data flow:
  1. `ReadDataset`: the task's loader runs inside the job (so gs:// inputs are read by
     workers); examples are numbered in file order, malformed lines become dead letters
     with file and line number, repeated lines are skipped. (The launcher has read the
     same records once already, `scan_dataset`, to stop early on a missing or empty file.)
  2. `Samples`: each example becomes `policy.num_samples` `WorkItem`s keyed by a content
     hash of (model, generation config, example, sample index); `Reshuffle` spreads them
     over workers.
  3. `SkipFinished`: items whose key holds a valid record of that item in the store emit
     it instead (this is what makes reruns resume); a damaged file (`stored_record` says
     why) is recomputed and overwritten.
  4. `RunInference` with `PredictorModelHandler`; failed batches go to dead letters.
  5. `Score`: the task scores batches of completions (HumanEval: in the sandbox); `Store`
     writes each record to the store the moment it is done. A record that cannot be
     written (disk full) stops the job with a `WriteError` naming the file, not a dead
     letter: the sample is fine, the output directory is not.
  6. `WriteResults`: stored + new records, sorted by (example index, sample index), become
     results.jsonl; all dead letters become dead_letters.jsonl.
Per-sample records are fully determined by their inputs except their `timing` field.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
import time
import traceback
from typing import Any, Iterable, Iterator, Sequence

import apache_beam as beam
from apache_beam.metrics import Metrics
from apache_beam.ml.inference.base import RunInference

from configs import common
from pipelines.beam.handler import PredictorModelHandler
from pipelines.beam.options import batches_sharing_a_model
from pipelines.beam.store import ResultStore, strict_json, utf8, write_whole
from pipelines.config_imports import import_modules
from pipelines.datasets import DeadLetter, Duplicate, Example
from pipelines.datasets.records import text_bytes
from o1jax.controller import BasePolicy, SamplingSpec, build_policy, policy_names
from pipelines.predictors import (ERROR_KEY, REQUEST_STREAM, PredictorSpec, WorkItem,
                                  model_fingerprint, request_id_before_2026_12_07,
                                  request_id_for, speculative_config)
from pipelines.task_specs import build_task, sandbox_identity

# Bump when the record layout or what a sample computes changes, so old stores are not
# reused. 2: the forced answer prefix's separator, top-k before top-p, 64-bit seeds.
STORE_VERSION = 2
NAMESPACE = "o1jax_eval"


@dataclasses.dataclass(frozen=True)
class EvalPlan:
  """Everything the stages need, picklable (no model, no open files)."""
  task: Any  # a pipelines.task_specs task
  policy: BasePolicy
  sampling: SamplingSpec
  predictor: PredictorSpec
  model_fp: dict
  output_dir: str
  batch_size: int = 8
  share_model: bool = True
  imports: tuple[str, ...] = ()  # the config's modules (pipelines/config_imports.py)

  @property
  def store_dir(self) -> str:
    return f"{self.output_dir.rstrip('/')}/store"

  @property
  def speculation_changes_outputs(self) -> bool:
    """Speculation is in the content hash only where it can change outputs: in the
    controller's loop under a policy whose traces stop each other (they advance at
    different rates inside a verify call), with bf16 matmuls, whose CPU dot sums a row
    otherwise at some row counts (a verify call runs B x (K + 1) rows: log p moved up to
    2e-3 on the tiny test model, so a near-tie may fork), and with float8 ones, whose
    products run in XLA's dot wherever the native f32 kernel does not (backend=reference,
    a GPU, no native build): rounding to e4m3 turns its batch-dependent sums into whole
    steps (5 of 16 greedy GSM answers of the embedded model changed with speculation on,
    under keys that did not). Elsewhere rows get plain decoding's tokens and bits."""
    if self.predictor.speculative_config() is None:
      return False
    return ((self.predictor.name == "controller" and self.policy.cross_row_stops)
            or (self.predictor.name in ("engine", "controller")
                and self.predictor.matmul_dtype in ("bfloat16", "float8")))


def resolve_predictor(name: str, policy: BasePolicy) -> str:
  """The predictor that runs `policy`: controller policies need the controller.

  1. unknown names list the registered ones; 2. a controller policy turns
  engine/generator into controller (fake stays fake); 3. the controller without a
  controller policy is an error (a task rejects the policies it cannot score in its
  `check_policy`).
  """
  from pipelines.predictors import PLAIN_MODEL_PREDICTORS, PREDICTORS
  if name not in PREDICTORS:
    raise ValueError(f"model.predictor={name!r}: registered predictors are {sorted(PREDICTORS)}")
  if policy.controller:
    return "controller" if name in PLAIN_MODEL_PREDICTORS else name
  if name == "controller":
    raise ValueError(f"model.predictor=controller runs only controller policies "
                     f"{policy_names(controller=True)}, not {policy.name!r}")
  return name


def check_admission(policy: str, controller: bool) -> None:
  """engine.policy: one of the engine scheduler's policies; a controller policy admits by
  fifo or shortest_budget only."""
  from o1jax.controller.controller import ADMISSIONS
  from o1jax.engine.engine import POLICIES
  valid = ADMISSIONS if controller else POLICIES
  if policy not in valid:
    who = "a controller policy's admission" if controller else "the engine scheduler"
    raise ValueError(f"engine.policy={policy!r}: {who} takes {list(valid)}")


# The predictors that are neither the engine nor the controller, as messages name them.
_PLAIN = {"generator": "the generator", "fake": "the fake model"}


def check_engine_section(spec: PredictorSpec) -> None:
  """The `EngineConfig` a worker will build from the engine section, built now; its
  message gets the section's name (`engine.max_slots must be an int >= 1, got -1`)."""
  from pipelines.predictors import engine_config
  try:
    engine_config(spec)
  except (TypeError, ValueError) as e:
    message = str(e)
    raise ValueError(f"engine.{message}" if re.match(r"^\w+(=| must be)", message) else message) from e


def check_engine_pool(plan: EvalPlan, items: Sequence[WorkItem], model=None) -> None:
  """A fixed engine pool (engine.num_blocks) too small for any of the job's requests,
  named once the work items are known (every sample was a dead letter): even a 1-token
  prompt with the smallest max_new_tokens of the items does not fit, or none of the job's
  prompts, tokenized, with its max_new_tokens. model: (config, tokenizer loader) of the
  checkpoint where the launcher has it (else the prompts are not tokenized here)."""
  if plan.predictor.name != "engine" or not items:
    return
  from pipelines.predictors import engine_config
  config = engine_config(plan.predictor)
  if config.num_blocks is None:
    return
  new = min(int(i.sampling.max_new_tokens) for i in items)
  need = -(-(1 + new) // config.block_size)
  holds = (f"engine.num_blocks={config.num_blocks} holds "
           f"{config.num_blocks * config.block_size} tokens: no request fits")
  advice = "raise it, or 0 sizes the pool for the job's prompts"
  if need > config.num_blocks:
    raise ValueError(f"{holds} (even a 1-token prompt with the job's smallest max_new_tokens, "
                     f"{new}, needs {need} blocks of {config.block_size}); {advice}")
  # The job's own prompts, tokenized as the engine will: if none fits, every sample was a
  # dead letter after the model loaded.
  if model is None:
    return
  from o1jax.model.generation import encode_prompt
  from o1jax.model.thinking import template_kwargs
  model_config, tokenizer = model[0], model[1]()
  chat_kwargs = template_kwargs(plan.predictor.thinking, tokenizer)  # (as the engine renders)
  tokens = {}
  best = None  # (blocks, prompt tokens, max_new_tokens) of the request that needs fewest
  for item in items:
    text = json.dumps(item.prompt, sort_keys=True)
    if text not in tokens:
      try:
        tokens[text] = len(encode_prompt(tokenizer, item.prompt, model_config.vocab_size,
                                         chat_kwargs))
      except ValueError:  # a prompt the engine refuses is that sample's dead letter
        continue
    worst = min(tokens[text] + int(item.sampling.max_new_tokens), model_config.max_context)
    blocks = -(-worst // config.block_size)
    if best is None or blocks < best[0]:
      best = (blocks, tokens[text], int(item.sampling.max_new_tokens))
  if best is not None and best[0] > config.num_blocks:
    raise ValueError(f"{holds} (the shortest need is a {best[1]}-token prompt with "
                     f"max_new_tokens {best[2]}: {best[0]} blocks of {config.block_size}); "
                     f"{advice}")


# What every run reads of a config, by section (a config file of one's own may leave parts
# out; the other sections and keys are optional or read by the task, which names a missing
# one: task_specs.ConfigSection).
REQUIRED_CONFIG = {"task": (), "model": ("predictor", "source"), "dataset": (), "prompt": (),
                   "sampling": ("max_new_tokens", "temperature", "top_p", "top_k", "seed"),
                   "policy": ("name",), "runner": ("name", "batch_size", "share_model")}


def check_config_shape(config) -> None:
  """One line for a config without a part every run reads, rather than an AttributeError
  from deep in `build_plan`."""
  import ml_collections
  if not isinstance(config, ml_collections.ConfigDict):
    raise ValueError(f"config: get_config() must return an ml_collections.ConfigDict, got "
                     f"{type(config).__name__}")
  for name, keys in REQUIRED_CONFIG.items():
    if name not in config:
      what = "key" if name == "task" else "section"
      raise ValueError(f"config has no {what} {name!r}: every config has "
                       f"{list(REQUIRED_CONFIG)} (configs/common.py builds the sections)")
    if name == "task":
      continue
    section = config[name]
    if not isinstance(section, ml_collections.ConfigDict):
      raise ValueError(f"config.{name} must be a section (a ConfigDict), got "
                       f"{type(section).__name__}")
    missing = [k for k in keys if k not in section]
    if missing:
      raise ValueError(f"config key {name}.{missing[0]} is missing: the {name} section has "
                       f"{sorted(section.keys())} (the shipped configs/*.py show every key)")


def build_plan(config, output_dir: str) -> EvalPlan:
  """Config → plan; raises ValueError on a config without a part every run reads, a
  module of `imports` that cannot be imported, or an unknown task, policy or predictor."""
  check_config_shape(config)
  imports = import_modules(config.get("imports", ()))  # they may register what follows
  policy = build_policy(config.policy.to_dict())
  s = config.sampling
  for key in ("max_new_tokens", "temperature", "top_p", "top_k", "seed"):
    if isinstance(s[key], bool):  # (int(True) is 1: top_k=True ran as top_k=1)
      raise ValueError(f"sampling.{key}={s[key]!r}: expected a number, not a bool")
  try:
    sampling = SamplingSpec(max_new_tokens=int(s.max_new_tokens), temperature=float(s.temperature),
                            top_p=float(s.top_p), top_k=int(s.top_k), seed=int(s.seed))
  except ValueError as e:
    raise ValueError(f"sampling: {e}") from e
  neutral = common.sampling_section(1)
  for field in policy.own_sampling:  # set where the policy's own value replaces it
    if s[field] != neutral[field]:
      raise ValueError(
          f"sampling.{field}={s[field]!r} is not used: policy {policy.name} samples with its "
          f"own {field} ({getattr(policy, field)!r}); set policy.{field} instead")
  try:  # a policy's own sampling settings, checked now rather than per example
    policy.sampling(sampling, 0)
  except ValueError as e:
    raise ValueError(f"policy {policy.name}: {e}") from e
  batch = config.runner.batch_size
  if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
    # named here: the engine's slots are sized from it and would take the blame
    raise ValueError(f"runner.batch_size={batch!r}: expected an int >= 1 (examples per batch)")
  name = resolve_predictor(config.model.predictor, policy)
  # The controller's KV cache: the controller section and the engine's kv_dtype. The section
  # is checked for every policy (a typo there is one whichever policy runs); the kv_dtype it
  # shares with the engine only where a controller runs.
  from o1jax.controller import CacheConfig
  section = config.get("controller") or {}
  section = dict(section.to_dict() if hasattr(section, "to_dict") else section)
  section["kv_dtype"] = (str((config.get("engine") or {}).get("kv_dtype", "float32"))
                         if policy.controller else "float32")
  cache = CacheConfig.from_dict(section)
  if policy.controller:
    cache.check_holds_request(policy.traces_per_call)
  controller = cache.to_dict() if policy.controller else None
  from o1jax.model import thinking
  thinking.check_setting(config.model.get("thinking", "auto"))  # markers: when a worker loads
  budget = config.get("budget")
  if budget is not None:  # checked now rather than in a worker
    from o1jax.engine.budget import BudgetConfig
    budget_cfg = BudgetConfig.from_dict(budget.to_dict() if hasattr(budget, "to_dict") else budget)
    if budget_cfg.mode != "fixed" and name not in ("engine", "controller"):
      raise ValueError(f"budget.mode={budget_cfg.mode!r} needs model.predictor=engine or a "
                       f"controller policy; this run uses {name!r} ({_PLAIN[name]} has no "
                       f"budget to adapt)")
  speculative = config.get("speculative")
  speculative = speculative.to_dict() if hasattr(speculative, "to_dict") else speculative
  spec_cfg = speculative_config(speculative or {})
  if spec_cfg is not None and name not in ("engine", "controller"):
    raise ValueError(f"speculative.enabled=True needs model.predictor=engine or a controller "
                     f"policy; this run uses {name!r} ({_PLAIN[name]} does not speculate)")
  if spec_cfg is not None and spec_cfg.drafter == "draft_model" and not spec_cfg.draft_source:
    raise ValueError("speculative.drafter='draft_model' needs speculative.draft_source: the "
                     "draft checkpoint (it must share the model's tokenizer)")
  if spec_cfg is not None and name == "controller" and spec_cfg.drafter != "prompt_lookup":
    raise ValueError(f"speculative.drafter={spec_cfg.drafter!r}: the controller's loop drafts "
                     f"by 'prompt_lookup' only (the engine runs every drafter)")
  engine = config.get("engine") or {}
  check_admission(str(engine.get("policy", "fifo")), controller=name == "controller")
  dp = int(engine.get("data_parallel", 1) or 1)
  if dp > 1 and name != "engine":
    raise ValueError(f"engine.data_parallel={dp} needs model.predictor=engine; this run uses "
                     f"{name!r} (run more Beam workers to spread it over devices)")
  if dp > 1 and budget is not None and budget.get("mode", "fixed") != "fixed":
    raise ValueError("budget.mode=adaptive with engine.data_parallel > 1 is not supported: "
                     "each replica would need its own budget (use budget.mode=fixed)")
  if int(engine.get("tensor_parallel", 1) or 1) > 1 and name not in ("engine", "controller"):
    raise ValueError(f"engine.tensor_parallel={engine.get('tensor_parallel')} needs "
                     f"model.predictor=engine or a controller policy; this run uses {name!r} "
                     f"({_PLAIN[name]} runs on one device)")
  spec = PredictorSpec.from_config(
      config.model, name=name, batch_size=int(config.runner.batch_size),
      batches_in_flight=batches_sharing_a_model(config.runner), engine=config.get("engine"), policy=policy.to_dict() if policy.controller else None,
      controller=controller, budget=budget, speculative=speculative, imports=imports)
  # Found here, not when every worker builds its engine; for every predictor (a typo in a
  # section the run does not use stays one when a later run uses it).
  check_engine_section(spec)
  task = build_task(config)
  if hasattr(task, "check_policy"):  # a task may reject policies that cannot score it
    task.check_policy(policy)
  return EvalPlan(task=task, policy=policy, sampling=sampling, predictor=spec,
                  model_fp=model_fingerprint(spec), output_dir=output_dir,
                  batch_size=int(config.runner.batch_size),
                  share_model=bool(config.runner.share_model), imports=imports)


def _canonical(obj) -> bytes:
  text = json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=list)
  return text_bytes(text)  # never raises, also on text that is not valid Unicode


def prompt_sha256(prompt) -> str:
  return hashlib.sha256(_canonical(prompt)).hexdigest()


def scoring_identity(task, example: Example) -> dict:
  """What, beside the output, decides the task's verdicts of `example`
  (`scoring_identity()`, or `scoring_identity(example)` for a task whose
  `scoring_by_example` is set: the suite's categories; a task registered without one: its
  sandbox limits, as before that method)."""
  if getattr(task, "scoring_by_example", False):
    return task.scoring_identity(example)
  if hasattr(task, "scoring_identity"):
    return task.scoring_identity()
  limits = getattr(task, "sandbox_cfg", {}) or {}
  return sandbox_identity(limits) if limits else {}


def work_items(plan: EvalPlan, example: Example, example_index: int) -> list[WorkItem]:
  """The work of one example: one item per sample index, each keyed by content hash."""
  prompt, stop = plan.task.prompt(example)
  # A task may set a per-example token budget (the suite: per category); a controller
  # policy's budgets are its own (it never reads max_new_tokens: in the key, a change of
  # the category's budget recomputed samples to the same outputs).
  base = (plan.task.sampling_for(example, plan.sampling)
          if hasattr(plan.task, "sampling_for") and not plan.policy.controller else plan.sampling)
  items = []
  scoring = scoring_identity(plan.task, example)
  for i in range(plan.policy.num_samples):
    sampling = plan.policy.sampling(base, i)
    # What can change the sample: a controller policy's settings all can (its loop draws
    # with the seed even at temperature 0, after a backtrack), plain decoding's not all.
    identity = sampling.to_dict() if plan.policy.controller else sampling.sample_identity()
    content = {
        "v": STORE_VERSION, "model": plan.model_fp, "task": plan.task.name, "prompt": prompt,
        "stop": list(stop), "sampling": identity, "policy": plan.policy.sample_identity(),
        "scoring": scoring, "example": example.to_dict(), "sample_index": i}
    if "seed" in identity:  # it draws from its request's stream (a greedy sample does not)
      content["request_stream"] = REQUEST_STREAM
    if plan.speculation_changes_outputs:
      content["speculative"] = dict(plan.predictor.speculative)
    key = hashlib.sha256(_canonical(content)).hexdigest()
    items.append(WorkItem(key=key, example=example.to_dict(), example_index=example_index,
                          sample_index=i, prompt=prompt, stop=tuple(stop), sampling=sampling,
                          request_id=request_id_for(example.id, i)))
  return items


def numbered_examples(task) -> Iterator:
  """The task's records with examples numbered in file order: (index, Example),
  DeadLetter or Duplicate. The launcher's scan and the job's ReadDataset both read
  through here, so they see the same examples under the same indices."""
  index = 0
  for rec in task.load():
    if isinstance(rec, Example):
      yield index, rec
      index += 1
    else:
      yield rec


@dataclasses.dataclass
class DatasetScan:
  """What the dataset holds, read once by the launcher before the job starts."""
  items: list  # WorkItems
  dead: list  # input DeadLetters
  examples: int = 0
  duplicates: dict = dataclasses.field(default_factory=dict)  # source -> lines skipped
  # (path, sha256) of the local dataset files as the launcher read them
  data_state: list = dataclasses.field(default_factory=list)


def scan_dataset(plan: EvalPlan) -> DatasetScan:
  """All work items, input dead letters and skipped duplicate lines, in this process.

  Raises `DatasetError` for a missing or unreadable dataset file.
  """
  scan = DatasetScan(items=[], dead=[])
  for rec in numbered_examples(plan.task):
    if isinstance(rec, DeadLetter):
      scan.dead.append(rec)
    elif isinstance(rec, Duplicate):
      scan.duplicates[rec.source] = scan.duplicates.get(rec.source, 0) + 1
    else:
      scan.items.extend(work_items(plan, rec[1], rec[0]))
      scan.examples += 1
  return scan


LONGEST_PROMPTS = 4  # by characters: the longest in tokens is among them


def sized_for(plan: EvalPlan, items: Iterable[WorkItem]) -> EvalPlan:
  """`plan` whose predictor knows the job's longest prompts and largest max_new_tokens
  (the engine sizes its KV pool so every slot holds such a sequence)."""
  prompts: dict[str, int] = {}
  new = 0
  for item in items:
    if item.sample_index == 0:  # an example's samples share its prompt
      text = json.dumps(item.prompt, default=list)
      prompts[text] = len(text)
    new = max(new, int(item.sampling.max_new_tokens))
  longest = tuple(sorted(prompts, key=lambda p: (-prompts[p], p))[:LONGEST_PROMPTS])
  return dataclasses.replace(plan, predictor=dataclasses.replace(
      plan.predictor, longest_prompts=longest, max_new_tokens=new))


def plan_items(plan: EvalPlan) -> tuple[list[WorkItem], list[DeadLetter]]:
  """All work items and input dead letters, computed in this process (progress bar, tests)."""
  scan = scan_dataset(plan)
  return scan.items, scan.dead


def dead_letter(stage: str, reason: str, **fields) -> dict:
  return {"stage": stage, "reason": reason, **fields}


def input_dead_letter(rec: DeadLetter) -> dict:
  return dead_letter("input", rec.reason, source=rec.source, line_number=rec.line_number, raw=rec.raw)


class ReadDataset(beam.DoFn):
  """Loader → (example index, Example) on the main output, dead letters tagged 'dead';
  duplicate lines are skipped (counted)."""

  def __init__(self, task):
    self.task = task

  def process(self, _unused) -> Iterator:
    for rec in numbered_examples(self.task):
      if isinstance(rec, DeadLetter):
        Metrics.counter(NAMESPACE, "input_dead_letters").inc()
        yield beam.pvalue.TaggedOutput("dead", input_dead_letter(rec))
      elif isinstance(rec, Duplicate):
        Metrics.counter(NAMESPACE, "input_duplicates").inc()
      else:
        yield rec


def stored_record(store: ResultStore, item: WorkItem) -> tuple[dict | None, str | None]:
  """The store's record of `item`: (record, None); (None, None) when not stored or stored
  without a verdict (a sandbox error); (None, why) when the file is not a record of this
  item (`why` completes "store record PATH ..."). The key does not hold the example's
  position in the file (a rerun after lines were added or removed reuses the samples), so
  the record gets the item's index."""
  record, problem = store.read(item.key)
  if record is None:
    return None, problem
  problem = record_problem(record, item)
  if problem:
    return None, problem
  if isinstance(record["score"], dict) and record["score"].get("sandbox_error"):
    # No verdict (the sandbox failed: a setup that missed its deadline under load): a
    # rerun computes it again rather than resume the failure for good.
    return None, None
  if record["example_index"] != item.example_index:
    record = {**record, "example_index": item.example_index}
  if record["trace"].get("request_id") != item.request_id:  # a greedy record's older id
    record = {**record, "trace": {**record["trace"], "request_id": item.request_id}}
  sampling = item.sampling.to_dict()
  if record["trace"].get("sampling") != sampling:
    # Settings outside the key (a greedy sample's seed, top_k, top_p) as this run has them:
    # a fresh run's record of the same config (the record showed the computing run's).
    record = {**record, "trace": {**record["trace"], "sampling": sampling}}
  return record, None


def _json_value(value):
  return json.loads(json.dumps(value, default=list))


def _stored_sampling_identity(stored):
  """`SamplingSpec.sample_identity` of a record's sampling, or the value as stored where it
  is no sampling (then it differs from every item's)."""
  try:
    return _json_value(SamplingSpec(**stored).sample_identity())
  except (TypeError, ValueError):
    return stored


def record_problem(record: dict, item: WorkItem) -> str | None:
  """Why `record` is not a finished record of `item` (the fields `make_record` writes, the
  item's identity), or None."""
  missing = [f for f in RECORD_FIELDS if f not in record]
  unknown = [str(f) for f in record if f not in RECORD_FIELDS]
  if missing or unknown:
    return (f"is not a result record (missing {', '.join(missing)})" if missing
            else f"is not a result record (unknown field {', '.join(unknown)})")
  if not isinstance(record["output"], str) or not isinstance(record["correct"], bool):
    return "is not a result record (output or correct of the wrong type)"
  trace = record["trace"] if isinstance(record["trace"], dict) else {}
  # The sampling as far as it decides the sample (a greedy one's seed and filters do not:
  # the key leaves them out, and a record computed under another seed is this one's).
  expected = {"example_id": item.example["id"], "sample_index": item.sample_index,
              "dataset": item.example["dataset"], "prompt_sha256": prompt_sha256(item.prompt),
              "sampling": _json_value(item.sampling.sample_identity()),
              "request_id": item.request_id}
  found = {**{k: record[k] for k in ("example_id", "sample_index", "dataset", "prompt_sha256")},
           "sampling": _stored_sampling_identity(trace.get("sampling")),
           "request_id": trace.get("request_id")}
  if "seed" not in expected["sampling"] and found["request_id"] == request_id_before_2026_12_07(
      item.example["id"], item.sample_index):
    found["request_id"] = item.request_id  # (it draws nothing from its stream: the id is a label)
  for name, value in expected.items():
    if found[name] != value:
      if isinstance(found[name], dict) and isinstance(value, dict):  # the keys that differ
        keys = sorted(k for k in {*found[name], *value} if found[name].get(k) != value.get(k))
        return (f"is the record of another sample ({name} " + ", ".join(
            f"{k} {found[name].get(k)!r:.40}, expected {value.get(k)!r:.40}" for k in keys) + ")")
      return f"is the record of another sample ({name} {found[name]!r:.40}, expected {value!r:.40})"
  return None


class SkipFinished(beam.DoFn):
  """Items with a stored record emit that record (tag 'finished'); the rest go on."""

  def __init__(self, store_dir: str):
    self.store_dir = store_dir

  def setup(self):
    self.store = ResultStore(self.store_dir)

  def process(self, item: WorkItem) -> Iterator:
    record, problem = stored_record(self.store, item)
    if record is not None:
      Metrics.counter(NAMESPACE, "samples_resumed").inc()
      yield beam.pvalue.TaggedOutput("finished", record)
      return
    if problem:  # the launcher warned already (local stores); recomputed, then overwritten
      Metrics.counter(NAMESPACE, "store_records_damaged").inc()
      logging.warning("store record %s %s; it is recomputed", self.store.path(item.key), problem)
    yield item


RECORD_FIELDS = ("key", "example_id", "example_index", "sample_index", "dataset", "task", "policy",
                 "level", "prompt_sha256", "reference", "output", "answer", "correct", "score",
                 "tokens", "finish_reason", "trace", "timing")  # make_record's, in its order


def make_record(plan: EvalPlan, item: WorkItem, prediction: dict, score: dict) -> dict:
  """One results.jsonl line (key order fixed; everything but `timing` is deterministic)."""
  ex = item.example
  extras = {k: v for k, v in score.items() if k not in ("answer", "correct")}
  return {
      "key": item.key, "example_id": ex["id"], "example_index": item.example_index,
      "sample_index": item.sample_index, "dataset": ex["dataset"], "task": plan.task.name,
      "policy": plan.policy.name, "level": ex["metadata"].get("level"),
      "prompt_sha256": prompt_sha256(item.prompt),
      "reference": None if plan.task.name == "humaneval" else ex["reference"],
      "output": prediction["text"], "answer": score.get("answer"), "correct": bool(score.get("correct")),
      "score": extras, "tokens": dict(prediction.get("tokens", {})),
      "finish_reason": prediction.get("finish_reason"),
      "trace": {"policy": plan.policy.to_dict(), "sampling": item.sampling.to_dict(),
                "request_id": item.request_id, **(prediction.get("trace") or {})},
      "timing": prediction.get("timing", {}),
  }


class Score(beam.DoFn):
  """Batches of PredictionResults → scored records (`Store` writes each at once).

  A task may return an exception in place of one item's score (its scorer raised on that
  item): the item becomes a dead letter on the 'unscored' output, the rest are stored. An
  item the predictor refused alone (an {"error": reason} prediction) is an inference dead
  letter on the same output.
  """

  def __init__(self, plan: EvalPlan):
    self.plan = plan

  def setup(self):
    self.sandbox = self.plan.task.sandbox() if hasattr(self.plan.task, "sandbox") else None

  def process(self, batch) -> Iterator[dict]:
    refused = [r for r in batch if ERROR_KEY in r.inference]
    for r in refused:  # the predictor refused this item alone (PredictorModelHandler)
      item = r.example
      Metrics.counter(NAMESPACE, "inference_dead_letters").inc()
      yield beam.pvalue.TaggedOutput("unscored", dead_letter(
          "inference", r.inference[ERROR_KEY], key=item.key, example_id=item.example["id"],
          sample_index=item.sample_index))
    batch = [r for r in batch if ERROR_KEY not in r.inference]
    if not batch:
      return
    items = [(Example.from_dict(r.example.example), r.inference["text"], r.example.stop) for r in batch]
    if self.sandbox is not None:
      scores = self.plan.task.score_batch(items, sandbox=self.sandbox)
    else:
      scores = self.plan.task.score_batch(items)
    for result, score in zip(batch, scores):
      if isinstance(score, Exception):
        item = result.example
        Metrics.counter(NAMESPACE, "scoring_dead_letters").inc()
        yield beam.pvalue.TaggedOutput("unscored", dead_letter(
            "scoring", str(score), key=item.key, example_id=item.example["id"],
            sample_index=item.sample_index))
        continue
      yield make_record(self.plan, result.example, result.inference, score)


class Store(beam.DoFn):
  """Writes each scored record to the store and passes it on. Not under exception
  handling: a record that cannot be written (`WriteError`) stops the job."""

  def __init__(self, store_dir: str):
    self.store_dir = store_dir

  def setup(self):
    self.store = ResultStore(self.store_dir)

  def process(self, record: dict) -> Iterator[dict]:
    self.store.put(record["key"], record)
    Metrics.counter(NAMESPACE, "samples_computed").inc()
    yield record


def _failed_items(element) -> Iterable:
  """A failed element (batch, or single item/result) → its work items."""
  if isinstance(element, (list, tuple)) and element and not isinstance(element, WorkItem):
    for e in element:
      yield from _failed_items(e)
  elif isinstance(element, WorkItem):
    yield element
  elif hasattr(element, "example") and isinstance(element.example, WorkItem):
    yield element.example


def failure_dead_letters(stage: str):
  def convert(bad) -> Iterator[dict]:
    element, error = bad
    reason = error[1] if isinstance(error, tuple) and len(error) > 1 else repr(error)
    if isinstance(error, BaseException):
      reason = "".join(traceback.format_exception_only(type(error), error)).strip()
    items = list(_failed_items(element))
    Metrics.counter(NAMESPACE, f"{stage}_dead_letters").inc(max(1, len(items)))
    if not items:
      yield dead_letter(stage, str(reason))
    for item in items:
      yield dead_letter(stage, str(reason), key=item.key, example_id=item.example["id"],
                        sample_index=item.sample_index)
  return convert


def write_text(path: str, text: str) -> None:
  """Whole-file write (`write_whole`: atomic locally; `WriteError` naming the file)."""
  write_whole(path, utf8(text))


def _write_jsonl(records: list[dict], path: str, sort_key) -> int:
  # Strict JSON as the store writes it (a record computed now and the same record resumed
  # from the store give the same line: NaN / inf are null in both).
  lines = [json.dumps(strict_json(r), ensure_ascii=False, allow_nan=False)
           for r in sorted(records, key=sort_key)]
  write_text(path, "".join(line + "\n" for line in lines))
  return len(lines)


def reconcile_with_store(records: list[dict], items: Sequence[WorkItem], store: ResultStore,
                         path: str) -> tuple[list[dict], int, int]:
  """results.jsonl checked against the store, which holds every finished sample: a
  record the job's collection missed is read back from the store, a key listed twice is
  kept once, and the file is rewritten where either happened. Returns (records, restored,
  repeated). Why: a runner that recomputes lost work (Dask, a worker killed mid-job) reruns
  `SkipFinished` on a store that has changed since, and the samples the lost worker had
  stored reached neither side of the split (8 of 40 left out, exit 0)."""
  unique: dict[str, dict] = {}
  for record in records:
    unique.setdefault(record.get("key"), record)
  keys = {item.key for item in items}
  foreign = [k for k in unique if k not in keys]
  if foreign:  # (their records would be scored and summed as this dataset's)
    from pipelines.datasets import DatasetChangedError
    raise DatasetChangedError(
        f"{path}: {len(foreign)} of the job's records are of examples the launcher did not "
        f"read: its workers read another dataset (a file of the same name where they run?); "
        f"give dataset.path as storage every worker sees at the same path")
  repeated = len(records) - len(unique)
  restored = 0
  missing = [item for item in items if item.key not in unique]
  # Only what the store holds is read (one listing): the items without a record are
  # mostly dead letters, and a remote store took a request or two for each. (None: a
  # store that cannot be listed; every missing item is read.)
  stored = store.keys() if missing else set()
  for item in missing:
    if stored is None or item.key in stored:
      record, _ = stored_record(store, item)
      if record is not None:
        unique[item.key] = record
        restored += 1
  if restored or repeated:
    records = list(unique.values())
    _write_jsonl(records, path, _record_order)
  return records, restored, repeated


def check_every_item_accounted(records: list[dict], dead: list[dict], items: Sequence[WorkItem],
                               path: str) -> None:
  """Every planned sample has a record or a dead letter, else `DatasetChangedError`: a
  cluster's workers that read fewer examples than the launcher (an older copy whose first
  lines are the same) left samples out of the summary, exit 0. (A dead letter without a key,
  a failure no item could be named for, leaves the count unknown: no check.)"""
  if any("key" not in d for d in dead if d.get("stage") != "input"):
    return
  missing = {item.key for item in items} - {r.get("key") for r in records} - {
      d.get("key") for d in dead}
  if missing:
    from pipelines.datasets import DatasetChangedError
    raise DatasetChangedError(
        f"{path}: {len(missing)} planned samples have no record and no dead letter: the "
        f"workers read fewer examples than the launcher (another version of the dataset "
        f"where they run?); give dataset.path as storage every worker sees at the same path")


def write_dead_letters(dead: list[dict], path: str) -> int:
  """dead_letters.jsonl: one line per dead letter, by stage, source, line, example."""
  return _write_jsonl(dead, path, _dead_order)


def _record_order(r: dict):
  return (r["example_index"], r["sample_index"])


def _dead_order(d: dict):
  return (d["stage"], str(d.get("source", "")), d.get("line_number") or 0, str(d.get("example_id", "")),
          d.get("sample_index") or 0, d["reason"])


def build_pipeline(p: beam.Pipeline, plan: EvalPlan, *, clock: Any = time, loader=None,
                   model_tag: str | None = None):
  """Adds the evaluation graph to `p`; returns (records, dead letters) PCollections.

  `clock` (an object with time_ns()) and `loader` (spec → predictor) are injection
  points for tests. `model_tag` names the shared model (RunInference's model_identifier;
  a random one when None): Beam names its cross-process lock and address files after it.
  """
  read = (p
          | "Start" >> beam.Create([None])
          | "ReadDataset" >> beam.ParDo(ReadDataset(plan.task)).with_outputs("dead", main="examples"))
  items = (read.examples
           | "Samples" >> beam.FlatMapTuple(lambda index, ex: work_items(plan, ex, index))
           | "KeyByWork" >> beam.Map(lambda item: (item.key, item))
           | "Spread" >> beam.Reshuffle()
           | "DropKey" >> beam.Values())
  split = items | "SkipFinished" >> beam.ParDo(SkipFinished(plan.store_dir)).with_outputs(
      "finished", main="todo")
  handler = PredictorModelHandler(plan.predictor, plan.batch_size, share_model=plan.share_model,
                                  clock=clock, loader=loader)
  predictions, dlq = (split.todo
                      | "RunInference" >> RunInference(handler, clock=clock, model_identifier=model_tag)
                        .with_exception_handling())
  score = (predictions
           | "ScoreBatches" >> beam.BatchElements(min_batch_size=1, max_batch_size=max(plan.batch_size, 8))
           | "Score" >> beam.ParDo(Score(plan)).with_exception_handling().with_outputs("unscored"))
  score_failures, unscored = score["bad"], score["unscored"]
  scored = score["good"] | "Store" >> beam.ParDo(Store(plan.store_dir))
  records = (split.finished, scored) | "AllRecords" >> beam.Flatten()
  dead = ((read.dead,
           dlq.failed_inferences | "InferenceFailures" >> beam.FlatMap(failure_dead_letters("inference")),
           score_failures | "ScoreFailures" >> beam.FlatMap(failure_dead_letters("scoring")),
           unscored)
          | "AllDeadLetters" >> beam.Flatten())
  out = plan.output_dir.rstrip("/")
  _ = (records
       | "CollectRecords" >> beam.combiners.ToList()
       | "WriteResults" >> beam.Map(_write_jsonl, f"{out}/results.jsonl", _record_order))
  _ = (dead
       | "CollectDeadLetters" >> beam.combiners.ToList()
       | "WriteDeadLetters" >> beam.Map(write_dead_letters, f"{out}/dead_letters.jsonl"))
  return records, dead
