"""What a user sees from `python -m pipelines.eval`: one `error:` line and exit code 2 for bad
input, and a clean default output (progress bar, summary, errors) with the rest under --verbose."""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
FAKE = ["--config=configs/custom.py:smoke=True", "--config.model.predictor=fake"]
IN_MEMORY = ["--config.runner.direct_running_mode=in_memory", "--config.runner.direct_num_workers=1"]
# Python logging ("WARNING:root:..."), absl ("W1201 02:48:49.005 ..."), and tracebacks.
LOG_LINE = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL)[:\s]|^[DIWEF]\d{4} |Traceback|UserWarning|"
                      r"DeprecationWarning", re.M)


def _cli(*args, timeout=180, env=None):
  return subprocess.run([sys.executable, "-m", "pipelines.eval", *args], cwd=REPO, capture_output=True,
                        text=True, timeout=timeout, env=env)


def _data(tmp_path, n=3):
  path = tmp_path / "data.jsonl"
  path.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n"
                          for i in range(n)))
  return path


def _assert_one_error_line(proc, expected):
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert proc.stderr == f"error: {expected}\n"
  assert proc.stdout == ""


def test_help_is_printed_with_exit_status_0():
  # Before: absl's exit status 1 (a script checking `pipelines.eval --help` saw a failure).
  proc = _cli("--help")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "python -m pipelines.eval" in proc.stdout and "--output_dir" in proc.stdout


def test_a_rerun_refused_for_bad_input_keeps_the_previous_runs_log(tmp_path):
  # Before: the refused run's log replaced eval.log and was then deleted.
  (tmp_path / "out").mkdir()
  (tmp_path / "out" / "eval.log").write_text("the finished run's log\n")
  proc = _cli(*FAKE, f"--config.dataset.path={_data(tmp_path)}", "--config.policy.name=nosuch",
              f"--output_dir={tmp_path}/out")
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert (tmp_path / "out" / "eval.log").read_text() == "the finished run's log\n"
  assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["eval.log"]


def test_missing_config_file(tmp_path):
  proc = _cli(f"--config={tmp_path}/nope.py", f"--output_dir={tmp_path}/out")
  _assert_one_error_line(proc, f"config file not found: {tmp_path}/nope.py")


def test_broken_config_file(tmp_path):
  cfg = tmp_path / "broken.py"
  cfg.write_text("def get_config(:\n")
  proc = _cli(f"--config={cfg}", f"--output_dir={tmp_path}/out")
  assert proc.returncode == 2 and proc.stderr.startswith(f"error: config file {cfg} cannot be loaded: SyntaxError")
  assert proc.stderr.count("\n") == 1
  verbose = _cli(f"--config={cfg}", f"--output_dir={tmp_path}/out", "--verbose")
  assert verbose.returncode == 2 and "Traceback" in verbose.stderr  # the details on request


def test_a_get_config_that_raises_is_one_usage_error(tmp_path):
  # Before: exit 1 with the RuntimeError's traceback.
  from absl import app
  from pipelines.eval import load_config_file
  cfg = tmp_path / "raises.py"
  cfg.write_text("def get_config(arg=''):\n  raise RuntimeError('boom')\n")
  with pytest.raises(app.UsageError) as e:
    load_config_file(str(cfg), "smoke=True")
  assert str(e.value) == f"config file {cfg}: get_config('smoke=True') raised RuntimeError: boom"


def test_a_get_config_that_returns_none_is_one_line(tmp_path):
  # Before: absl's "Unexpected None value for flag config" traceback, exit 1, an eval.log.
  cfg = tmp_path / "none.py"
  cfg.write_text("def get_config(arg=''):\n  return None\n")
  proc = _cli(f"--config={cfg}", f"--output_dir={tmp_path}/out")
  _assert_one_error_line(proc, "config: get_config() must return an ml_collections.ConfigDict, "
                               "got NoneType")
  assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", ["missing_dataset", "empty_dataset", "unwritable_output", "bad_checkpoint"])
def test_bad_input_is_one_line_and_exit_2(tmp_path, case):
  data, out, extra = _data(tmp_path), tmp_path / "out", []
  if case == "missing_dataset":
    data = tmp_path / "missing.jsonl"
    expected = f"dataset file not found: {data}"
  elif case == "empty_dataset":
    data.write_text("")
    expected = f"dataset file is empty: {data}"
  elif case == "unwritable_output":
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "out"
    expected = f"output directory is not writable: {out} (Not a directory)"
  else:
    junk = tmp_path / "model.gguf"
    junk.write_bytes(b"\x00" * 4096)
    extra = ["--config.model.predictor=engine", f"--config.model.source={junk}"]
    expected = f"{junk}: not a GGUF file, and not a checkpoint directory"
  _assert_one_error_line(_cli(*FAKE, *IN_MEMORY, f"--config.dataset.path={data}", f"--output_dir={out}", *extra),
                         expected)


def test_default_output_is_clean_and_verbose_shows_the_rest(tmp_path):
  data = _data(tmp_path, n=4)
  # Two worker processes: where most of Beam's chatter comes from.
  args = [*FAKE, f"--config.dataset.path={data}", "--config.runner.direct_num_workers=2",
          "--config.runner.direct_running_mode=multi_processing", "--config.runner.batch_size=2"]
  proc = _cli(*args, f"--output_dir={tmp_path}/quiet")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert not LOG_LINE.search(proc.stderr), proc.stderr
  assert json.loads(proc.stdout)["examples"] == 4
  lines = [l for l in re.split(r"[\r\n]", proc.stderr) if l.strip()]
  assert all(l.startswith("eval:") for l in lines[:-1]), lines  # the progress bar
  assert lines[-1] == f"wrote results.jsonl, summary.json and report.md under {tmp_path}/quiet"
  # What Beam, absl and JAX logged is kept next to the results.
  assert (tmp_path / "quiet" / "eval.log").exists()

  verbose = _cli(*args, f"--output_dir={tmp_path}/loud", "--verbose")
  assert verbose.returncode == 0, verbose.stderr[-3000:]
  assert LOG_LINE.search(verbose.stderr)
  assert json.loads(verbose.stdout) == json.loads(proc.stdout)


def test_a_second_launcher_leaves_the_first_ones_log_alone(tmp_path):
  """Two launchers on one directory, the second started before the first took the run
  lock: the second emptied the first's eval.log.partial and, refused by the lock, deleted
  it (the first run's log was lost). Now the second logs elsewhere."""
  script = f"""
import os
from pipelines.eval import _LogFile
path = {str(tmp_path / "eval.log")!r}
first = _LogFile(path)
os.write(2, b"first run\\n")
second = _LogFile(path)
os.write(2, b"second run\\n")
print(second.path != first.path)
second.close(keep=False)  # refused by the run lock: deletes its own log only
os.write(2, b"first again\\n")
print(repr(open(first.close(move_to=path)).read()))
"""
  proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                        text=True, timeout=60)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.splitlines() == ["True", repr("first run\nfirst again\n")]
  assert sorted(p.name for p in tmp_path.iterdir()) == ["eval.log"]


def test_what_is_logged_after_a_stop_goes_to_the_log_not_the_terminal(tmp_path):
  """A stopping launcher put fd 2 back on the terminal before it exited: Beam's threads,
  still logging the stopped job, wrote KeyboardInterrupt tracebacks after the "stopped by"
  line (1 stop in 5)."""
  script = f"""
import os
from pipelines.eval import _LogFile
path = {str(tmp_path / "eval.log")!r}
log = _LogFile(path)
os.write(2, b"during the run\\n")
kept = log.close(move_to=path, exiting=True)
log.to_terminal("stopped by SIGINT\\n")
os.write(2, b"a late traceback\\n")
"""
  proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                        text=True, timeout=60)
  assert proc.returncode == 0 and proc.stderr == "stopped by SIGINT\n", proc.stderr
  assert (tmp_path / "eval.log").read_text() == "during the run\na late traceback\n"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_under_the_log_and_the_store_ends_the_run_in_one_line(tmp_path):
  """The disk that filled up held the store and eval.log: Beam's worker harness printed the
  failed bundle's traceback to fd 2 (the log) before it answered the runner, the print
  raised, and the run waited for the answer until killed. Now: one line, exit 2."""
  out = tmp_path / "out"
  out.mkdir()
  (out / "eval.log.partial").symlink_to("/dev/full")  # every write: ENOSPC
  args = [*FAKE, f"--config.dataset.path={_data(tmp_path, n=4)}",
          "--config.runner.direct_num_workers=2",
          "--config.runner.direct_running_mode=multi_processing", "--config.runner.batch_size=2",
          "--config.imports=tests.pipelines.full_store_disk", f"--output_dir={out}"]
  # As a launcher started from a process that launched in-process runs (this test process
  # after others): its pid came along in the environment, and the launcher took itself for
  # one of its workers.
  from pipelines.beam.worker import LAUNCHER_PID_ENV, mark_launcher
  mark_launcher()
  proc = _cli(*args, timeout=120, env={**os.environ, LAUNCHER_PID_ENV: os.environ[LAUNCHER_PID_ENV]})
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert re.fullmatch(rf"error: cannot write store record {out}/store/[0-9a-f]{{64}}\.json: No "
                      rf"space left on device", proc.stderr.splitlines()[-1]), proc.stderr[-3000:]


def test_a_run_that_scores_nothing_exits_1(tmp_path):
  out = tmp_path / "out"
  proc = _cli(*FAKE, *IN_MEMORY, f"--config.dataset.path={_data(tmp_path)}",
              "--config.imports=tests.pipelines.refusing_predictor",
              "--config.model.predictor=refusing", f"--output_dir={out}")
  assert proc.returncode == 1, proc.stderr[-3000:]
  summary = json.loads(proc.stdout)
  assert summary["accuracy"] == {} and summary["policy"] == "greedy"  # (was null: no record)
  assert proc.stderr.splitlines()[-1] == (f"error: no sample was scored: all 3 dead letters (each "
                                          f"with its reason) are in {out}/dead_letters.jsonl")
  assert len((out / "dead_letters.jsonl").read_text().splitlines()) == 3


def test_a_run_whose_sandbox_failed_for_every_program_exits_1():
  from pipelines.eval import run_failure
  from pipelines.summary import summarize

  def record(i, status):
    return {"example_id": f"h{i}", "example_index": i, "sample_index": 0, "policy": "greedy",
            "reference": None, "answer": "", "correct": status == "passed", "tokens": {},
            "finish_reason": "stop", "score": {"status": status,
                                               "sandbox_error": status == "sandbox_error"}}

  broken = summarize([record(0, "sandbox_error"), record(1, "sandbox_error")], task="humaneval")
  assert broken["accuracy"] == {"pass@1": None}  # no verdict, not 0.0
  assert run_failure(broken, "out") == ("the sandbox failed for all 2 programs (status "
                                        "sandbox_error in out/results.jsonl): no sample has a verdict")
  some = summarize([record(0, "sandbox_error"), record(1, "failed")], task="humaneval")
  assert some["accuracy"] == {"pass@1": 0.0} and run_failure(some, "out") is None


def test_a_suite_category_whose_sandbox_failed_for_every_program_exits_1():
  # Before: a code-only suite run with every program a sandbox error exited 0.
  from pipelines.eval import run_failure
  from pipelines.summary import summarize

  def record(i, category, status="failed"):
    score = {"category": category, "status": status, "sandbox_error": status == "sandbox_error",
             "metrics": {"pass": 0.0, "exact_match": 1.0, "f1": 1.0}}
    return {"example_id": f"{category}{i}", "example_index": i, "sample_index": 0,
            "policy": "greedy", "reference": "x", "answer": "x", "correct": False,
            "tokens": {}, "finish_reason": "stop", "score": score}

  code = [record(0, "code", "sandbox_error"), record(1, "code", "sandbox_error")]
  qa = [record(2, "qa")]
  for records in (code, code + qa):
    summary = summarize(records, task="suite")
    assert summary["categories"]["code"]["sandbox_errors"] == 2
    assert run_failure(summary, "out") == (
        "the sandbox failed for all 2 programs of category code (sandbox_error in "
        "out/results.jsonl): it has no verdict")
  some = summarize([code[0], record(1, "code")] + qa, task="suite")
  assert some["categories"]["code"]["sandbox_errors"] == 1 and run_failure(some, "out") is None
  assert "sandbox_errors" not in summarize(qa, task="suite")["categories"]["qa"]


@pytest.mark.parametrize("args, message", [
    (["--config.sampling.top_k=abc"],
     "flag --config.sampling.top_k=abc: invalid literal for int() with base 10: 'abc'"),
    (["--config.runner.share_model=maybe"],
     "flag --config.runner.share_model=maybe: ('Non-boolean argument to boolean flag', 'maybe')"),
    (["--config.sampling.seed=1", "--config=configs/custom.py"],
     "Found --config.sampling.seed=1 in argv before a value for --config was specified"),
])
def test_override_values_that_do_not_parse_are_one_usage_error(args, message):
  # Before: absl's "FATAL Flags parsing error: ..." plus a help hint, exit code 1.
  from absl import app
  from pipelines.eval import validate_argv
  argv = ["eval", *(args if any(a.startswith("--config=") for a in args) else [FAKE[0], *args]),
          "--output_dir=x", "--verbose", "--", "--runner=DirectRunner"]
  with pytest.raises(app.UsageError) as e:
    validate_argv(argv)
  assert str(e.value) == message
  validate_argv(["eval", FAKE[0], "--config.sampling.top_k=3", "--config.runner.share_model",
                 "--output_dir=x", "--", "--direct_num_workers=abc"])  # Beam's flags are Beam's


def test_the_workers_project_warnings_reach_the_console(tmp_path):
  # Worker processes log to eval.log; the project's warnings there (a KV pool capped by the
  # device's memory, a slow fallback kernel) are shown once each after the run.
  from pipelines.eval import worker_warnings
  log = tmp_path / "eval.log"
  log.write_text(
      "WARNING:root:apitools not found\n"
      "WARNING:o1jax.engine.engine:engine: 64 slots x 8192 tokens need 40000 KV blocks; using 20000\n"
      "INFO:o1jax.engine.engine:not a warning\n"
      "WARNING:pallas_kernels.ops:matmul_dtype=int8 runs the XLA reference here\n"
      "WARNING:o1jax.engine.engine:engine: 64 slots x 8192 tokens need 40000 KV blocks; using 20000\n"
      "WARNING:apache_beam.options.pipeline_options:Discarding unparseable args\n")
  assert worker_warnings(str(log)) == [
      "engine: 64 slots x 8192 tokens need 40000 KV blocks; using 20000",
      "matmul_dtype=int8 runs the XLA reference here"]
  assert worker_warnings(str(log), limit=1)[1] == f"1 more warnings in {log}"
  assert worker_warnings(None) == [] and worker_warnings(str(tmp_path / "missing.log")) == []


@pytest.mark.parametrize("stray", ["configs/humaneval.py", "foo"])
def test_a_stray_argument_is_one_usage_error(tmp_path, stray):
  # Before: it went to Beam's options and the default job ran (exit 0), e.g. a config file
  # given without --config=.
  proc = _cli(stray, f"--output_dir={tmp_path}/out", "--", "--direct_num_workers=1")
  _assert_one_error_line(proc, f"unexpected argument {stray!r}: options are --name=value (a "
                               f"config file: --config={stray}); Beam's options go after --")
  assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("variant, message", [
    ("smoke=Ture", "config variant smoke='Ture': expected true or false (one of 1, true, yes, "
                   "on, 0, false, no, off)"),
    ("fast=2", "config variant fast='2': expected true or false (one of 1, true, yes, on, 0, "
               "false, no, off)")])
def test_a_true_false_variant_spelled_otherwise_is_one_usage_error(tmp_path, variant, message):
  # Before: any other spelling meant False, and the other job ran.
  from absl import app
  from pipelines.eval import validate_argv
  for config in ("gsm8k", "humaneval", "custom", "suite"):
    with pytest.raises(app.UsageError) as e:
      validate_argv(["eval", f"--config=configs/{config}.py:{variant}", "--output_dir=x"])
    assert str(e.value) == message
  validate_argv(["eval", "--config=configs/gsm8k.py:smoke=YES,fast=off", "--output_dir=x"])


def test_max_new_tokens_a_controller_policy_does_not_use_is_refused(tmp_path):
  # Before: ignored without a word (the traces had their usual length), and every sample
  # was computed again (the section is part of the content key).
  proc = _cli("--config=configs/gsm8k.py:policy=self_consistency,smoke=True",
              "--config.sampling.max_new_tokens=4", f"--output_dir={tmp_path}/out")
  _assert_one_error_line(proc, "sampling.max_new_tokens=4 is not used: policy self_consistency "
                               "bounds each trace by its own max_thinking_tokens and "
                               "max_answer_tokens; set policy.max_thinking_tokens instead")
  from pipelines.eval import check_unused_overrides, load_config_file
  plain = load_config_file("configs/gsm8k.py", "smoke=True")  # (greedy: per sample, used)
  check_unused_overrides(plain, ["eval", "--config.sampling.max_new_tokens=4"])
  # A budget setting with a fixed budget; a policy's own live budget beside the
  # controller's (both ran without a word; the policy's SLO was in the content key).
  with pytest.raises(ValueError, match=r"^budget.latency_slo_s is not used: budget.mode is "
                                       r"fixed; add --config.budget.mode=adaptive$"):
    check_unused_overrides(plain, ["eval", "--config.budget.latency_slo_s=0.001"])
  tvb = load_config_file("configs/gsm8k.py", "policy=think_verify_backtrack,smoke=True")
  tvb.policy.adaptive = True
  tvb.budget.mode = "adaptive"
  with pytest.raises(ValueError, match=r"^policy.adaptive=True runs the policy's own budget"):
    check_unused_overrides(tvb, ["eval"])
  tvb.policy.adaptive = False
  check_unused_overrides(tvb, ["eval", "--config.budget.mode=adaptive",
                               "--config.budget.latency_slo_s=2"])
  # absl reads one dash as two: so do the checks (the budget setting ran unchecked).
  proc = _cli("--config=configs/gsm8k.py:smoke=True", "-config.budget.latency_slo_s=2",
              f"--output_dir={tmp_path}/one_dash")
  _assert_one_error_line(proc, "budget.latency_slo_s is not used: budget.mode is fixed; add "
                               "--config.budget.mode=adaptive")


@pytest.mark.parametrize("flag, value, message", [
    ("speculative.max_drafts", 2, "speculative.max_drafts is not used: speculative.enabled is False"),
    ("controller.cache", "contiguous",
     "controller.cache is not used: policy greedy does not run the reasoning controller"),
    ("sampling.top_k", 5, "sampling.top_k is not used: sampling.temperature is 0 (greedy decoding)"),
    ("model.fake_delay_s", 1.0, "model.fake_delay_s is not used: model.predictor is 'engine'"),
])
def test_a_setting_the_run_would_not_read_is_said(flag, value, message):
  # Before: accepted without a word; the summary showed top_k: 5 / max_drafts: 2 for a
  # plain greedy run. A warning, not an error: a sweep gives every run of its grid the
  # same settings (top_p=0.95 at each temperature, 0 included).
  from pipelines.eval import unused_override_warnings, load_config_file
  config = load_config_file("configs/gsm8k.py", "smoke=True")
  section, field = flag.split(".")
  config[section][field] = value
  assert unused_override_warnings(config, ["eval", f"--config.{flag}={value}"]) == [message]


def test_settings_the_run_reads_or_left_at_their_defaults_are_not_said():
  from pipelines.eval import unused_override_warnings, load_config_file
  greedy = load_config_file("configs/gsm8k.py", "smoke=True")
  # At their defaults, or a seed (harmless under greedy decoding): nothing said.
  assert unused_override_warnings(greedy, [
      "eval", "--config.sampling.top_p=1.0", "--config.sampling.seed=7",
      "--config.speculative.drafter=prompt_lookup", "--config.controller.cache=paged",
      "--config.model.fake_delay_s=0"]) == []
  greedy.sampling.temperature, greedy.sampling.top_k = 0.7, 5  # (sampling: its filters are read)
  assert unused_override_warnings(greedy, ["eval", "--config.sampling.top_k=5"]) == []
  greedy.speculative.update(enabled=True, max_drafts=2)
  assert unused_override_warnings(greedy, ["eval", "--config.speculative.enabled=True",
                                           "--config.speculative.max_drafts=2"]) == []
  voting = load_config_file("configs/gsm8k.py", "policy=self_consistency,smoke=True")
  voting.controller.cache = "contiguous"
  assert unused_override_warnings(voting, ["eval", "--config.controller.cache=contiguous"]) == []
  voting.model.update(predictor="fake", fake_delay_s=1.0)
  assert unused_override_warnings(voting, ["eval", "--config.model.fake_delay_s=1"]) == []


def test_an_unused_setting_is_a_warning_line_and_the_run_goes_on(tmp_path):
  proc = _cli(*FAKE, *IN_MEMORY, f"--config.dataset.path={_data(tmp_path)}",
              "--config.speculative.max_drafts=2", f"--output_dir={tmp_path}/out")
  assert proc.returncode == 0, proc.stderr
  assert ("warning: speculative.max_drafts is not used: speculative.enabled is False"
          in proc.stderr.splitlines())


def test_a_huge_trace_count_is_refused_before_the_model_loads(tmp_path):
  # Before: n=100,000,000 passed the plan; a worker found the loop's memory too big ~30 s later.
  proc = _cli("--config=configs/gsm8k.py:policy=self_consistency,smoke=True",
              "--config.policy.n=100000000", f"--output_dir={tmp_path}/out")
  assert proc.returncode == 2 and "n must be an int in [1, 100000], got 100000000" in proc.stderr
  assert "model" not in proc.stderr.split("n must be")[1]
  assert len(proc.stderr.strip().splitlines()) == 1


def test_a_run_stopped_by_its_dataset_changing_keeps_its_log(tmp_path):
  """The job ran (its workers' log is evidence, as after a write error): the stop deleted
  eval.log as a refused run's."""
  import time
  data = _data(tmp_path, n=4)
  out = tmp_path / "out"
  proc = subprocess.Popen(
      [sys.executable, "-m", "pipelines.eval", *FAKE, *IN_MEMORY, f"--config.dataset.path={data}",
       "--config.model.fake_delay_s=1.0", "--config.runner.batch_size=1", f"--output_dir={out}"],
      cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.monotonic() + 120
    while not list((out / "store").glob("*.json")) and proc.poll() is None:
      assert time.monotonic() < deadline
      time.sleep(0.05)
    with open(data, "a") as f:  # the workers read it: the job is under way
      f.write(json.dumps({"question": "What is 9 + 1?", "answer": "10"}) + "\n")
    _, stderr = proc.communicate(timeout=120)
  finally:
    proc.kill()
  assert proc.returncode == 2, stderr[-2000:]
  assert stderr.splitlines()[-1].startswith(f"error: dataset file {data} changed while the job ran")
  assert (out / "eval.log").is_file()
  assert not (out / "results.jsonl").exists()


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_while_starting_is_one_line(tmp_path, sig):
  """Sent once the launcher catches SIGTERM (its first act, with SIGINT, before the ~1.5 s
  of imports): the same one line for SIGTERM as for Ctrl-C (SIGTERM there ended it with no
  word, exit 143; Python catches SIGINT from its start)."""
  import signal
  import time
  proc = subprocess.Popen([sys.executable, "-m", "pipelines.eval", *FAKE,
                           f"--output_dir={tmp_path}/out"],
                          cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.monotonic() + 60
    caught = 0
    while not caught >> (signal.SIGTERM - 1) & 1:  # /proc's SigCgt: the signals it catches
      assert time.monotonic() < deadline and proc.poll() is None
      status = pathlib.Path(f"/proc/{proc.pid}/status").read_text()
      caught = int(re.search(r"^SigCgt:\s*([0-9a-f]+)", status, re.M).group(1), 16)
    proc.send_signal(getattr(signal, sig))
    _, stderr = proc.communicate(timeout=60)
  finally:
    proc.kill()
  assert proc.returncode == 128 + getattr(signal, sig)
  assert stderr == f"stopped by {sig} while starting: nothing was computed\n"
