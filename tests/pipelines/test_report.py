"""`python -m pipelines.report` on run directories whose files are not what a run wrote."""

import json
import re

from pipelines.report import main


def _run_dir(root, name, summary_text, results_lines=()):
  d = root / name
  d.mkdir()
  (d / "summary.json").write_text(summary_text)
  (d / "results.jsonl").write_text("".join(line + "\n" for line in results_lines))
  return d


def test_corrupt_run_files_are_one_line_naming_file_and_line(tmp_path, capsys):
  # Before: a json.JSONDecodeError (or AttributeError) traceback without the file name.
  record = json.dumps({"example_id": "x", "sample_index": 0})
  cut = _run_dir(tmp_path, "cut", "{}", [record, record[:20]])
  bad_summary = _run_dir(tmp_path, "bad_summary", '{"task": ')
  listed = _run_dir(tmp_path, "listed", "[]")
  for d, message in [
      (cut, f"error: {cut}/results.jsonl line 2: not valid JSON (Expecting property name"),
      (bad_summary, f"error: {bad_summary}/summary.json: not valid JSON (Expecting value"),
      (listed, f"error: {listed}/summary.json: expected a JSON object, got list")]:
    assert main([str(d)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err


def test_run_files_of_another_shape_are_one_line_naming_them(tmp_path, capsys):
  # Before: IsADirectoryError, AttributeError ('list' object has no attribute 'get') or
  # KeyError ('task') tracebacks.
  lists = _run_dir(tmp_path, "lists", "{}", ["[1, 2]"])
  keyless = _run_dir(tmp_path, "keyless", "{}")
  folder = tmp_path / "folder"
  (folder / "summary.json").mkdir(parents=True)
  for d, message in [
      (lists, f"error: {lists}/results.jsonl line 1: expected a JSON object, got list\n"),
      (keyless, re.compile(rf"error: {re.escape(str(keyless))}: cannot report it \(KeyError: 'task', "
                           r"at report\.py:\d+\): summary.json or results.jsonl is not what a run "
                           r"wrote\n")),
      (folder, f"error: cannot read {folder}/summary.json: Is a directory\n")]:
    assert main([str(d)]) == 2
    err = capsys.readouterr().err
    assert message.fullmatch(err) if isinstance(message, re.Pattern) else err == message


def test_a_comparison_directory_that_cannot_be_written_is_one_line(tmp_path, capsys, monkeypatch):
  # Before: FileExistsError's traceback (--output_dir naming a file).
  import pipelines.report as report
  monkeypatch.setattr(report, "write_run_report", lambda d: d)  # the runs' own reports: not here
  runs = [str(_run_dir(tmp_path, name, "{}")) for name in ("a", "b")]
  blocker = tmp_path / "afile"
  blocker.write_text("")
  assert main([*runs, f"--output_dir={blocker}"]) == 2
  err = capsys.readouterr().err
  assert err == f"error: cannot write the comparison under {blocker}: File exists\n"


def test_a_run_directory_not_found_or_without_results_is_said(tmp_path, capsys, monkeypatch):
  import pipelines.report as report
  monkeypatch.setattr(report, "write_run_report", lambda d: d)
  only_summary = tmp_path / "only_summary"
  only_summary.mkdir()
  (only_summary / "summary.json").write_text("{}")
  assert main([str(tmp_path / "nope")]) == 2
  assert capsys.readouterr().err == (f"skipping (not found): ['{tmp_path}/nope']\n"
                                     f"error: no run directory with a summary.json\n")
  assert main([str(only_summary)]) == 0
  assert capsys.readouterr().err == (f"warning: {only_summary}/results.jsonl is missing: its report "
                                     f"has the summary only (no per-sample sections)\n")


def test_an_unfinished_run_and_a_cut_results_file_are_said(tmp_path, capsys, monkeypatch):
  # Before: "skipping (no summary.json)" without what to do; a results.jsonl cut at a line
  # boundary was reported as if whole.
  import pipelines.report as report
  monkeypatch.setattr(report, "write_run_report", lambda d: d)
  stopped = tmp_path / "stopped"
  (stopped / "store").mkdir(parents=True)
  cut = _run_dir(tmp_path, "cut", json.dumps({"samples": 3}), [json.dumps({"example_id": "x"})])
  assert main([str(stopped), str(cut)]) == 0
  err = capsys.readouterr().err
  assert (f"skipping (no summary.json): ['{stopped}'] (a run stopped before its end: run "
          f"pipelines.eval on it again to finish)\n") in err
  assert (f"warning: {cut}/results.jsonl holds 1 records where summary.json counts 3: the file "
          f"was cut or changed since the run") in err
