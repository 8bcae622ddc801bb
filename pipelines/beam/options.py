"""Beam pipeline options from the config's `runner` section plus raw Beam flags.

  options = pipeline_options(config.runner, ["--runner=DataflowRunner", "--project=p", ...])

1. the config gives the runner name and the DirectRunner settings (workers, mode; each
   worker process imports `pipelines.beam.worker` first, which ends it with the launcher);
2. Beam flags passed after `--` on the command line override them (any runner:
   Dataflow, Flink, Spark, Prism); 3. DirectRunner-only flags are dropped for
   other runners so their option validation does not trip over them; 4. the modules of
   the config's `imports` become Beam plugins too, so every worker process of any runner
   imports them at start-up (a researcher's own policies, verifiers, tasks).
"""

from __future__ import annotations

from typing import Sequence

from apache_beam.options.pipeline_options import PipelineOptions

WORKER_PLUGIN = "pipelines.beam.worker"  # imported by each worker process at start-up
RUNNERS = ("DirectRunner", "DataflowRunner", "FlinkRunner", "SparkRunner", "PrismRunner",
           "PortableRunner")


def beam_args(runner_cfg, extra: Sequence[str] = (), plugins: Sequence[str] = ()) -> list[str]:
  extra = list(extra)
  runner = runner_cfg.name
  for arg in extra:
    if arg.startswith("--runner="):
      runner = arg.split("=", 1)[1]
  args = [f"--runner={runner}"]
  if runner == "DirectRunner":
    args += [f"--direct_num_workers={int(runner_cfg.direct_num_workers)}",
             f"--direct_running_mode={runner_cfg.direct_running_mode}",
             f"--beam_plugins={WORKER_PLUGIN}"]  # worker processes exit with the launcher
    if not any(a.startswith("--default_sdk_harness_log_level") for a in extra):
      args.append("--default_sdk_harness_log_level=WARNING")  # worker INFO lines bury the progress bar
  args += [f"--beam_plugins={name}" for name in plugins]
  return args + [a for a in extra if not a.startswith("--runner=")]


def pipeline_options(runner_cfg, extra: Sequence[str] = (),
                     plugins: Sequence[str] = ()) -> PipelineOptions:
  return PipelineOptions(beam_args(runner_cfg, extra, plugins))


def is_direct(options: PipelineOptions) -> bool:
  from apache_beam.options.pipeline_options import StandardOptions
  runner = options.view_as(StandardOptions).runner
  return runner in (None, "DirectRunner", "BundleBasedDirectRunner")
