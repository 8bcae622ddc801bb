"""Resumability: SIGKILL a real `python -m pipelines.eval` run mid-way, rerun, compare."""

from tests.pipelines import kill_resume


def test_kill_9_then_rerun_finishes_without_recomputing(tmp_path):
  out = tmp_path / "killed"
  cmd = kill_resume.command(out, "--config.runner.direct_running_mode=in_memory",
                            "--config.runner.direct_num_workers=1")
  before = kill_resume.start_and_kill(out, cmd, whole_group=True)  # like a lost machine
  kill_resume.rerun_and_compare(out, cmd, before, tmp_path / "clean")
  assert (out / "report.md").exists()
