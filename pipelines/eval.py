r"""Batch evaluation as an Apache Beam job: `python -m pipelines.eval`.

  python -m pipelines.eval                                   # embedded default, < 10 min on 2 cores
  python -m pipelines.eval --config=configs/gsm8k.py:policy=self_consistency \
      --config.policy.n=8 --output_dir=runs/sc8
  python -m pipelines.eval --config=configs/humaneval.py:smoke=True --output_dir=runs/he
  python -m pipelines.eval --output_dir=gs://bucket/run -- --runner=DataflowRunner --project=P ...
  python -m pipelines.eval --config.runner.name=dask                   # a dask LocalCluster here
  python -m pipelines.eval --config.runner.name=dask --config.runner.address=tcp://sched:8786 \
      --output_dir=/shared/run                                         # a dask.distributed cluster

Steps: 1. read the config (variants after the colon, `--config.a.b=v` overrides; an
unknown key is an error listing the valid ones) and Beam flags after `--`;
2. build the plan (task, policy, predictor, model fingerprint); 3. check, before any
work, that the output directory and its store can be written, that the model's
checkpoint is sound (header only) and that the dataset exists and holds examples (it
is read once here: the work items drive a progress bar with ETA on stderr, duplicate
lines are reported); 4. run the Beam graph (`pipelines/beam/pipeline.py`): finished
samples are skipped, new ones are stored as they finish, results.jsonl and
dead_letters.jsonl are written at the end; 5. summarize into summary.json; 6. write
report.md and plots (`pipelines/report.py`). Rerunning the same command resumes:
nothing already stored is recomputed.

Output: the progress bar, warnings, the summary and `error: ...` lines (exit code 2,
no traceback) for bad input; exit code 1 when the run scored no sample (every work item
a dead letter: the summary's accuracy is empty, not 0.0) or the sandbox failed for every
program (HumanEval, or a suite category: no verdict); what Beam, absl, JAX and the
worker processes log goes to OUTPUT_DIR/eval.log, or to stderr with --verbose (which also
prints tracebacks).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import os
import pathlib
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import uuid
from typing import IO, Optional, Sequence

if __name__ == "__main__":  # before the imports below (~1.5 s): a Ctrl-C there is one line
  def _stopped_while_starting(signum, frame):
    print(f"stopped by {signal.Signals(signum).name} while starting: nothing was computed",
          file=sys.stderr)
    os._exit(128 + signum)

  for _sig in (signal.SIGINT, signal.SIGTERM):  # (SIGTERM there ended it without a word)
    signal.signal(_sig, _stopped_while_starting)

from absl import app, flags
from ml_collections import config_flags

import configs

DEFAULT_CONFIG = str(pathlib.Path(configs.__file__).parent / "gsm8k.py")
LOG_NAME = "eval.log"  # under the output directory: what the default output leaves out
PARTIAL_LOG_SUFFIX = ".partial"  # the log while the run writes it
_FLAGS: dict = {}


def define_flags() -> None:
  """Defined only when run as a program: ml_collections applies overrides at definition time."""
  _FLAGS["config"] = config_flags.DEFINE_config_file(
      "config", DEFAULT_CONFIG, "evaluation config file[:variants]", lock_config=True)
  _FLAGS["output_dir"] = flags.DEFINE_string("output_dir", "runs/default",
                                             "where results, summary and report go")
  _FLAGS["verbose"] = flags.DEFINE_boolean(
      "verbose", False, f"show what Beam, absl, JAX and the workers log on stderr (by default it "
      f"goes to OUTPUT_DIR/{LOG_NAME}) and the traceback of an error")


def _flags_part(argv: Sequence[str]) -> list[str]:
  """The flags before a `--` (after it: Beam's)."""
  return list(argv[:list(argv).index("--")] if "--" in argv else argv)


def _verbose(argv: Sequence[str]) -> bool:
  """--verbose as absl will parse it, for errors found before absl runs."""
  flags_part = _flags_part(argv)
  on = [a for a in flags_part if a in ("--verbose", "--noverbose") or a.startswith("--verbose=")]
  return bool(on) and on[-1] != "--noverbose" and on[-1].split("=", 1)[-1].lower() not in ("false", "0")


# -- command line -------------------------------------------------------------------

def double_dash_config_flags(argv: Sequence[str]) -> list[str]:
  """`-config...` flags (absl reads one dash as two) spelled `--config...`, so every check
  of the command line sees them (`-config.budget.latency_slo_s=2` ran unchecked)."""
  end = list(argv).index("--") if "--" in argv else len(argv)
  return [("-" + a if i < end and re.match(r"-config($|[.=])", a) else a)
          for i, a in enumerate(argv)]


def _config_path_and_arg(argv: Sequence[str]) -> tuple[str, str]:
  spec = DEFAULT_CONFIG
  for i, a in enumerate(argv):
    if a == "--":
      break
    if a.startswith("--config="):
      spec = a.split("=", 1)[1]
    elif a == "--config" and i + 1 < len(argv):
      spec = argv[i + 1]
  path, _, arg = spec.partition(":")
  return path, arg


def load_config_file(path: str, arg: str = ""):
  """get_config(arg) of a config file, loaded the way ml_collections does.

  A missing file, or one that cannot be executed or has no get_config, is a UsageError
  naming it (the traceback of the file's own error stays behind --verbose).
  """
  import importlib.util
  if not os.path.exists(path):
    raise app.UsageError(f"config file not found: {path}")
  if not os.path.isfile(path):
    raise app.UsageError(f"config file is not a file: {path}")
  module_spec = importlib.util.spec_from_file_location("_o1jax_eval_config", path)
  if module_spec is None or module_spec.loader is None:
    raise app.UsageError(f"--config={path}: not a Python config file")
  module = importlib.util.module_from_spec(module_spec)
  try:
    module_spec.loader.exec_module(module)
  except Exception as e:  # whatever the file raises: SyntaxError, ImportError, ...
    raise app.UsageError(f"config file {path} cannot be loaded: {type(e).__name__}: {e}") from e
  if not callable(getattr(module, "get_config", None)):
    raise app.UsageError(f"config file {path} has no get_config(arg) function")
  try:
    config = module.get_config(arg) if arg else module.get_config()
  except ValueError:  # a bad variant: the file's own message lists the valid ones
    raise
  except Exception as e:  # whatever get_config raises: the traceback stays behind --verbose
    raise app.UsageError(f"config file {path}: get_config({arg!r}) raised "
                         f"{type(e).__name__}: {e}") from e
  import ml_collections
  if not isinstance(config, ml_collections.ConfigDict):  # (None: absl's traceback, exit 1)
    raise app.UsageError(f"config: get_config() must return an ml_collections.ConfigDict, got "
                         f"{type(config).__name__}")
  return config


def check_overrides(config, argv: Sequence[str]) -> None:
  """Every `--config.a.b=v` must name an existing key; otherwise list the valid ones. (A key
  given twice takes its last value, as every absl flag does: a wrapper's defaults, then the
  user's overrides.)"""
  for a in argv:
    if a == "--":
      return
    if not a.startswith("--config."):
      continue
    dotted = a[len("--config."):].split("=", 1)[0]
    node, walked = config, []
    for part in dotted.split("."):
      keys = sorted(node.keys()) if hasattr(node, "keys") else []
      if part not in keys:
        where = ".".join(walked) or "config"
        raise app.UsageError(f"unknown config key {dotted!r}: {where} has keys {keys}")
      node, walked = node[part], walked + [part]


def validate_argv(argv: Sequence[str]) -> None:
  """Config variants and `--config.*` keys, checked before ml_collections sees them; the
  modules of `--config.imports=` are imported first (they may define the variant's policy)."""
  from pipelines.config_imports import ConfigImportError, import_modules, imports_in_argv
  try:
    import_modules(imports_in_argv(argv[1:]))
  except ConfigImportError as e:
    raise app.UsageError(str(e)) from e
  path, arg = _config_path_and_arg(argv)
  try:
    cfg = load_config_file(path, arg)
  except ValueError as e:  # a bad variant: the config file says which keys are valid
    raise app.UsageError(str(e)) from e
  check_overrides(cfg, argv[1:])
  check_override_values(argv)


def _given(flags_part: Sequence[str], section: str) -> list[str]:
  """The keys of `section` the command line sets (`--config.section.key[=...]`)."""
  return [m.group(1) for a in flags_part
          if (m := re.match(rf"--config\.{section}\.(\w+)(?:=|$)", a))]


def _policy_class(config):
  """The config's policy class; None where the name is unknown (build_plan names it,
  with the valid ones)."""
  from o1jax.controller.registry import policy_class
  try:
    return policy_class(config.policy.name)
  except (ValueError, AttributeError):
    return None


def check_unused_overrides(config, argv: Sequence[str]) -> None:
  """A `--config.sampling.max_new_tokens=` for a reasoning-controller policy: its traces
  are bounded by its own token limits, so the value was ignored (and, part of the content
  key, every sample was computed again for nothing); a `--config.budget.*` setting with a
  fixed budget; a policy's own live budget beside the controller's (its SLO unused). A
  ValueError naming what to set."""
  flags_part = _flags_part(argv)
  budget = config.get("budget") or {}
  if budget.get("mode", "fixed") == "fixed":  # (an SLO given with a fixed budget: no effect)
    for key in _given(flags_part, "budget"):
      if key != "mode":
        raise ValueError(f"budget.{key} is not used: budget.mode is fixed; add "
                         f"--config.budget.mode=adaptive")
  policy_cfg = config.get("policy") or {}
  if budget.get("mode") == "adaptive" and policy_cfg.get("adaptive") is True:
    raise ValueError("policy.adaptive=True runs the policy's own budget (policy.latency_slo_s), "
                     "and budget.mode=adaptive gives the controller one that takes its place: "
                     "set one of them")
  if "max_new_tokens" not in _given(flags_part, "sampling"):
    return
  policy = _policy_class(config)
  if policy is not None and policy.controller:
    raise ValueError(
        f"sampling.max_new_tokens={config.sampling.max_new_tokens!r} is not used: policy "
        f"{config.policy.name} bounds each trace by its own max_thinking_tokens and "
        f"max_answer_tokens; set policy.max_thinking_tokens instead")


def unused_override_warnings(config, argv: Sequence[str]) -> list[str]:
  """Settings given on the command line, away from their defaults, that this run does not
  read (the summary showed them as if they had applied): `speculative.*` without
  speculative.enabled, `model.fake_delay_s` for a real model, `controller.*` for a policy
  without the controller, `sampling.top_p/top_k` under greedy decoding (a seed is
  harmless there: sweeps keep one throughout). Warnings, not errors: a sweep passes them
  to every run of a grid (top_p=0.95 at each temperature, 0 included)."""
  from configs import common
  section = lambda name: config.get(name) or {}
  policy = _policy_class(config)
  unread = []  # (section, why its keys are not read, their defaults, the keys concerned)
  if section("speculative").get("enabled") is not True:
    unread.append(("speculative", "speculative.enabled is False",
                   common.speculative_section(), None))
  if section("model").get("predictor") != "fake":
    unread.append(("model", f"model.predictor is {section('model').get('predictor')!r}",
                   common.model_section(), ("fake_delay_s",)))
  if policy is not None and not policy.controller:
    unread.append(("controller", f"policy {config.policy.name} does not run the reasoning "
                   f"controller", common.controller_section(), None))
  if (policy is not None and "temperature" not in policy.own_sampling
      and section("sampling").get("temperature") == 0):
    unread.append(("sampling", "sampling.temperature is 0 (greedy decoding)",
                   common.sampling_section(1), ("top_p", "top_k")))
  flags_part = _flags_part(argv)
  return [f"{name}.{key} is not used: {why}"
          for name, why, defaults, keys in unread for key in _given(flags_part, name)
          if (keys is None or key in keys) and key in defaults
          and section(name).get(key) != defaults[key]]


def check_override_values(argv: Sequence[str]) -> None:
  """Parses the `--config*` flags as ml_collections will, on flags of their own: a value of
  the wrong type (`--config.sampling.top_k=abc`) or an override before `--config=` is a
  UsageError naming the flag, not absl's `FATAL Flags parsing error` with exit code 1."""
  flags_part = _flags_part(argv)
  trial = flags.FlagValues()
  config_flags.DEFINE_config_file("config", DEFAULT_CONFIG, "", flag_values=trial,
                                  lock_config=True, sys_argv=flags_part)
  try:
    trial(flags_part, known_only=True)  # the other flags are absl's to check
  except flags.Error as e:
    raise app.UsageError(str(e).splitlines()[0]) from e


# -- progress -----------------------------------------------------------------------

class Progress:
  """tqdm bar fed by counting the plan's keys in the local store (works across worker processes)."""

  drawn = False  # a bar is on the terminal (a stop's message goes on a line of its own)

  def __init__(self, store, keys: set[str], interval_s: float = 1.0, file: Optional[IO[str]] = None):
    self.store, self.keys, self.interval_s = store, keys, interval_s
    self.file = file
    self._stop = threading.Event()
    self._thread: Optional[threading.Thread] = None

  def done(self) -> int:
    return len(self.keys & self.store.keys())

  def __enter__(self):
    from tqdm import tqdm
    self.bar = tqdm(total=len(self.keys), initial=self.done(), unit="sample", file=self.file or sys.stderr,
                    desc="eval", dynamic_ncols=True, miniters=1, mininterval=1.0)
    Progress.drawn = True
    self._thread = threading.Thread(target=self._run, daemon=True)
    self._thread.start()
    return self

  def _run(self):
    while not self._stop.wait(self.interval_s):
      done = self.done()
      if done != self.bar.n:
        self.bar.update(done - self.bar.n)

  def __exit__(self, *exc):
    self._stop.set()
    if self._thread:
      self._thread.join()
    self.bar.update(self.done() - self.bar.n)
    self.bar.close()
    Progress.drawn = False
    return False


# -- the run ------------------------------------------------------------------------

def _read_jsonl(path: str) -> list[dict]:
  from pipelines.datasets.jsonl import open_binary
  out = []
  with open_binary(path) as f:
    # JSON Lines ends records at "\n" only: str.splitlines() also splits at U+2028, U+2029
    # and U+0085, which the records hold raw (ensure_ascii=False) in a model's text.
    for line in f.read().decode("utf-8").split("\n"):
      if line.strip():
        out.append(json.loads(line))
  return out


def run(config, output_dir: str, beam_flags: Sequence[str] = (), *, clock=time, loader=None,
        progress: Optional[bool] = None, report: bool = True, console: Optional[IO[str]] = None,
        n_given: bool = False) -> dict:
  """Runs the whole evaluation; returns summary.json's content.

  Before any work it checks, in this order, and raises a ValueError subclass with a
  one-line message naming the file or directory: the config (`build_plan`), the output
  directory and its store (`OutputError`: not writable), the model (`CheckpointError`),
  the dataset (`DatasetError`: missing, unreadable, no examples); another run holding
  the output directory is an `OutputError` too (`lock_output_dir`). Once work started, a
  store record or result file that cannot be written stops the run with a `WriteError`
  naming it (what was stored stays valid for the rerun). Damaged store files are named in
  warnings and recomputed. `clock` and `loader` are passed to the pipeline (tests inject
  fakes); `console` gets the progress bar and warnings (default stderr). `n_given`: the
  command line set dataset.n (a dataset holding fewer examples is then said).
  """
  from pipelines.beam import ResultStore, build_plan, pipeline_options
  from pipelines.beam.pipeline import check_engine_pool
  from pipelines.beam.options import runs_here
  from pipelines.beam.store import check_writable, is_local

  console = console or sys.stderr
  if not str(output_dir).strip():
    from pipelines.beam.store import OutputError
    raise OutputError("--output_dir is empty: name the directory for the results")
  if str(output_dir) != str(output_dir).strip():
    from pipelines.beam.store import OutputError
    # (a shell quote that took a space along: a directory whose name ends in it)
    raise OutputError(f"--output_dir={str(output_dir)!r} starts or ends with white space: "
                      f"name the directory without it")
  # A file:// URL is the local path (Beam's file systems know no "file" scheme: the run
  # computed every sample, then could not read its own results back).
  output_dir = str(output_dir).removeprefix("file://")
  config = _with_flag_runner(config, beam_flags)
  plan = _absolute_local_paths(build_plan(config, output_dir))  # imports the config's modules first
  options = pipeline_options(config.runner, beam_flags, plan.imports)
  direct = runs_here(options)  # the DirectRunner, or a dask LocalCluster started here
  local = is_local(output_dir) and direct
  out = output_dir.rstrip("/")
  if is_local(out):
    _check_dataset_is_not_a_result(plan, out)
    _check_results_are_runs(out)
  # Found now, not after every sample was computed: results go here, each sample to the store.
  check_writable(out)
  lock = lock_output_dir(out) if is_local(out) else None  # one run at a time in a directory
  try:
    _check_same_task(out, plan.task.name, console)
    store = ResultStore(plan.store_dir)
    store.check_writable()
    model = _check_model(plan, direct)  # (config, tokenizer loader) where it is here
    data_state = _dataset_state(plan)  # (before the launcher's read of the files)
    scan = _scan(plan, out, console, n_given)
    scan.data_state = data_state
    check_engine_pool(plan, scan.items, model)
    _check_chat(plan, scan.items, model)
    return _run_locked(config, plan, options, scan, store, out, beam_flags, local=local,
                       direct=direct, clock=clock, loader=loader, progress=progress,
                       report=report, console=console)
  finally:
    if lock is not None:
      os.close(lock)


# The shared-model tags and the Dask jobs running in this process: a stopping signal
# removes those files and releases those jobs too (the process ends with os._exit, past
# the `finally` and the result's close that would).
_RUNNING_MODEL_TAGS: set[str] = set()
_RUNNING_DASK_JOBS: set = set()


def remove_shared_model_files(model_tag: str) -> None:
  """`handler.remove_shared_model_files` for a job of this process (once it is over)."""
  from pipelines.beam.handler import remove_shared_model_files as remove
  _RUNNING_MODEL_TAGS.discard(model_tag)
  remove(model_tag)


def _absolute_local_paths(plan):
  """The plan with a local dataset.path and output directory given relative to the
  launcher's directory made absolute: a cluster's workers resolved them from their own
  (each read another file of that name, or none, and wrote the results there). The
  config (and summary.json's copy) keeps the names as given; messages and dead letters
  name the absolute path. A task that is not a dataclass keeps its path as given."""
  from pipelines.beam.store import is_local
  # Joined, not normalized: "link/../data.jsonl" names what the OS resolves (abspath's
  # lexical ".." dropped the link and named another file).
  def absolute(p: str) -> str:
    if not p or not is_local(p):
      return p
    p = p.removeprefix("file://")
    return p if os.path.isabs(p) else os.path.join(os.getcwd(), p)
  dataset = getattr(plan.task, "dataset", None)
  if isinstance(dataset, dict) and dataset.get("path") and dataclasses.is_dataclass(plan.task):
    path = str(dataset["path"])
    if absolute(path) != path:
      moved = copy.copy(dataset)  # (a ConfigSection keeps its name)
      moved["path"] = absolute(path)
      plan = dataclasses.replace(plan, task=dataclasses.replace(plan.task, dataset=moved))
  return dataclasses.replace(plan, output_dir=absolute(plan.output_dir))


def _with_flag_runner(config, beam_flags: Sequence[str]):
  """The config with runner.name set to a `--runner=` given after `--` (the runner the job
  runs on): the summary's config named the config's runner (DirectRunner for a run on
  dask). The caller's config is not changed."""
  from pipelines.beam.options import runner_flag, runner_name
  flag = runner_flag(beam_flags)
  if flag is None or runner_name(flag, "--runner") == runner_name(config.runner.name):
    return config
  config = config.copy_and_resolve_references()
  config.runner.name = flag
  return config


def release_dask_jobs(timeout_s: float = 20.0) -> None:
  """Releases the Dask jobs this process runs: their DoFns (and models) are torn down in
  the workers of a long-lived cluster (a stopped launcher left them there for good), and
  the process's exit then drops their tasks. One message per job, no cancel round trip."""
  jobs = list(_RUNNING_DASK_JOBS)
  _RUNNING_DASK_JOBS.clear()
  if jobs:
    thread = threading.Thread(target=lambda: [job.release() for job in jobs], daemon=True)
    thread.start()
    thread.join(timeout_s)  # (a scheduler that does not answer: the workers keep them)


def _dataset_state(plan) -> list[tuple]:
  """(path, sha256) of each local dataset file the task reads (none for generated data or
  remote files): the launcher reads the dataset, and the job's workers read it again, so a
  file changed between the two reads mixed two datasets in one run. By content (a file
  only touched, by rsync -a, a checkout or a sync client, is the same dataset), through
  the digests the model fingerprint keeps (`predictors.content_digest`)."""
  path = (getattr(plan.task, "dataset", None) or {}).get("path")
  if not path or getattr(plan.task, "source", None) != path:
    return []
  from pipelines.datasets.jsonl import dataset_files
  from pipelines.predictors import content_digest
  try:
    return [(local, content_digest(local)) for local in
            (name.removeprefix("file://") for name in dataset_files(path))
            if os.path.isfile(local)]
  except Exception:  # noqa: BLE001 - (the scan names an unreadable dataset itself)
    return []


def _scan(plan, out: str, console, n_given: bool = False):
  """The dataset read once here: `DatasetError` for a missing, unreadable or example-less
  file; a warning per file with duplicate lines, and one for a dataset.n given on the
  command line past the dataset's examples (not for a config's own n: smoke's 8 is a cap)."""
  from pipelines.beam.pipeline import scan_dataset
  scan = scan_dataset(plan)  # DatasetError: missing or unreadable file
  if not scan.examples:
    raise _no_examples(plan, scan, out)
  n = int((getattr(plan.task, "dataset", None) or {}).get("n") or 0) if n_given else 0
  if scan.examples < n:  # (a run asked for 500 scored a file's 100 without a word)
    print(f"warning: dataset.n={n}: {plan.task.source} holds {scan.examples} examples"
          f"{f' and {len(scan.dead)} bad records' if scan.dead else ''}; all are scored",
          file=console)
  for source, count in sorted(scan.duplicates.items()):
    print(f"warning: {source}: {count} duplicate line{'s' if count > 1 else ''} skipped "
          f"(the first line of each example is kept)", file=console)
  for line in plan.task.warnings(plan.sampling) if hasattr(plan.task, "warnings") else ():
    print(f"warning: {line}", file=console)
  return scan


def _run_locked(config, plan, options, scan, store, out: str, beam_flags, *, local: bool,
                direct: bool, clock, loader, progress, report: bool, console) -> dict:
  """`run` once the output directory is this run's: the job, then summary and report."""
  import apache_beam as beam

  from pipelines.beam import build_pipeline
  from pipelines.beam.pipeline import (check_every_item_accounted, reconcile_with_store,
                                       sized_for, stored_record, write_text)
  from pipelines.beam.store import IS_A_DIRECTORY, OutputError, is_local
  from pipelines.beam.worker import mark_launcher
  from pipelines.datasets.records import examples_sha256
  from pipelines.summary import summarize

  output_dir = out
  keys = {i.key for i in scan.items}
  resumed_before = None
  if local:  # what the job will resume: the valid records; damaged files are named now
    store.remove_temporary_files()  # (left by workers killed mid-write; this run holds `out`)
    stored, damaged, resumed_before = store.keys(), [], 0
    for item in scan.items:
      if item.key in stored:
        record, problem = stored_record(store, item)
        resumed_before += record is not None
        if problem == IS_A_DIRECTORY:  # a rerun would compute it, then fail to store it
          raise OutputError(f"store record {store.path(item.key)} is a directory: the run "
                            f"stores that sample there; remove the directory and rerun")
        if problem:
          damaged.append(f"{store.path(item.key)} {problem}")
    for line in damaged[:MAX_DAMAGED_SHOWN]:
      print(f"warning: store record {line}; it is recomputed", file=console)
    if len(damaged) > MAX_DAMAGED_SHOWN:
      print(f"warning: {len(damaged) - MAX_DAMAGED_SHOWN} more damaged store records under "
            f"{plan.store_dir} are recomputed", file=console)
  earlier = _earlier_throughput(out) if is_local(out) else None  # (before it is cleared)
  if is_local(out):  # after the checks above: a refused run leaves the earlier results
    clear_previous_results(config, out, console)
  show = config.runner.progress if progress is None else progress
  started_ms = clock.time_ns() / 1e6
  t0 = time.perf_counter()
  if direct:
    mark_launcher()  # local worker processes watch this process and exit with it
  pipeline = beam.Pipeline(options=options)
  plan = sized_for(plan, scan.items)  # the engine's KV pool holds the longest sequences
  # Beam keeps a lock and an address file per shared model in the temp directory; a
  # run here removes its own afterwards (a remote worker's temp directory is its own).
  model_tag = f"o1jax-{uuid.uuid4().hex}"
  if direct:
    _RUNNING_MODEL_TAGS.add(model_tag)
  build_pipeline(pipeline, plan, clock=clock, loader=loader, model_tag=model_tag)
  def run_job():
    result = pipeline.run()
    if hasattr(result, "model_tags"):  # a Dask job: its workers remove the files at its end
      result.model_tags = (model_tag,)
      _RUNNING_DASK_JOBS.add(result)
    try:
      result.wait_until_finish()
    finally:
      _RUNNING_DASK_JOBS.discard(result)

  try:
    if local and show:
      with Progress(store, keys, file=console):
        run_job()
    else:
      run_job()
  except Exception as e:  # a file that cannot be written, a model no worker loads: one line
    from pipelines.beam.options import SchedulerUnreachableError
    if isinstance(e, SchedulerUnreachableError):  # (its cause's lost connection: none was made)
      raise
    error = worker_error(e) or runner_start_error(e, options) or worker_lost_error(e)
    if error is None:
      raise
    raise error from e
  finally:
    if direct:
      remove_shared_model_files(model_tag)
  wall_s = time.perf_counter() - t0
  now = _dataset_state(plan)
  if now != scan.data_state:
    from pipelines.datasets import DatasetChangedError
    remove_result_files(out)  # (the job's results.jsonl held the old version's records)
    changed = [a[0] for a in now if a not in scan.data_state] or [plan.task.source]
    raise DatasetChangedError(f"dataset file {changed[0]} changed while the job ran (the "
                              f"launcher and the workers read different versions of it): "
                              f"rerun; every sample computed is in the store")

  if is_local(out) and not os.path.exists(f"{out.removeprefix('file://')}/results.jsonl"):
    # (the workers wrote it where `out` leads from their working directory or machine: a
    # relative path on a cluster's workers; it read "dataset file not found")
    raise OutputError(f"{out}/results.jsonl is not here after the job: its workers wrote "
                      f"their output elsewhere; output_dir must be storage the launcher and "
                      f"every worker see at the same path (an absolute path, or gs://...)")
  records, restored, repeated = reconcile_with_store(
      _read_jsonl(f"{out}/results.jsonl"), scan.items, store, f"{out}/results.jsonl")
  if restored or repeated:
    print(f"warning: results.jsonl: the job's output missed {restored} stored "
          f"record{'s' * (restored != 1)} and listed {repeated} twice (a worker lost and its "
          f"work recomputed?); rewritten from the store", file=console)
  dead = _read_jsonl(f"{out}/dead_letters.jsonl")
  check_every_item_accounted(records, dead, scan.items, f"{out}/results.jsonl")
  run_info = {"started_ms": started_ms, "wall_s": round(wall_s, 2),
              "resumed": resumed_before, "computed": (len(records) - resumed_before)
              if resumed_before is not None else None,
              "duplicate_lines_skipped": sum(scan.duplicates.values()),
              "beam_args": pipeline_args_for_summary(config, beam_flags, plan.imports)}
  summary = summarize(records, dead, task=plan.task.name, vote=plan.policy.vote, run=run_info,
                      config=config.to_dict())
  summary["model"] = plan.model_fp
  # (what runs compare within: pipelines.report.comparison_groups)
  summary["data_sha256"] = examples_sha256(i.example for i in scan.items if i.sample_index == 0)
  if hasattr(plan.task, "data_info"):  # generated data: which items, by content hash
    summary["data"] = plan.task.data_info()
  # Strict JSON (Python writes Infinity, which jq and JavaScript refuse): a config's inf
  # is the string "inf" (clear_previous_results compares configs so written).
  from pipelines.beam.store import strict_json
  written = strict_json(json.loads(json.dumps(summary, default=list)), named=True)
  if (not written["throughput"]["samples_computed"] and earlier is not None
      and earlier[0] == (written["data_sha256"], written["samples"], written["config"])):
    # A rerun of the same config that computed nothing (every sample resumed) keeps the
    # throughput of the run that computed them: its rewrite of summary.json erased it (n/a
    # seconds in reports). (Another config's measurement is not this config's.)
    summary["throughput"] = written["throughput"] = earlier[1]
  write_text(f"{out}/summary.json", json.dumps(written, indent=2, allow_nan=False) + "\n")
  if report and is_local(output_dir):
    from pipelines.beam.store import WriteError, os_reason
    from pipelines.report import write_run_report
    try:
      write_run_report(output_dir)
    except OSError as e:
      raise WriteError(f"cannot write {e.filename or output_dir + '/report.md'}: {os_reason(e)}") from e
  return summary


MAX_DAMAGED_SHOWN = 5  # damaged store records named one per warning line; the rest counted
LOCK_NAME = ".o1jax-eval.lock"
# What a finished run writes next to the store: all made from the store's records.
RESULT_FILES = ("results.jsonl", "dead_letters.jsonl", "summary.json", "report.md",
                "latency_histogram.png", "latency_heatmap.png", "reasoning.png",
                "suite_latency_heatmap.png")  # (pipelines.suite.report.HEATMAP_FILE)


# What a run writes in its output directory (a store record stands for every one).
OUTPUT_NAMES = (*RESULT_FILES, LOG_NAME, LOG_NAME + PARTIAL_LOG_SUFFIX, LOCK_NAME,
                f"store/{'0' * 64}.json")


def _check_dataset_is_not_a_result(plan, out: str) -> None:
  """A dataset file (or pattern) in the output directory that is (or could match) a file
  the run writes there is refused: the run deleted a results.jsonl given as its dataset
  before reading it, and a pattern such as OUT/*.jsonl read the run's own dead letters."""
  import fnmatch

  from pipelines.beam.store import is_local
  from pipelines.datasets import DatasetError
  from pipelines.datasets.jsonl import _literal_dirs_escaped, dataset_files
  path = (getattr(plan.task, "dataset", None) or {}).get("path")
  if not path or getattr(plan.task, "source", None) != path or not is_local(path):
    return
  path = os.path.abspath(path.removeprefix("file://"))
  try:
    files = [os.path.realpath(f) for f in dataset_files(path)]
  except DatasetError:
    files = []
  # The pattern as `dataset_files` reads it (directories that exist are literal: runs[1]/),
  # as written and through links, against the run's files through links too.
  patterns = {_literal_dirs_escaped(path), _literal_dirs_escaped(path, resolve=True)}
  outs = {os.path.abspath(out), os.path.realpath(out)}
  for name in OUTPUT_NAMES:
    ours = os.path.join(os.path.realpath(out), name)
    if ours in files or any(fnmatch.fnmatchcase(os.path.join(o, name), p)
                            for o in outs for p in patterns):
      raise DatasetError(f"dataset.path={path} {'matches' if ours not in files else 'is'} "
                         f"this run's {name} in --output_dir {out}: the run writes (and "
                         f"replaces) it; keep the dataset out of the output directory")


def _earlier_throughput(out: str) -> Optional[tuple[tuple, dict]]:
  """((data_sha256, samples, config), throughput) of the summary.json in `out` where its
  run computed samples, its throughput marked with the run's start
  (`measured_in_run_started_ms`); None otherwise."""
  try:
    summary = json.loads(pathlib.Path(out, "summary.json").read_text(encoding="utf-8"))
    thr, started = summary["throughput"], summary["run"].get("started_ms")
    thr = {**thr, "measured_in_run_started_ms": thr.get("measured_in_run_started_ms", started)}
    if isinstance(thr["samples_computed"], int) and thr["samples_computed"] > 0:
      return (summary.get("data_sha256"), summary.get("samples"), summary.get("config")), thr
  except (OSError, ValueError, RecursionError, TypeError, KeyError, AttributeError):
    pass  # (none, or unreadable: _check_same_task says so)
  return None


def _check_results_are_runs(out: str) -> None:
  """Result files in a directory no run has used are the user's: refused rather than
  replaced (a run deleted a report.md of notes, a summary.json, the dataset it was given).
  A run's directory has its run lock (every run makes one before it writes), its store,
  or a run's summary.json (a copy made with `cp -r run/* other/` has no lock)."""
  from pipelines.beam.store import OutputError
  if os.path.lexists(f"{out}/{LOCK_NAME}") or os.path.isdir(f"{out}/store"):
    return
  try:
    summary = json.loads(pathlib.Path(out, "summary.json").read_text())
    if isinstance(summary, dict) and {"task", "config", "run"} <= set(summary):
      return
  except (OSError, ValueError):
    pass
  found = [n for n in RESULT_FILES if os.path.lexists(f"{out}/{n}")]
  if found:
    raise OutputError(f"--output_dir {out} holds {', '.join(found)}, which no run wrote (it has "
                      f"no {LOCK_NAME}): a run replaces these files; give it another "
                      f"--output_dir")


def _check_same_task(out: str, task: str, console) -> None:
  """An output directory holding another task's run (every config defaults to
  runs/default: a suite run replaced the default GSM8K run's results.jsonl, summary.json
  and report.md) is refused; the same task's resumes there (its store serves it). A
  summary.json that cannot be read is said (the check passed over it without a word)."""
  from pipelines.beam.store import OutputError, is_local
  if not is_local(out):
    return
  path = pathlib.Path(out, "summary.json")
  try:
    summary = json.loads(path.read_text(encoding="utf-8"))
  except FileNotFoundError:  # none yet
    return
  except (OSError, ValueError, RecursionError) as e:
    summary = e
  if not isinstance(summary, dict):
    why = (f"{type(summary).__name__}: {summary}" if isinstance(summary, Exception)
           else f"a JSON {type(summary).__name__}, not an object")
    print(f"warning: {path} cannot be read ({why}): which run it held is not known; this "
          f"run replaces it", file=console)
    return
  held = summary.get("task")
  if isinstance(held, str) and held != task:
    raise OutputError(f"{out} holds a {held} run (summary.json): give this {task} run its own "
                      f"--output_dir")


def lock_output_dir(out: str) -> int:
  """An exclusive lock on OUT/.o1jax-eval.lock (flock: released when the process ends,
  also by kill -9); returns its fd. A second run on the same directory would overwrite
  this run's results.jsonl and summarize the other's: `OutputError` naming the directory
  and the holder's pid."""
  import fcntl

  from pipelines.beam.store import OutputError, os_reason
  path = f"{out.removeprefix('file://')}/{LOCK_NAME}"
  try:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  except IsADirectoryError as e:
    raise OutputError(f"the run lock {path} is a directory: remove it (the run creates "
                      f"the file)") from e
  except OSError as e:
    raise OutputError(f"output directory is not writable: {out} ({os_reason(e)})") from e
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError:
    holder = os.read(fd, 32).decode("ascii", "replace").strip() or "?"
    os.close(fd)
    raise OutputError(f"output directory {out} is in use by another run (pid {holder}): wait "
                      f"for it to end or use another --output_dir") from None
  os.ftruncate(fd, 0)
  os.write(fd, f"{os.getpid()}\n".encode())
  return fd


def lock_held_elsewhere(directory: str) -> bool:
  """Whether another process holds `directory`'s run lock now (a probe: taken and let go)."""
  import fcntl
  try:
    fd = os.open(os.path.join(directory, LOCK_NAME), os.O_RDWR)
  except OSError:
    return False  # no lock file (or none readable): no run has held this directory
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return False
  except OSError:
    return True
  finally:
    os.close(fd)  # closing lets go of a lock taken here


def _config_differences(old, new, prefix: str = "") -> list[str]:
  if isinstance(old, dict) and isinstance(new, dict):
    out = []
    for k in sorted(set(old) | set(new), key=str):
      out += _config_differences(old.get(k), new.get(k), f"{prefix}{k}.")
    return out
  return [] if old == new else [prefix.rstrip(".")]


def clear_previous_results(config, out: str, console) -> None:
  """Removes the result files of an earlier run in `out` before the job starts (the store
  keeps every record they were made from), so a run that fails or is killed never leaves
  another run's results looking like its own. If the earlier run had another config, a
  warning names the keys that differ (runner settings aside)."""
  local = out.removeprefix("file://")
  try:
    with open(f"{local}/summary.json", "rb") as f:
      old = json.loads(f.read()).get("config")
  except (OSError, ValueError, AttributeError):
    old = None
  if isinstance(old, dict):
    from pipelines.beam.store import strict_json
    new = strict_json(json.loads(json.dumps(config.to_dict(), default=list)), named=True)
    old = strict_json(old, named=True)  # (a summary written before 2026-12-07 holds Infinity)
    diff = [k for k in _config_differences(old, new) if not k.startswith("runner.")]
    if diff:
      shown = ", ".join(diff[:3]) + (f" and {len(diff) - 3} more" if len(diff) > 3 else "")
      print(f"warning: {out}/summary.json is from a run with another config ({shown}); "
            f"this run replaces its results (their records stay in the store)", file=console)
  remove_result_files(out)


def remove_result_files(out: str) -> None:
  """RESULT_FILES out of a local `out` (OutputError naming one that cannot go), and the
  temporary files of their writes that never finished (`write_whole`'s
  NAME.PID.XXXXXXXX.tmp: a launcher killed mid-write)."""
  from pipelines.beam.store import TEMPORARY_SUFFIX
  local = out.removeprefix("file://")
  try:
    entries = os.listdir(local)
  except OSError:
    entries = []
  temporary = re.compile(f"(?:{'|'.join(map(re.escape, RESULT_FILES))}){TEMPORARY_SUFFIX}")
  for name in entries:
    if temporary.fullmatch(name):
      try:
        os.remove(f"{local}/{name}")
      except OSError:
        pass
  for name in RESULT_FILES:
    try:
      os.remove(f"{local}/{name}")
    except FileNotFoundError:
      pass
    except OSError as e:
      from pipelines.beam.store import OutputError, os_reason
      raise OutputError(f"cannot remove the earlier run's {out}/{name}: {os_reason(e)}") from e


def _chain(e: BaseException | None):
  """e, then its cause or context, and so on (each once)."""
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    yield e
    e = e.__cause__ or e.__context__


def worker_error(e: BaseException):
  """The `WriteError` or `ModelLoadError` behind a failed job (its chain, or the runner's
  text of a worker's exception: `... WriteError: cannot write PATH: REASON [while running
  'Store']`), or None."""
  from pipelines.beam.handler import ModelLoadError
  from pipelines.beam.store import WriteError
  kinds = {"WriteError": WriteError, "ModelLoadError": ModelLoadError}
  strip = lambda text: re.sub(r"( \[while running '[^']*'\])+$", "", text)
  for link in _chain(e):
    if isinstance(link, tuple(kinds.values())):
      return type(link)(strip(str(link).strip().splitlines()[0]))
    found = re.search(r"\b(WriteError|ModelLoadError): (.+)$", str(link), re.M)
    if found:  # raised in a worker process: the runner passes its text on
      return kinds[found.group(1)](strip(found.group(2)))
  return None


class WorkerLostError(RuntimeError):
  """A worker process of the job ended in the middle of it (killed: the out-of-memory killer,
  a signal); what was stored stays, and a rerun resumes."""


# What the runner says when a worker process is gone (Beam's DirectRunner in
# multi_processing mode: its data channel to the worker closes).
_WORKER_LOST = re.compile(r"Channel closed prematurely|SDK harness .*(?:exited|failed|died)")


def _raised_in_multiprocessing(e: BaseException) -> bool:
  """Whether `e` was raised inside the standard library's multiprocessing (its innermost
  frame's module: a manager proxy's connection)."""
  tb, last = e.__traceback__, None
  while tb is not None:
    last, tb = tb.tb_frame.f_code.co_filename, tb.tb_next
  return last is not None and f"multiprocessing{os.sep}" in last


def worker_lost_error(e: BaseException):
  """A `WorkerLostError` when the job failed because a worker process went away, else None
  (it was Beam's traceback of ~80 lines on the console)."""
  for link in _chain(e):
    kind = type(link).__name__  # (distributed's exceptions, by name: no import of dask here)
    if kind == "CommClosedError" or (kind == "FutureCancelledError"
                                     and "scheduler-connection-lost" in str(link)):
      return WorkerLostError(
          "the dask scheduler's connection was lost during the run; the finished samples are "
          "stored: rerun the same command to resume once a scheduler runs")
    if kind == "KilledWorker":  # a task whose workers died running it more than allowed
      return WorkerLostError(
          "dask gave up on a task whose worker processes died while running it (killed, or "
          "out of memory?); the finished samples are stored: rerun the same command to resume")
    found = _WORKER_LOST.search(str(link))
    # A worker whose shared-model proxy lost the process serving the model (Dask with
    # runner.share_model: the worker that served it was killed) reads EOF from the proxy's
    # connection; an EOF from anywhere else (a cut-short dataset or pickle) is no lost worker.
    why = (found.group(0) if found else "the process serving the shared model"
           if isinstance(link, (EOFError, ConnectionResetError, BrokenPipeError))
           and _raised_in_multiprocessing(link) else None)
    if why:
      return WorkerLostError(
          f"a worker process ended during the run ({why}: killed, or out of "
          f"memory?); the finished samples are stored: rerun the same command to resume")
  return None


def runner_start_error(e: BaseException, options):
  """A ValueError naming the runner when the job failed because its runner could not start
  (Flink, Spark, Prism: Beam fetches a job server jar or binary at run time, and a machine
  that cannot reach it fails there, before any work), else None."""
  from apache_beam.options.pipeline_options import StandardOptions
  for link in _chain(e):
    text = str(link).strip()
    if re.match(r"Unable to fetch remote (job server jar|prism binary)", text):
      runner = options.view_as(StandardOptions).runner
      return ValueError(f"runner {runner} could not start its job server: "
                        f"{text.splitlines()[0]}")
  return None


def _check_model(plan, direct: bool):
  """The checkpoints' headers (the model's, a draft model's, which must share its
  vocabulary), checked here rather than failing in every worker. Other runners load them
  on their own machines (a container image): a local copy, if any, is checked. Returns
  the model's (config, tokenizer loader, cached) where it was checked here, else None."""
  from o1jax.checkpoint import check_checkpoint
  from pipelines.predictors import model_sources
  sources = model_sources(plan.predictor)
  if sources and not str(sources[0]).strip():  # "" would be read as the current directory
    raise ValueError("model.source is empty: name a checkpoint (a .gguf file, an HF or orbax "
                     "directory) or 'embedded'")
  configs = {}
  for i, source in enumerate(sources):
    if direct or os.path.exists(source):
      try:
        configs[source] = check_checkpoint(source)
      except ValueError as e:  # the draft's own file names its key (the model's is the one)
        if i == 0:
          raise
        raise type(e)(f"speculative.draft_source: {e}") from e
  tp = int(dict(getattr(plan.predictor, "engine", None) or {}).get("tensor_parallel", 1) or 1)
  if tp > 1:  # (else each worker found it at load, the job started)
    from o1jax.sharding.tensor_parallel import check_heads_split
    for source, config in configs.items():
      try:
        check_heads_split(config, tp)
      except ValueError as e:
        raise type(e)(f"engine.tensor_parallel={tp}: "
                      + (f"speculative.draft_source: {e}" if source != sources[0] else str(e))
                      ) from e
  speculative = plan.predictor.speculative_config() if sources else None
  if speculative is not None and speculative.drafter == "early_exit" and sources[0] in configs:
    # (else a worker loaded the whole model first, then said so)
    speculative.resolved_exit_layer(configs[sources[0]].n_layers)
  if len(sources) == 2 and set(sources) <= configs.keys():
    from o1jax.engine.speculative import check_draft_vocabulary
    model, draft = sources
    try:
      check_draft_vocabulary(configs[model], configs[draft])
    except ValueError as e:
      raise ValueError(f"speculative.draft_source={draft}: {e}") from e
  if not sources or sources[0] not in configs:
    return None
  from o1jax.checkpoint import load_tokenizer
  return configs[sources[0]], functools.cache(lambda: load_tokenizer(sources[0]))


def _check_chat(plan, items, model) -> None:
  """Chat prompts for a checkpoint that cannot render them (a base model such as Gemma 3
  270M: no template, no ChatML tokens): every sample failed in the workers and the run
  ended with none scored. Named here, with the settings that give text prompts.
  model: `_check_model`'s (config, tokenizer loader), or None (not on this machine)."""
  if model is None or not any(isinstance(item.prompt, list) for item in items):
    return
  why = model[1]().chat_unavailable()
  if why is not None:
    raise ValueError(f"model.source={plan.predictor.source}: {why}, and this job's prompts "
                     f"are chat messages: give a text prompt style (prompt.style=fewshot for gsm8k, "
                     f"completion for humaneval and custom, prompt.code_style=completion for "
                     f"the suite's code; its other categories need a chat model)")


def _no_examples(plan, scan, out: str) -> ValueError:
  """The error for a dataset without a single usable example (nothing would be measured)."""
  from pipelines.beam.pipeline import input_dead_letter, write_dead_letters
  from pipelines.datasets import DatasetError
  source = plan.task.source
  is_file = source == plan.task.dataset.get("path")
  if not scan.dead:
    if is_file:
      from pipelines.datasets.jsonl import dataset_files
      files = dataset_files(source)
      if files != [source]:  # a pattern: the files it matched, which hold nothing
        shown = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
        return DatasetError(f"dataset files matching {source} are empty: {shown}")
      return DatasetError(f"dataset file is empty: {source}")
    return DatasetError(f"dataset {source} has no examples (see dataset.n and dataset.levels)")
  # Every line is bad: the dead letters say why, line by line.
  write_dead_letters([input_dead_letter(d) for d in scan.dead], f"{out}/dead_letters.jsonl")
  first, n = scan.dead[0], len(scan.dead)
  lines = "its only line is" if n == 1 else f"all {n} lines are"
  return DatasetError(f"no usable examples in dataset file {source}: {lines} malformed "
                      f"(line {first.line_number}: {first.reason}); each line's reason is in "
                      f"{out}/dead_letters.jsonl")


def pipeline_args_for_summary(config, beam_flags: Sequence[str],
                              plugins: Sequence[str] = ()) -> list[str]:
  from pipelines.beam.options import beam_args
  return beam_args(config.runner, beam_flags, plugins)


class _LogFile:
  """Default output: fd 2, which Beam, absl, JAX, Python warnings and the worker processes
  (they inherit it) all write to, goes to a log file; `console` keeps the terminal for the
  progress bar, warnings and errors. `close` puts fd 2 back and keeps the log at a path.

  The log is written beside `path` (OUTPUT_DIR/eval.log.partial, so a run killed with
  kill -9 leaves it there) when that can be created, and `close` puts it at `move_to`;
  otherwise (an object store, a directory that cannot be written: the run will say so) a
  temporary file. A run refused for bad input deletes its own log only: the previous
  run's eval.log stays.
  """

  def __init__(self, path: Optional[str] = None):
    sys.stderr.flush()
    self._saved = os.dup(2)
    self.path = None
    log_fd = None
    if path and not lock_held_elsewhere(os.path.dirname(os.path.abspath(path))):
      try:  # (a run that holds the directory writes its log there: left alone)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        log_fd = self._own_partial_log(path + PARTIAL_LOG_SUFFIX)
        self.path = path + PARTIAL_LOG_SUFFIX if log_fd is not None else None
      except OSError:
        pass
    if self.path is None:
      fd, self.path = tempfile.mkstemp(prefix="o1jax-eval-", suffix=".log")
      os.close(fd)
      log_fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
    # O_APPEND: the processes' lines never overwrite each other. fd 2 (and the worker
    # processes that inherit it) keeps the partial log's lock until the log is closed.
    os.dup2(log_fd, 2)
    os.close(log_fd)
    self.console = open(os.dup(self._saved), "w", buffering=1, encoding="utf-8",
                        errors="backslashreplace")
    self._lock, self._closed = threading.Lock(), False

  def to_terminal(self, text: str) -> None:
    """Writes to the terminal after `close(exiting=True)`."""
    os.write(self._saved, text.encode("utf-8", "backslashreplace"))

  @staticmethod
  def _own_partial_log(partial: str) -> Optional[int]:
    """An O_APPEND fd on `partial`, emptied, with its flock held; None when another launcher
    holds it (it started before this one took the directory's run lock: truncating and
    later deleting its log lost that run's log)."""
    import fcntl
    fd = os.open(partial, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
      os.close(fd)
      return None
    try:
      os.ftruncate(fd, 0)  # (a killed run's log: this run's replaces it)
    except OSError:
      pass  # (not a regular file: nothing to empty)
    return fd

  def close(self, keep: bool = True, move_to: Optional[str] = None,
            exiting: bool = False) -> Optional[str]:
    """Restores stderr; keeps the log (moved to `move_to` if it can be) or deletes it.
    Returns where the log is. Once only (a signal may end the run while it closes).
    `exiting`: fd 2 stays the log's (the process ends at once: Beam's threads, still
    logging a stopped job, wrote their tracebacks to the terminal); `to_terminal` writes."""
    with self._lock:
      if self._closed:
        return self.path
      self._closed = True
    sys.stderr.flush()
    self.console.flush()
    if not exiting:
      os.dup2(self._saved, 2)
      os.close(self._saved)
    self.console.close()
    if not keep:
      os.remove(self.path)
      self.path = None
    elif move_to and self.path != move_to:
      try:
        shutil.move(self.path, move_to)
        self.path = move_to
      except OSError:
        pass  # e.g. the output directory was never created: the log stays where it is
    return self.path


def _exit_on_signals(on_signal) -> None:
  """SIGINT and SIGTERM call `on_signal(signum)` at once in a thread of their own (which
  ends the process). A Python handler would run only when the main thread next runs
  Python code, and while it waits inside Beam's job-state gRPC stream that took ~1 s, with
  the workers computing. The interpreter's C handler writes each signal to a wakeup fd
  immediately; the thread reads it."""
  read_fd, write_fd = os.pipe()
  os.set_blocking(write_fd, False)
  signal.set_wakeup_fd(write_fd)
  for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, lambda *_: None)  # a Python handler, so the C handler writes the fd

  def watch():
    while True:
      for signum in os.read(read_fd, 64):
        if signum in (signal.SIGINT, signal.SIGTERM):
          on_signal(signum)

  threading.Thread(target=watch, name="o1jax-eval-signals", daemon=True).start()


def main(argv):
  after = sys.argv[sys.argv.index("--") + 1:] if "--" in sys.argv else []
  stray = argv[1:len(argv) - len(after)]  # absl's leftovers: positional ones, then after `--`
  if stray:  # (it went to Beam's options, and the default job ran)
    print(f"error: unexpected argument {stray[0]!r}: options are --name=value (a config "
          f"file: --config={stray[0]}); Beam's options go after --", file=sys.stderr)
    return 2
  beam_flags = after
  verbose = _FLAGS["verbose"].value
  output_dir = _FLAGS["output_dir"].value
  if not flags.FLAGS["verbosity"].present:
    from absl import logging
    logging.set_verbosity(logging.WARNING)  # Beam's INFO chatter would drown the progress bar
  # The log goes next to the results in a local output directory (store.is_local's test:
  # importing it would import Beam, which logs before the log is open).
  remote = re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", output_dir) and not output_dir.startswith("file://")
  local_log = None if remote else f"{output_dir.removeprefix('file://').rstrip('/')}/{LOG_NAME}"
  log = None if verbose else _LogFile(local_log)  # before anything imports Beam, which logs
  console = log.console if log else sys.stderr

  def stop(signum: int):
    # Stored samples are complete files; the workers exit with this process (pipelines.beam.worker).
    release_dask_jobs()
    # A worker still starting watches nothing yet. (Not imported here, in the signal's
    # thread: workers exist only once mark_launcher has imported it.)
    if (worker := sys.modules.get("pipelines.beam.worker")) is not None:
      worker.stop_workers()
    for tag in list(_RUNNING_MODEL_TAGS):
      remove_shared_model_files(tag)
    kept = log.close(move_to=local_log, exiting=True) if log else None
    message = ("\n" if Progress.drawn else "") + (  # (not after the bar on its line)
        f"stopped by {signal.Signals(signum).name}: finished samples are kept in the store; "
        f"rerun the same command to resume" + (f" (log: {kept})" if kept else ""))
    if log:
      log.to_terminal(message + "\n")
    else:
      print(message, file=sys.stderr)
      sys.stderr.flush()
    os._exit(128 + signum)  # at once: Beam's threads would hold the process up

  _exit_on_signals(stop)
  try:
    check_unused_overrides(_FLAGS["config"].value, sys.argv)
    for line in unused_override_warnings(_FLAGS["config"].value, sys.argv):
      print(f"warning: {line}", file=console)
    summary = run(_FLAGS["config"].value, output_dir, beam_flags, console=console,
                  n_given="n" in _given(_flags_part(sys.argv), "dataset"))
  except WorkerLostError as e:  # not bad input: the run stopped, its log is kept
    kept = log.close(move_to=local_log) if log else None
    if verbose:
      traceback.print_exc()
    print(f"error: {e}" + (f" (log: {kept})" if kept else ""), file=sys.stderr)
    return 1
  except ValueError as e:  # bad input: config, output directory, checkpoint, dataset
    from pipelines.beam.handler import ModelLoadError
    from pipelines.beam.store import WriteError
    from pipelines.datasets import DatasetChangedError
    # The job ran (a write failed, a model did not load, the data changed): its log is kept.
    if log and isinstance(e, (WriteError, ModelLoadError, DatasetChangedError)):
      log.close(move_to=local_log)
    elif log:
      log.close(keep=False)
    if verbose:
      traceback.print_exc()
    print(f"error: {e}", file=sys.stderr)
    return 2
  except BaseException:
    if log:
      kept = log.close(move_to=local_log)
      print(f"the run failed; what Beam and the workers logged is in {kept}", file=sys.stderr)
    raise
  kept = log.close(keep=bool(local_log), move_to=local_log) if log else None
  for line in worker_warnings(kept):
    print(f"warning: {line}", file=sys.stderr)
  keys = ("task", "policy", "examples", "samples", "accuracy", "accuracy_ci95", "pass_at_k",
          "dead_letters", "data")
  text = json.dumps({k: summary[k] for k in keys if k in summary}, indent=2)
  # A list of numbers (an interval) on one line.
  print(re.sub(r"\[\s+([-\d.,\s]*?)\s+\]", lambda m: "[" + re.sub(r"\s+", " ", m.group(1)) + "]",
               text))
  print(f"wrote results.jsonl, summary.json and report.md under {output_dir}", file=sys.stderr)
  from pipelines.report import recomputed_line, unscored_line
  for line in (recomputed_line(summary), unscored_line(summary)):
    if line:
      print(f"warning: {line}", file=sys.stderr)
  failure = run_failure(summary, output_dir)
  if failure:
    print(f"error: {failure}", file=sys.stderr)
    return 1
  return 0


# Loggers whose warnings concern the run's results or speed (a KV pool capped by the
# device's memory, a slow fallback kernel): the workers log them, the console shows them.
PROJECT_LOGGERS = ("o1jax", "pallas_kernels", "pipelines")


def worker_warnings(log_path: Optional[str], limit: int = 5) -> list[str]:
  """The project's warnings in a run's log (logging's default "WARNING:name:message"
  lines, as the worker processes write them), each once, at most `limit`."""
  if not log_path or not os.path.isfile(log_path):
    return []
  seen: dict[str, None] = {}
  with open(log_path, encoding="utf-8", errors="replace") as f:
    for line in f:
      level, _, rest = line.partition(":")
      name, _, message = rest.partition(":")
      if level == "WARNING" and name.split(".")[0] in PROJECT_LOGGERS and message.strip():
        seen.setdefault(message.strip(), None)
  lines = list(seen)
  if len(lines) > limit:
    lines = lines[:limit] + [f"{len(lines) - limit} more warnings in {log_path}"]
  return lines


def run_failure(summary: dict, output_dir: str) -> str | None:
  """Why a finished run has no result (exit 1), or None."""
  if not summary["samples"]:  # nothing scored: a failed run, whatever the dead letters say
    return (f"no sample was scored: all {summary['dead_letters']['total']} dead letters (each "
            f"with its reason) are in {output_dir}/dead_letters.jsonl")
  if summary.get("sandbox_errors") == summary["samples"]:
    # no verdict at all: the sandbox failed for every program, which is not the model's fault
    return (f"the sandbox failed for all {summary['samples']} programs (status sandbox_error in "
            f"{output_dir}/results.jsonl): no sample has a verdict")
  for category, c in (summary.get("categories") or {}).items():  # the suite's, each alone
    if c.get("sandbox_errors") == c["samples"]:
      return (f"the sandbox failed for all {c['samples']} programs of category {category} "
              f"(sandbox_error in {output_dir}/results.jsonl): it has no verdict")
  return None


if __name__ == "__main__":
  # This process launches: a launcher's pid inherited from one that started it (a run from
  # a worker, a test) would make it watch that process as its workers do.
  os.environ.pop("O1JAX_EVAL_LAUNCHER_PID", None)  # (pipelines.beam.worker.LAUNCHER_PID_ENV)
  sys.argv = double_dash_config_flags(sys.argv)
  try:
    validate_argv(sys.argv)
  except app.UsageError as e:
    if _verbose(sys.argv[1:]):
      traceback.print_exc()
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  define_flags()
  asked_help = bool({"--help", "-h", "-?", "--helpshort", "--helpfull"} & set(
      sys.argv[1:sys.argv.index("--") if "--" in sys.argv else None]))
  try:
    app.run(main)
  except SystemExit as e:  # absl ends --help with exit status 1: help asked for is a success
    sys.exit(0 if asked_help and e.code == 1 else e.code)
