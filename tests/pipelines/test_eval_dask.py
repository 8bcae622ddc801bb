"""The eval job on a dask.distributed cluster (pipelines/beam/dask_runner.py), for real: a
LocalCluster of worker processes on this machine, the same records and dead letters as the
DirectRunner, resume after kill -9, one model per worker process."""

import collections
import json
import os
import pathlib
import subprocess
import sys
import time

import apache_beam as beam
import pytest
from apache_beam.options.pipeline_options import PipelineOptions

from configs import custom as custom_config
from configs import gsm8k as gsm8k_config
from pipelines.beam.options import DASK_RUNNER, beam_args, pipeline_options, runs_here
from pipelines.beam.testing import CountingLoader, FakeClock
from pipelines.eval import run
from tests.pipelines import kill_resume

REPO = pathlib.Path(__file__).resolve().parents[2]


_lines, _without_timing = kill_resume.records, kill_resume.without_timing


def test_runner_flags_from_the_config():
  cfg = gsm8k_config.get_config("smoke=True").runner
  cfg.name = "dask"
  assert beam_args(cfg)[:2] == [f"--runner={DASK_RUNNER}", "--dask_local_workers=2"]
  # Beam's own Dask runner by its path is ours too (it lost finish_bundle's outputs and
  # ended the job in an 80-line TypeError).
  beams = gsm8k_config.get_config("smoke=True").runner
  beams.name = "apache_beam.runners.dask.dask_runner.DaskRunner"
  assert beam_args(beams)[:2] == [f"--runner={DASK_RUNNER}", "--dask_local_workers=2"]
  assert runs_here(pipeline_options(cfg))  # a LocalCluster: local paths and the launcher watch apply
  cfg.address = "tcp://scheduler:8786"
  cfg.partitions = 16
  args = beam_args(cfg)
  assert "--dask_client_address=tcp://scheduler:8786" in args and "--dask_partitions=16" in args
  assert not any(a.startswith("--dask_local_workers") for a in args)
  assert not runs_here(pipeline_options(cfg))
  # A flag after `--` for a key the config holds must agree with it (before: the flag won,
  # the summary reported the config's value).
  assert "--dask_client_address=tcp://scheduler:8786" in beam_args(
      cfg, ["--dask_client_address=tcp://scheduler:8786"])
  with pytest.raises(ValueError, match=r"^Beam flag --dask_client_address=tcp://other:8786 after "
                                       r"-- sets what runner\.address='tcp://scheduler:8786' "
                                       r"holds: give --config\.runner\.address=tcp://other:8786 "
                                       r"instead$"):
    beam_args(cfg, ["--dask_client_address=tcp://other:8786"])
  # argparse's other form and a number written otherwise, agreeing with the config, run
  direct = gsm8k_config.get_config("smoke=True").runner
  for extra in (["--direct_num_workers", "2"], ["--direct_num_workers=02"],
                ["--direct_running_mode", direct.direct_running_mode]):
    assert beam_args(direct, extra)[-len(extra):] == extra
  with pytest.raises(ValueError, match=r"^Beam flag --direct_num_workers=3 after -- sets"):
    beam_args(direct, ["--direct_num_workers", "3"])


def test_bad_runner_settings_are_one_line_errors(tmp_path):
  cfg = gsm8k_config.get_config("smoke=True").runner
  cfg.name = "dask"
  cfg.local_workers = 0
  with pytest.raises(ValueError, match=r"^runner.local_workers=0: expected an integer >= 1$"):
    beam_args(cfg)
  cfg.local_workers, cfg.address = 1, "not-an-address"  # was distributed's message alone
  with pytest.raises(ValueError, match=r"^runner.address='not-an-address': missing port number "
                                       r"in address 'not-an-address' \(expected tcp://host:8786\)$"):
    beam_args(cfg)
  # Nothing listens on the discard port here: the error names the scheduler (python -m
  # pipelines.eval prints a ValueError as one `error:` line, exit code 2).
  cfg = gsm8k_config.get_config("smoke=True")
  cfg.model.predictor = "fake"
  cfg.dataset.n = 2
  cfg.runner.update(name="dask", address="tcp://127.0.0.1:9")
  with pytest.raises(ValueError, match=r"^dask scheduler tcp://127.0.0.1:9 cannot be reached: ") as e:
    run(cfg, str(tmp_path), ["--dask_connection_timeout=2"], progress=False, report=False)
  assert "\n" not in str(e.value)
  # A refused connection, a host that does not resolve, a port out of range: at once (each
  # waited out dask's 30 s retries).
  start = time.monotonic()
  for address, message in (
      ("tcp://127.0.0.1:9", r"^dask scheduler tcp://127.0.0.1:9 cannot be reached: 127.0.0.1:9: "
                            r"Connection refused$"),
      # No scheme (dask reads tcp): it waited 30 s, then read as a connection lost in a run.
      ("127.0.0.1:9", r"^dask scheduler 127.0.0.1:9 cannot be reached: 127.0.0.1:9: "
                      r"Connection refused$"),
      ("tcp://no-such-host.invalid:8786", r"^dask scheduler tcp://no-such-host.invalid:8786 "
                                          r"cannot be reached: no-such-host.invalid:8786: "),
      ("tcp://127.0.0.1:99999", r"^runner.address='tcp://127.0.0.1:99999': port 99999 is not in "
                                r"1-65535 \(expected tcp://host:8786\)$")):
    cfg.runner.address = address
    with pytest.raises(ValueError, match=message):
      run(cfg, str(tmp_path), progress=False, report=False)
  assert time.monotonic() - start < 25
  # From the command line, in a process that has not imported the dask runner yet: its
  # flags are Beam options (the check of flags after -- refused --dask_client_address).
  cli = subprocess.run([sys.executable, "-m", "pipelines.eval", "--config=configs/gsm8k.py:smoke=True",
                        "--config.model.predictor=fake", "--config.runner.name=dask",
                        "--config.runner.address=tcp://127.0.0.1:9", f"--output_dir={tmp_path}/cli"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
  assert cli.returncode == 2 and cli.stderr.startswith(
      "error: dask scheduler tcp://127.0.0.1:9 cannot be reached: "), cli.stderr[-2000:]


def test_a_peer_that_never_answers_the_handshake_is_one_line(tmp_path, monkeypatch):
  # Something listens at the address but is no scheduler (a web server on that port): the
  # launcher waited forever, past the client's timeout.
  import socket
  from pipelines.beam import dask_runner
  monkeypatch.setattr(dask_runner, "CONNECT_DEADLINE_S", 3)
  with socket.socket() as listener:  # accepts connections (the backlog), answers nothing
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    address = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    cfg = gsm8k_config.get_config("smoke=True")
    cfg.model.predictor = "fake"
    cfg.dataset.n = 2
    cfg.runner.update(name="dask", address=address)
    with pytest.raises(ValueError) as e:
      run(cfg, str(tmp_path), progress=False, report=False)
  assert str(e.value) == (f"dask scheduler {address} cannot be reached: no answer from a "
                          f"dask scheduler within 3 s")


def test_a_scheduler_that_answers_past_the_deadline_is_not_kept(monkeypatch):
  # The connecting thread finished after the launcher had given up: its client stayed
  # the process's default (a live connection in a notebook or test session).
  import threading
  import time
  from pipelines.beam import dask_runner
  monkeypatch.setattr(dask_runner, "CONNECT_DEADLINE_S", 0.2)
  closed = threading.Event()

  class SlowClient:
    def __init__(self, **kwargs):
      time.sleep(0.6)

    def close(self):
      closed.set()

  fake = type("ddist", (), {"Client": SlowClient})
  monkeypatch.setattr(dask_runner, "_reachable", lambda address: None)  # (no host "h")
  with pytest.raises(TimeoutError, match="no answer from a dask scheduler within 0.2 s"):
    dask_runner._connect(fake, {"address": "tcp://h:1"}, remote=True)
  assert closed.wait(5)


def test_a_scheduler_file_that_never_appears_is_named(tmp_path, monkeypatch):
  # dask's Client waits for --dask_scheduler_file to appear (a scheduler being started
  # writes it); one that never appears was reported as a scheduler that did not answer.
  import time
  from pipelines.beam import dask_runner
  monkeypatch.setattr(dask_runner, "CONNECT_DEADLINE_S", 0.2)

  class WaitingClient:
    def __init__(self, **kwargs):
      time.sleep(0.6)

    def close(self):
      pass

  fake = type("ddist", (), {"Client": WaitingClient})
  missing = str(tmp_path / "scheduler.json")
  with pytest.raises(TimeoutError, match=r"^the scheduler file does not exist \(waited 0.2 s "
                                         r"for a scheduler to write it\)$"):
    dask_runner._connect(fake, {"scheduler_file": missing}, remote=True)
  (tmp_path / "scheduler.json").write_text("{}")  # there, but nobody answers
  with pytest.raises(TimeoutError, match="^no answer from a dask scheduler within 0.2 s$"):
    dask_runner._connect(fake, {"scheduler_file": missing}, remote=True)


def test_workers_that_cannot_import_the_job_are_one_line(tmp_path):
  # A worker without the package (or a config's module) failed with ~80 lines of traceback.
  cfg = gsm8k_config.get_config("smoke=True")
  cfg.model.predictor = "fake"
  cfg.dataset.n = 2
  cfg.runner.update(name="dask", local_workers=1)
  with pytest.raises(ValueError) as e:
    run(cfg, str(tmp_path), ["--beam_plugins=no_such_module_o1jax"], progress=False,
        report=False)
  assert str(e.value) == (
      "dask workers of the local cluster cannot import the job's modules "
      "(ModuleNotFoundError: No module named 'no_such_module_o1jax'): install o1jax and the "
      "config's modules on every worker")


class _SplitThrees(beam.DoFn):
  def process(self, x):
    yield beam.pvalue.TaggedOutput("three", x) if x % 3 == 0 else x


def _write(values, path):
  pathlib.Path(path).write_text(json.dumps(sorted(values)))


def test_translation_keeps_finish_bundle_outputs_tagged_outputs_and_every_sink(tmp_path):
  # Beam 2.77's own DaskRunner fails all three: it drops the partial batches BatchElements
  # emits in finish_bundle, sends 'three' to the main consumers too, and runs one sink only.
  p = beam.Pipeline(options=PipelineOptions(
      [f"--runner={DASK_RUNNER}", "--dask_local_workers=1", "--dask_partitions=3"]))
  split = (p
           | beam.Create([None])
           | beam.FlatMap(lambda _: range(10))
           | beam.Reshuffle()  # 3 partitions, so 3 bundles each end with a partial batch
           | beam.ParDo(_SplitThrees()).with_outputs("three", main="rest"))
  _ = (split.rest
       | beam.BatchElements(min_batch_size=3, max_batch_size=3)
       | "ListRest" >> beam.combiners.ToList()
       | "WriteRest" >> beam.Map(_write, str(tmp_path / "rest.json")))
  _ = (split.three
       | "ListThree" >> beam.combiners.ToList()
       | "WriteThree" >> beam.Map(_write, str(tmp_path / "three.json")))
  p.run().wait_until_finish()
  batches = json.loads((tmp_path / "rest.json").read_text())
  assert sorted(x for b in batches for x in b) == [1, 2, 4, 5, 7, 8]
  assert json.loads((tmp_path / "three.json").read_text()) == [0, 3, 6, 9]


def test_same_records_and_dead_letters_as_the_direct_runner_one_model_per_worker(tmp_path):
  data = tmp_path / "data.jsonl"
  data.write_text("\n".join(
      [json.dumps({"q": f"What is {i} + {i}?", "a": str(2 * i), "id": f"e{i}"}) for i in range(5)]
      + ["{not json"]
      + [json.dumps({"q": f"What is {i} - 1?", "a": str(i - 1), "id": f"f{i}"}) for i in range(5, 8)]) + "\n")
  summaries, loads = {}, {}
  for runner in ("DirectRunner", "dask"):
    cfg = custom_config.get_config("smoke=True,policy=sample_n")
    cfg.model.predictor = "fake"
    cfg.dataset.update(path=str(data), question_field="q", answer_field="a", id_field="id")
    cfg.policy.n = 2
    cfg.runner.batch_size = 1  # only the failing example's samples fail, in either runner
    cfg.runner.name = runner
    cfg.runner.direct_running_mode = "in_memory"
    cfg.runner.partitions = 6  # more bundles than the 2 workers: the model must be reused
    cfg.runner.share_model = False  # one model per worker process (True: one per machine)
    loads[runner] = tmp_path / f"{runner}.loads"
    summaries[runner] = run(cfg, str(tmp_path / runner), clock=FakeClock(), progress=False,
                            report=False, loader=CountingLoader(str(loads[runner]), frozenset({"custom/e3"})))
  direct, dask = (tmp_path / "DirectRunner", tmp_path / "dask")
  assert _without_timing(_lines(dask / "results.jsonl")) == _without_timing(_lines(direct / "results.jsonl"))
  assert len(_lines(dask / "results.jsonl")) == 14
  assert _lines(dask / "dead_letters.jsonl") == _lines(direct / "dead_letters.jsonl")
  assert [(d["stage"], d.get("example_id")) for d in _lines(dask / "dead_letters.jsonl")] == [
      ("inference", "custom/e3"), ("inference", "custom/e3"), ("input", None)]
  for key in ("examples", "samples", "accuracy", "dead_letters"):
    assert summaries["dask"][key] == summaries["DirectRunner"][key], key
  # Each worker process loaded the model once, however many bundles it ran; the launcher none.
  log = [line.split() for line in loads["dask"].read_text().splitlines()]
  per_process = collections.Counter(pid for what, pid in log if what == "load")
  assert set(per_process.values()) == {1} and 1 <= len(per_process) <= 2, per_process
  assert str(os.getpid()) not in per_process
  workers = {r["timing"]["worker_pid"] for r in _lines(dask / "results.jsonl")}
  assert workers <= {int(p) for p in per_process}
  # Every item was predicted exactly once (no partition computed twice), as on the DirectRunner.
  predicted = collections.Counter(key for what, key in log if what == "item")
  assert set(predicted.values()) == {1} and len(predicted) == 16, predicted


def test_kill_9_then_rerun_on_dask_finishes_without_recomputing(tmp_path):
  out = tmp_path / "killed"
  cmd = kill_resume.command(out, "--config.runner.name=dask", "--config.runner.local_workers=1")
  # The launcher alone (it holds the scheduler): its worker processes must end by themselves
  # (pipelines/beam/worker.py, imported by each worker), as on the DirectRunner.
  before = kill_resume.start_and_kill(out, cmd, whole_group=False, timeout_s=180)
  kill_resume.rerun_and_compare(out, cmd, before, tmp_path / "clean")


def _free_port() -> int:
  import socket
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _start_loopback_cluster(tmp_path, worker_tmp, nworkers: int) -> tuple[str, list]:
  """`dask scheduler` + `dask worker` on the loopback address (a real cluster's commands):
  its address and processes (the workers' temp directory is `worker_tmp`), once the
  scheduler answers and the workers joined, as a cluster is before a job is sent to it (a
  job sent while the scheduler still started was refused at once, as the launcher refuses
  a port nothing listens on)."""
  from distributed import Client
  address = f"tcp://127.0.0.1:{_free_port()}"
  env = {**os.environ, "PYTHONPATH": str(REPO)}
  started = [subprocess.Popen(
      [sys.executable, "-m", "dask", "scheduler", "--host", "127.0.0.1", "--port",
       address.rsplit(":", 1)[1], "--no-dashboard"], env=env, cwd=tmp_path,
      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
  started.append(subprocess.Popen(
      [sys.executable, "-m", "dask", "worker", address, "--nworkers", str(nworkers),
       "--nthreads", "1", "--host", "127.0.0.1", "--no-dashboard"],
      env={**env, "TMPDIR": str(worker_tmp)}, cwd=tmp_path, stdout=subprocess.DEVNULL,
      stderr=subprocess.DEVNULL))
  try:
    with Client(address, timeout=60) as client:
      client.wait_for_workers(nworkers, timeout=60)
  except BaseException:
    for p in reversed(started):
      p.kill()
    raise
  return address, started


def test_two_jobs_on_a_cluster_started_like_the_readme_says(tmp_path):
  # `dask scheduler` + `dask worker` on the loopback address stand in for a real cluster; the
  # workers outlive the jobs, so each job's DoFns (and models) must be released at its end.
  from distributed import Client
  from pipelines.beam.dask_runner import pooled_instances
  worker_tmp = tmp_path / "worker_tmp"  # the workers' temp directory (shared-model files)
  worker_tmp.mkdir()
  address, started = _start_loopback_cluster(tmp_path, worker_tmp, nworkers=2)
  try:
    outputs = []
    for job in ("a", "b"):
      cfg = gsm8k_config.get_config("smoke=True,policy=sample_n")
      cfg.model.predictor = "fake"
      cfg.dataset.n = 5
      cfg.policy.n = 2
      cfg.runner.batch_size = 2
      cfg.runner.update(name="dask", address=address)
      summary = run(cfg, str(tmp_path / job), progress=False, report=False)
      assert summary["run"]["resumed"] is None  # the workers are not known to see local paths
      outputs.append(_lines(tmp_path / job / "results.jsonl"))
    # Relative paths, the launcher elsewhere than the workers: they read the workers' own
    # file of that name (its records scored, exit 0) and wrote the results there.
    launch = tmp_path / "launch"
    launch.mkdir()
    theirs = [{"question": f"What is {i} + 50?", "answer": f"#### {i + 50}"} for i in range(3)]
    ours = [{"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"} for i in range(3)]
    for where, rows in ((tmp_path, theirs), (launch, ours)):
      (where / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = gsm8k_config.get_config("smoke=True")
    cfg.model.predictor = "fake"
    cfg.dataset.update(name="gsm8k_jsonl", path="data.jsonl", n=0)
    cfg.runner.update(name="dask", address=address)
    cwd = os.getcwd()
    os.chdir(launch)
    try:
      run(cfg, "out_rel", progress=False, report=False)
    finally:
      os.chdir(cwd)
    references = [r["reference"] for r in _lines(launch / "out_rel" / "results.jsonl")]
    assert references == ["1", "2", "3"]  # ours (theirs: 50, 51, 52)
    assert not (tmp_path / "out_rel").exists()
    with Client(address, timeout=30) as client:
      assert set(client.run(pooled_instances).values()) == {0}
      assert len(client.nthreads()) == 2
    # Each job's shared-model files went with it (4 a job stayed in the workers' temp dir).
    assert not list(worker_tmp.glob("o1jax-*"))
  finally:
    for p in reversed(started):
      p.terminate()
      p.wait(timeout=30)
  cfg = gsm8k_config.get_config("smoke=True,policy=sample_n")
  cfg.model.predictor = "fake"
  cfg.dataset.n = 5
  cfg.policy.n = 2
  cfg.runner.batch_size = 2
  cfg.runner.direct_running_mode = "in_memory"
  run(cfg, str(tmp_path / "direct"), clock=FakeClock(), progress=False, report=False)
  direct = _without_timing(_lines(tmp_path / "direct" / "results.jsonl"))
  assert _without_timing(outputs[0]) == _without_timing(outputs[1]) == direct
  assert len(direct) == 10


def test_a_launcher_killed_with_kill_9_leaves_no_job_in_a_long_lived_cluster(tmp_path):
  """A launcher killed with kill -9 sends no release: the workers of a cluster that
  outlives its jobs kept the job's DoFns (their models) and its shared-model files for
  good. The scheduler sees the launcher's client go and sends the release
  (pipelines/beam/dask_release.py, a plugin the job registers)."""
  import signal
  import time

  from distributed import Client
  from pipelines.beam.dask_runner import pooled_instances
  worker_tmp = tmp_path / "worker_tmp"
  worker_tmp.mkdir()
  address, started = _start_loopback_cluster(tmp_path, worker_tmp, nworkers=1)
  try:
    cmd = kill_resume.command(tmp_path / "killed", "--config.runner.name=dask",
                              f"--config.runner.address={address}", "--config.runner.partitions=8")
    with Client(address, timeout=60) as client:
      client.wait_for_workers(1, timeout=60)
      launcher = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
      started.append(launcher)
      deadline = time.monotonic() + 120
      # A bundle done (its DoFns kept) and the shared model's files written (on a loaded
      # machine the files came a moment after the first pooled DoFn: the check failed once)
      while (sum(client.run(pooled_instances).values()) < 1
             or not list(worker_tmp.glob("o1jax-*"))):
        assert launcher.poll() is None and time.monotonic() < deadline, (
            "no bundle finished, or no shared model's files", list(worker_tmp.glob("*")))
        time.sleep(0.2)
      launcher.send_signal(signal.SIGKILL)
      launcher.wait()
      deadline = time.monotonic() + 60
      while sum(client.run(pooled_instances).values()) or list(worker_tmp.glob("o1jax-*")):
        assert time.monotonic() < deadline, (client.run(pooled_instances),
                                             list(worker_tmp.glob("o1jax-*")))
        time.sleep(0.2)
      # The plugin went with its job.
      plugins = client.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.plugins))
      assert not [p for p in plugins if p.startswith("o1jax-release-")], plugins
  finally:
    for p in reversed(started):
      p.terminate()
      p.wait(timeout=30)


def test_another_beam_release_is_a_one_line_error():
  from pipelines.beam.options import check_dask_beam_version
  check_dask_beam_version()  # the installed one
  check_dask_beam_version("2.77.3")
  for other in ("2.60.0", "2.78.0rc1", "3.0.0"):
    with pytest.raises(ValueError, match=rf"runner.name=dask needs apache-beam 2.77.x .*this is "
                                         rf"apache-beam {other}"):
      check_dask_beam_version(other)
