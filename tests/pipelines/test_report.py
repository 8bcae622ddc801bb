"""`python -m pipelines.report` on run directories whose files are not what a run wrote."""

import json
import re

import pytest

from pipelines import report
from pipelines.report import main
from pipelines.summary import summarize

_MINIMAL_SUMMARY = {"task": "gsm8k", "examples": 0, "samples": 0, "tokens": {}, "latency_ms": {},
                    "throughput": {}}


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
  runs = [str(_run_dir(tmp_path, name, json.dumps(_MINIMAL_SUMMARY))) for name in ("a", "b")]
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


def _record(i, output, answer="5", reference="5", **extra):
  return {"key": f"k{i}", "example_id": f"e{i}", "example_index": i, "sample_index": 0,
          "task": "gsm8k", "policy": "greedy", "reference": reference, "answer": answer,
          "correct": answer == reference, "output": output, "finish_reason": "stop",
          "score": {"strict_answer": answer, "flexible_answer": answer,
                    "strict_correct": answer == reference, "flexible_correct": answer == reference},
          "tokens": {"prompt": 10, "completion": 4}, "trace": {},
          "timing": {"start_ms": 0.0, "end_ms": 10.0, "latency_ms": 10.0}, **extra}


def _write_run(d, records, dead=(), task="gsm8k", **kwargs):
  d.mkdir(parents=True)
  summary = summarize(records, list(dead), task=task, config={"dataset": {"name": "x"}}, **kwargs)
  (d / "summary.json").write_text(json.dumps(summary))
  (d / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  if dead:
    (d / "dead_letters.jsonl").write_text("".join(json.dumps(x) + "\n" for x in dead))
  return d


def _rendered(markdown_text):
  """The report as a CommonMark renderer reads it (markdown-it, a dependency of rich)."""
  markdown_it = pytest.importorskip("markdown_it")
  return markdown_it.MarkdownIt("commonmark").render(markdown_text)


def test_model_and_dead_letter_text_cannot_change_the_report(tmp_path):
  """A bare CR then "<!--" in a model's output hid every section after it (the report
  read on as one HTML comment); a dead letter's multi-line reason added a heading;
  an example id was raw HTML. Each now reads as the text it is, on its line."""
  records = [_record(0, "The answer is 5.\r<!-- model said this"),
             _record(1, "x <img src=x onerror=alert(1)> `code` *a* [l](javascript:x) a|b\u2028# H"),
             _record(2, "fine", **{"example_id": "<b>e2</b>"})]
  dead = [{"stage": "inference", "reason": "boom\n# DL HEADING\n<!--", "example_id": "e9",
           "sample_index": 0}]
  path = report.write_run_report(_write_run(tmp_path / "run", records, dead))
  html = _rendered(path.read_text())
  assert "<h2>Config</h2>" in html and "<h2>Sample outputs</h2>" in html
  assert "<h1>DL HEADING</h1>" not in html and "<h1>H</h1>" not in html
  assert "<!--" not in html and "<img src=x" not in html and "<b>" not in html
  assert 'href="javascript' not in html
  assert "&lt;!-- model said this" in html and "&lt;b&gt;e2&lt;/b&gt;" in html


def test_humaneval_code_is_a_block_and_no_reference_is_shown(tmp_path):
  """A reply's code in single backticks broke at its first blank line (the list ended, a
  stray code span followed), and every HumanEval sample read "reference `None`"."""
  code = "def f(x):\n\n    return x  # `tick`\n"
  # (a CR inside the code hid every later section as one HTML comment)
  sneaky = "line one\nline two\r<!-- hidden"
  rec = _record(0, "```python\n" + code + "```", answer=code, reference=None)
  rec.update(task="humaneval", correct=True, score={"status": "passed", "passed": True})
  d = _write_run(tmp_path / "he", [rec], task="humaneval")
  text = report.write_run_report(d).read_text()
  assert "reference" not in text.split("## Sample outputs")[1].split("## Config")[0]
  html = _rendered(text)
  assert "<code class=\"language-python\">def f(x):\n\n    return x  # `tick`\n</code>" in html
  rec2 = _record(1, "x", answer=sneaky, reference=None)
  rec2.update(task="humaneval", correct=False, score={"status": "failed", "passed": False})
  d2 = _write_run(tmp_path / "he2", [rec2], task="humaneval")
  html = _rendered(report.write_run_report(d2).read_text())
  assert "<h2>Config</h2>" in html and "<!--" not in html


def test_md_helpers_by_hand():
  assert report.md_code("a`b``c") == "```a`b``c```"
  assert report.md_code("`x") == "`` `x ``"
  assert report.md_text("1\r2\u20283\x854 <a>") == "1 2 3 4 \\<a\\>"
  assert report.md_block("a\n```\nb", "py", "  ") == "  ````py\n  a\n  ```\n  b\n  ````"
  # (a bare CR ended the block's indented line: "<!--" then began a line of its own)
  assert report.md_block("x\ry\u2028z\n\n", "", "  ") == "  ```\n  x\n  y\n  z\n  ```"
  assert report.markdown_table([["a|b", None]], ["x", "y"]) == "| x | y |\n|---|---|\n| a\\|b |  |"


def test_a_run_named_twice_is_reported_once_and_compared_with_nothing(tmp_path, capsys):
  """`report a a` (or `a a/`) wrote a one-run comparison.md into the run's own directory."""
  d = _write_run(tmp_path / "a", [_record(0, "The answer is 5.")])
  assert main([str(d), str(d) + "/"]) == 0
  out = capsys.readouterr().out
  assert out.count("report.md") == 1
  assert not (d / "comparison.md").exists() and not (d / "accuracy_vs_cost.png").exists()


@pytest.mark.parametrize("field, value, named", [
    ("data_sha256", ["x"], "data_sha256 is ['x'], not a string"),
    ("config", {"speculative": "yes"}, "AttributeError"),
    ("throughput", {"span_s": "abc", "samples_computed": 1}, "TypeError"),
    ("examples", True, "its examples is True, not a number")])
def test_a_summary_the_comparison_cannot_read_is_one_line_and_left_out(tmp_path, capsys, monkeypatch,
                                                                        field, value, named):
  """Each of these ended the comparison in a traceback (the run's own report was written)."""
  monkeypatch.setattr(report, "write_run_report", lambda d: d)
  good = [_write_run(tmp_path / n, [_record(0, "The answer is 5.")]) for n in ("g1", "g2")]
  bad = _write_run(tmp_path / "bad", [_record(0, "The answer is 5.")])
  summary = json.loads((bad / "summary.json").read_text())
  summary[field] = value
  (bad / "summary.json").write_text(json.dumps(summary))
  assert main([*map(str, good), str(bad), f"--output_dir={tmp_path / 'cmp'}"]) == 2
  err = capsys.readouterr().err.splitlines()
  assert len(err) == 1 and err[0].startswith(f"error: {bad}: cannot compare it (") and named in err[0]
  assert "bad" not in (tmp_path / "cmp" / "comparison.md").read_text()


def test_records_that_are_not_the_summarys_are_said(tmp_path, capsys, monkeypatch):
  """Another run's records under this summary (same count), or one sample twice, passed
  without a word: the report then showed the other run's paths under this one's title."""
  monkeypatch.setattr(report, "write_run_report", lambda d: d)
  d = _write_run(tmp_path / "a", [_record(0, "x"), _record(1, "y")])
  foreign = [_record(0, "x", policy="self_consistency"), _record(0, "x", policy="self_consistency")]
  (d / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in foreign))
  assert main([str(d)]) == 0
  assert capsys.readouterr().err == (
      f"warning: {d}/results.jsonl holds records of policy self_consistency where summary.json's "
      f"is greedy; 1 samples recorded twice: the file was cut or changed since the run "
      f"(pipelines.eval on the directory writes both again from its store)\n")


def test_non_finite_numbers_are_not_a_runs_json(tmp_path, capsys):
  """A NaN accuracy stood on both Pareto frontiers (nothing beats NaN); a run writes strict
  JSON, so NaN or Infinity is an edited or foreign file."""
  d = _write_run(tmp_path / "a", [_record(0, "x")])
  (d / "summary.json").write_text((d / "summary.json").read_text().replace('"span_s": 0.01', '"span_s": NaN'))
  assert main([str(d)]) == 2
  assert capsys.readouterr().err == f"error: {d}/summary.json: not valid JSON (NaN is not JSON)\n"


def test_the_comparison_says_what_each_accuracy_leaves_out(tmp_path, capsys):
  """A run that lost 5 of its 8 examples to dead letters stood above a full run with no
  word of it but its example count."""
  full = _write_run(tmp_path / "full", [_record(i, "x", answer="5" if i < 2 else "6") for i in range(8)])
  dead = [{"stage": "inference", "reason": "x", "example_id": f"e{i}", "sample_index": 0} for i in range(3, 8)]
  half = _write_run(tmp_path / "half", [_record(i, "x", answer="5" if i < 2 else "6") for i in range(3)], dead)
  assert main([str(full), str(half)]) == 0
  table = [line for line in (tmp_path / "comparison.md").read_text().splitlines() if line.startswith("|")]
  assert table[0].startswith("| run | task | examples | unscored | samples | accuracy |")
  rows = {line.split(" | ")[0]: line.split(" | ") for line in table[2:]}
  assert rows["| greedy (full)"][3] == "0" and rows["| greedy (half)"][3] == "5"


def test_a_failed_report_leaves_no_old_one(tmp_path, capsys):
  d = _write_run(tmp_path / "a", [_record(0, "x")], [{"stage": "inference", "reason": "x",
                                                      "example_id": "e1", "sample_index": 0}])
  (d / "report.md").write_text("last time's report")
  (d / "dead_letters.jsonl").write_text('{"stage": "infer')  # cut
  assert main([str(d)]) == 2
  assert not (d / "report.md").exists()


def test_a_run_still_going_is_not_called_stopped(tmp_path, capsys):
  """A directory whose run holds its lock was "a run stopped before its end: run
  pipelines.eval on it again", which that eval refuses as in use."""
  import fcntl
  import os

  from pipelines.eval import LOCK_NAME
  going, stopped = tmp_path / "going", tmp_path / "stopped"
  for d in (going, stopped):
    (d / "store").mkdir(parents=True)
    (d / LOCK_NAME).write_text("")
  fd = os.open(going / LOCK_NAME, os.O_RDWR)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX)  # (a probe from this process's other fd is refused too)
    assert main([str(going), str(stopped)]) == 2
  finally:
    os.close(fd)
  err = capsys.readouterr().err
  assert f"{going}: a run still going; report it when it ends" in err
  assert "a run stopped before its end" in err  # (the other one)
