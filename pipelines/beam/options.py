"""Beam pipeline options from the config's `runner` section plus raw Beam flags.

  options = pipeline_options(config.runner, ["--runner=DataflowRunner", "--project=p", ...])

1. the config gives the runner name and the DirectRunner settings (workers, mode; each
   worker process imports `pipelines.beam.worker` first, which ends it with the launcher);
2. Beam flags passed after `--` on the command line override them (any runner:
   Dataflow, Flink, Spark, Prism); 3. DirectRunner-only flags are dropped for
   other runners so their option validation does not trip over them; 4. the modules of
   the config's `imports` become Beam plugins too, so every worker process of any runner
   imports them at start-up (a researcher's own policies, verifiers, tasks);
5. `dask` runs on a dask.distributed cluster (`pipelines/beam/dask_runner.py`): the one at
   `runner.address`, or a LocalCluster of `runner.local_workers` processes on this machine.
"""

from __future__ import annotations

import contextlib
import importlib
import io
from typing import Sequence

from apache_beam.options.pipeline_options import PipelineOptions

WORKER_PLUGIN = "pipelines.beam.worker"  # imported by each worker process at start-up
DASK_RUNNER = "pipelines.beam.dask_runner.DaskRunner"
# (Beam's own Dask runner by its path means ours too: its translation drops a DoFn's
# finish_bundle outputs and ends this job in a TypeError)
DASK_NAMES = ("dask", "DaskRunner", DASK_RUNNER, "apache_beam.runners.dask.dask_runner.DaskRunner")
RUNNERS = ("DirectRunner", "dask", "DataflowRunner", "FlinkRunner", "SparkRunner", "PrismRunner",
           "PortableRunner")


class SchedulerUnreachableError(ValueError):
  """The Dask scheduler a job was given could not be reached: nothing ran (bad input, not a
  connection lost during the run)."""


def runner_name(name, key: str = "runner.name") -> str:
  """The runner a name means, spelled as the project compares it: "dask" for the dask
  runner, Beam's class name otherwise (Beam reads "directrunner" or "direct" as the
  DirectRunner, and the DirectRunner's settings were then dropped without a word); a
  dotted class path as given. Raises ValueError naming `key` for a name Beam does not know."""
  if not isinstance(name, str) or not name.strip():
    raise ValueError(f"{key}={name!r}: expected one of {list(RUNNERS)} (or a runner class path)")
  if name in DASK_NAMES or name.lower() in ("dask", "daskrunner"):
    return "dask"
  from apache_beam.runners.runner import _RUNNER_MAP  # Beam's own table of names
  if "." in name:
    if name in _RUNNER_MAP.values():  # Beam's own class by its path: its short name
      return name.rsplit(".", 1)[1]
    module, _, attr = name.rpartition(".")
    try:  # (Beam imports it when the job starts: a traceback after the output was made)
      getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
      raise ValueError(f"{key}={name!r}: cannot import it ({e})") from None
    return name
  path = _RUNNER_MAP.get(name.lower(), _RUNNER_MAP.get(name.lower() + "runner"))
  if path is None:
    raise ValueError(f"{key}={name!r}: expected one of {list(RUNNERS)} (or a runner class path)")
  return path.rsplit(".", 1)[1]


def batches_sharing_a_model(runner_cfg) -> int:
  """Beam batches one shared model may serve at once: the DirectRunner's worker processes
  or threads when they share it (runner.share_model); 1 where the runner does not say how
  many workers of a machine share it (a cluster) or each has its own model."""
  if (runner_name(runner_cfg.name) == "DirectRunner" and runner_cfg.get("share_model", True)
      and runner_cfg.get("direct_running_mode", "multi_processing") != "in_memory"):
    # 0 is Beam's "one per CPU" (multiprocessing.cpu_count(), as the runner counts them).
    import multiprocessing
    return max(1, int(runner_cfg.get("direct_num_workers", 1)) or multiprocessing.cpu_count())
  return 1


# Beam flags whose value the config's runner section holds, by runner.
_CONFIG_HELD = {
    "DirectRunner": {"--direct_num_workers": "direct_num_workers",
                     "--direct_running_mode": "direct_running_mode"},
    "dask": {"--dask_client_address": "address", "--dask_local_workers": "local_workers",
             "--dask_partitions": "partitions"},
}


def _check_config_held(runner: str, runner_cfg, extra: Sequence[str]) -> None:
  """A Beam flag after `--` that sets another value than the config's key for it is refused:
  the flag won, while the summary reported the config's value and the engine sized its slots
  by it (--direct_num_workers=1 ran one worker with a config of 2)."""
  extra = list(extra)
  for i, arg in enumerate(extra):
    flag, eq, value = arg.partition("=")
    key = _CONFIG_HELD.get(runner, {}).get(flag)
    if key is None:
      continue
    if not eq:  # (argparse's other form: the value is the next argument)
      value = extra[i + 1] if i + 1 < len(extra) else ""
    held = runner_cfg.get(key, "")
    same = str(held) == value
    if isinstance(held, int) and not isinstance(held, bool):  # (01 is 1)
      same = same or (value.strip().lstrip("+").isdigit() and int(value) == held)
    if not same:
      raise ValueError(f"Beam flag {flag}={value} after -- sets what runner.{key}={held!r} "
                       f"holds: give --config.runner.{key}={value or '...'} instead")


def runner_flag(extra: Sequence[str]) -> str | None:
  """The runner a `--runner=X` or `--runner X` after `--` names (the last one, as argparse
  reads them), or None."""
  extra, found = list(extra), None
  for i, arg in enumerate(extra):
    if arg.startswith("--runner="):
      found = arg.split("=", 1)[1]
    elif arg == "--runner":
      found = extra[i + 1] if i + 1 < len(extra) else ""
  return found


def _without_runner_flags(extra: Sequence[str]) -> list[str]:
  out, skip = [], False
  for arg in extra:
    if skip:
      skip = False
    elif arg == "--runner":
      skip = True
    elif not arg.startswith("--runner="):
      out.append(arg)
  return out


def beam_args(runner_cfg, extra: Sequence[str] = (), plugins: Sequence[str] = ()) -> list[str]:
  """Beam's flags for the config's runner section and the flags given after `--` (a
  `--runner` among them, in either argparse form, picks the runner)."""
  flag = runner_flag(extra)
  extra = _without_runner_flags(extra)  # (ours names the runner, as Beam's class path)
  runner = runner_name(runner_cfg.name) if flag is None else runner_name(flag, "--runner")
  _check_config_held(runner, runner_cfg, extra)
  for key in ("local_workers", "partitions"):  # (for every runner: a typo stays one)
    value = runner_cfg.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < (key == "local_workers"):
      raise ValueError(f"runner.{key}={value!r}: expected an integer >= "
                       f"{1 if key == 'local_workers' else 0}")
  if runner == "dask":
    return _dask_args(runner_cfg, extra, plugins)
  address = str(runner_cfg.get("address", "") or "").strip()
  if address:  # (the run went to this machine's DirectRunner without a word)
    raise ValueError(f"runner.address={address!r} is a dask scheduler's, but runner.name="
                     f"{runner_cfg.name!r}: add --config.runner.name=dask to run there")
  args = [f"--runner={runner}"]
  if runner == "DirectRunner":
    args += [f"--direct_num_workers={int(runner_cfg.direct_num_workers)}",
             f"--direct_running_mode={runner_cfg.direct_running_mode}",
             f"--beam_plugins={WORKER_PLUGIN}"]  # worker processes exit with the launcher
    if not any(a.startswith("--default_sdk_harness_log_level") for a in extra):
      args.append("--default_sdk_harness_log_level=WARNING")  # worker INFO lines bury the progress bar
  args += [f"--beam_plugins={name}" for name in plugins]
  return args + extra


# The dask runner subclasses Beam's own and reuses its translation internals, which this
# Beam release has (the DirectRunner works with any apache-beam >= 2.60).
DASK_BEAM_VERSION = (2, 77)


def check_dask_beam_version(version: str | None = None) -> None:
  """One-line error when the installed Beam is not the release the dask runner was built on."""
  import apache_beam
  version = version or apache_beam.__version__
  have = tuple(int(x) for x in version.split(".")[:2] if x.isdigit())
  if have != DASK_BEAM_VERSION:
    want = ".".join(map(str, DASK_BEAM_VERSION))
    raise ValueError(f"runner.name=dask needs apache-beam {want}.x (its Dask translation is "
                     f"reused); this is apache-beam {version}: pip install 'apache-beam=={want}.*'")


def _dask_args(runner_cfg, extra: Sequence[str], plugins: Sequence[str]) -> list[str]:
  """The config's address (or LocalCluster size) and partitions (a flag after `--` for one
  of them must agree: `_check_config_held`)."""
  check_dask_beam_version()
  given = {a.split("=", 1)[0] for a in extra}
  address = str(runner_cfg.get("address", "") or "").strip()
  if address:  # (distributed's own message names no key: "missing port number in address")
    from distributed.comm import parse_address  # pylint: disable=g-import-not-at-top
    from distributed.comm.addressing import parse_host_port  # pylint: disable=g-import-not-at-top
    try:
      scheme, location = parse_address(address)
      if scheme in ("tcp", "tls"):
        _, port = parse_host_port(location)
        if not 0 < port < 65536:  # (dask retried such a port for 30 s)
          raise ValueError(f"port {port} is not in 1-65535")
    except ValueError as e:
      raise ValueError(f"runner.address={address!r}: {e} (expected tcp://host:8786)") from None
  args = [f"--runner={DASK_RUNNER}"]
  if address and "--dask_client_address" not in given:
    args.append(f"--dask_client_address={address}")
  if not address and "--dask_local_workers" not in given:
    args.append(f"--dask_local_workers={int(runner_cfg.get('local_workers', 2))}")
  if int(runner_cfg.get("partitions", 0) or 0) and "--dask_partitions" not in given:
    args.append(f"--dask_partitions={int(runner_cfg.partitions)}")
  # Local workers exit with the launcher (the module does nothing on a remote cluster).
  args += [f"--beam_plugins={name}" for name in (WORKER_PLUGIN, *plugins)]
  return args + extra


def pipeline_options(runner_cfg, extra: Sequence[str] = (),
                     plugins: Sequence[str] = ()) -> PipelineOptions:
  """The options, parsed now: Beam parses them lazily, when the job starts, and a bad value
  was then argparse's usage text in the log and `SystemExit(2)` ("the run failed"). Beam
  checks its flags' types and choices (direct_running_mode); a negative worker count it
  takes, so that is checked here."""
  workers = runner_cfg.get("direct_num_workers", 1)
  if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
    raise ValueError(f"runner.direct_num_workers={workers!r}: expected an int >= 0 (0 = one per CPU)")
  options = PipelineOptions(beam_args(runner_cfg, extra, plugins))
  usage = io.StringIO()
  try:
    with contextlib.redirect_stderr(usage):
      given = options.get_all_options(retain_unknown_options=True)
  except SystemExit:
    error = usage.getvalue().strip().splitlines()[-1:] or ["cannot be parsed"]
    raise ValueError(f"Beam flags: {error[0].partition(': error: ')[2] or error[0]}") from None
  _check_known_flags(options, given)
  check_runner_options(options)
  return options


def _check_known_flags(options: PipelineOptions, given: dict) -> None:
  """A flag no Beam option defines is refused where the runner runs here: the DirectRunner
  and the dask runner drop it with a warning among Beam's own (--direct_num_worker=4 or
  --dask_local_worker=4 ran with the config's value). A portable or cloud runner passes
  such flags on to its job service, which may define them."""
  from apache_beam.options.pipeline_options import StandardOptions
  runner = options.view_as(StandardOptions).runner
  if runner in DASK_NAMES:
    importlib.import_module("pipelines.beam.dask_runner")  # (defines its flags)
    given = options.get_all_options(retain_unknown_options=True)  # (by their dests now)
  elif not is_direct(options):
    return
  unknown = sorted(set(given) - set(options.get_all_options()))
  if unknown:
    name = "dask runner" if runner in DASK_NAMES else "DirectRunner"
    raise ValueError(f"Beam flags after --: {', '.join('--' + k for k in unknown)} "
                     f"{'is' if len(unknown) == 1 else 'are'} no Beam option (the {name} "
                     f"would ignore {'it' if len(unknown) == 1 else 'them'})")


def check_runner_options(options: PipelineOptions) -> None:
  """Beam's own check of the options against their runner (Dataflow's project, region,
  temp_location), made now: Beam makes it when the pipeline is built, after the output
  directory and its store were made, as a message of several lines."""
  from apache_beam.options.pipeline_options import StandardOptions
  from apache_beam.options.pipeline_options_validator import PipelineOptionsValidator
  from apache_beam.runners import create_runner
  runner = options.view_as(StandardOptions).runner
  if is_direct(options) or runner in DASK_NAMES:
    return
  errors = PipelineOptionsValidator(options, create_runner(runner)).validate()
  if errors:
    raise ValueError(f"Beam flags for the {runner}: "
                     + "; ".join(" ".join(e.split()).rstrip(".") for e in errors))


def is_direct(options: PipelineOptions) -> bool:
  from apache_beam.options.pipeline_options import StandardOptions
  runner = options.view_as(StandardOptions).runner
  return runner in (None, "DirectRunner", "BundleBasedDirectRunner")


def runs_here(options: PipelineOptions) -> bool:
  """Whether the workers run on this machine: the DirectRunner, or the dask runner on a
  LocalCluster it starts (no scheduler address): local output paths and the launcher watch
  then apply."""
  if is_direct(options):
    return True
  from apache_beam.options.pipeline_options import StandardOptions
  if options.view_as(StandardOptions).runner not in DASK_NAMES:
    return False
  from apache_beam.runners.dask.dask_runner import DaskOptions
  dask = options.view_as(DaskOptions)
  return not dask.address and not dask.scheduler_file
