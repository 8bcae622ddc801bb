"""Batch evaluation as an Apache Beam job: `python -m pipelines.eval`.

  python -m pipelines.eval                                   # embedded default, < 10 min on 2 cores
  python -m pipelines.eval --config=configs/gsm8k.py:policy=self_consistency \
      --config.policy.n=8 --output_dir=runs/sc8
  python -m pipelines.eval --config=configs/humaneval.py:smoke=True --output_dir=runs/he
  python -m pipelines.eval --output_dir=gs://bucket/run -- --runner=DataflowRunner --project=P ...

Steps: 1. read the config (variants after the colon, `--config.a.b=v` overrides; an
unknown key is an error listing the valid ones) and Beam flags after `--`;
2. build the plan (task, policy, predictor, model fingerprint) and, for local runs,
list the work items to drive a progress bar with ETA on stderr; 3. run the Beam
graph (`pipelines/beam/pipeline.py`): finished samples are skipped, new ones are
stored as they finish, results.jsonl and dead_letters.jsonl are written at the end;
4. summarize into summary.json; 5. write report.md and plots (`pipelines/report.py`).
Rerunning the same command resumes: nothing already stored is recomputed.
"""

from __future__ import annotations

import json
import pathlib
import sys
import threading
import time
from typing import Optional, Sequence

from absl import app, flags
from ml_collections import config_flags

import configs

DEFAULT_CONFIG = str(pathlib.Path(configs.__file__).parent / "gsm8k.py")
_FLAGS: dict = {}


def define_flags() -> None:
  """Defined only when run as a program: ml_collections applies overrides at definition time."""
  _FLAGS["config"] = config_flags.DEFINE_config_file(
      "config", DEFAULT_CONFIG, "evaluation config file[:variants]", lock_config=True)
  _FLAGS["output_dir"] = flags.DEFINE_string("output_dir", "runs/default",
                                             "where results, summary and report go")


# -- command line -------------------------------------------------------------------

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
  """get_config(arg) of a config file, loaded the way ml_collections does."""
  import importlib.util
  module_spec = importlib.util.spec_from_file_location("_o1jax_eval_config", path)
  if module_spec is None or module_spec.loader is None:
    raise app.UsageError(f"--config={path}: not a Python config file")
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(arg) if arg else module.get_config()


def check_overrides(config, argv: Sequence[str]) -> None:
  """Every `--config.a.b=v` must name an existing key; otherwise list the valid ones."""
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
  """Config variants and `--config.*` keys, checked before ml_collections sees them."""
  path, arg = _config_path_and_arg(argv)
  try:
    cfg = load_config_file(path, arg)
  except ValueError as e:  # a bad variant: the config file says which keys are valid
    raise app.UsageError(str(e)) from e
  check_overrides(cfg, argv[1:])


# -- progress -----------------------------------------------------------------------

class Progress:
  """tqdm bar fed by counting the plan's keys in the local store (works across worker processes)."""

  def __init__(self, store, keys: set[str], interval_s: float = 1.0):
    self.store, self.keys, self.interval_s = store, keys, interval_s
    self._stop = threading.Event()
    self._thread: Optional[threading.Thread] = None

  def done(self) -> int:
    return len(self.keys & self.store.keys())

  def __enter__(self):
    from tqdm import tqdm
    self.bar = tqdm(total=len(self.keys), initial=self.done(), unit="sample", file=sys.stderr,
                    desc="eval", dynamic_ncols=True, miniters=1, mininterval=1.0)
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
    return False


# -- the run ------------------------------------------------------------------------

def _read_jsonl(path: str) -> list[dict]:
  from pipelines.datasets.jsonl import open_binary
  out = []
  with open_binary(path) as f:
    for line in f.read().decode("utf-8").splitlines():
      if line.strip():
        out.append(json.loads(line))
  return out


def run(config, output_dir: str, beam_flags: Sequence[str] = (), *, clock=time, loader=None,
        progress: Optional[bool] = None, report: bool = True) -> dict:
  """Runs the whole evaluation; returns summary.json's content.

  `clock` and `loader` are passed to the pipeline (tests inject fakes).
  """
  import apache_beam as beam

  from pipelines.beam import ResultStore, build_pipeline, build_plan, pipeline_options, plan_items
  from pipelines.beam.options import is_direct
  from pipelines.beam.pipeline import write_text
  from pipelines.beam.store import is_local
  from pipelines.summary import summarize

  plan = build_plan(config, output_dir)
  options = pipeline_options(config.runner, beam_flags)
  local = is_local(output_dir) and is_direct(options)
  store = ResultStore(plan.store_dir)
  keys: set[str] = set()
  resumed_before = None
  if local:
    items, _ = plan_items(plan)
    keys = {i.key for i in items}
    resumed_before = len(keys & store.keys())
  show = config.runner.progress if progress is None else progress
  started_ms = clock.time_ns() / 1e6
  t0 = time.perf_counter()
  pipeline = beam.Pipeline(options=options)
  build_pipeline(pipeline, plan, clock=clock, loader=loader)
  if local and show:
    with Progress(store, keys):
      result = pipeline.run()
      result.wait_until_finish()
  else:
    result = pipeline.run()
    result.wait_until_finish()
  wall_s = time.perf_counter() - t0

  out = output_dir.rstrip("/")
  records = _read_jsonl(f"{out}/results.jsonl")
  dead = _read_jsonl(f"{out}/dead_letters.jsonl")
  run_info = {"started_ms": started_ms, "wall_s": round(wall_s, 2),
              "resumed": resumed_before, "computed": (len(records) - resumed_before)
              if resumed_before is not None else None,
              "beam_args": pipeline_args_for_summary(config, beam_flags)}
  summary = summarize(records, dead, task=plan.task.name, vote=plan.policy.vote, run=run_info,
                      config=config.to_dict())
  summary["model"] = plan.model_fp
  write_text(f"{out}/summary.json", json.dumps(summary, indent=2, default=list) + "\n")
  if report and is_local(output_dir):
    from pipelines.report import write_run_report
    write_run_report(output_dir)
  return summary


def pipeline_args_for_summary(config, beam_flags: Sequence[str]) -> list[str]:
  from pipelines.beam.options import beam_args
  return beam_args(config.runner, beam_flags)


def main(argv):
  beam_flags = argv[1:]  # everything after `--`
  if not flags.FLAGS["verbosity"].present:
    from absl import logging
    logging.set_verbosity(logging.WARNING)  # Beam's INFO chatter would drown the progress bar
  from o1jax.checkpoint import CheckpointError
  try:
    summary = run(_FLAGS["config"].value, _FLAGS["output_dir"].value, beam_flags)
  except (CheckpointError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  keys = ("task", "policy", "examples", "samples", "accuracy", "pass_at_k", "dead_letters")
  print(json.dumps({k: summary[k] for k in keys if k in summary}, indent=2))
  print(f"wrote results.jsonl, summary.json and report.md under {_FLAGS['output_dir'].value}",
        file=sys.stderr)
  return 0


if __name__ == "__main__":
  try:
    validate_argv(sys.argv)
  except app.UsageError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  define_flags()
  app.run(main)
