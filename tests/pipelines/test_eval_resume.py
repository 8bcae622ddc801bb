"""Resumability: SIGKILL a real `python -m pipelines.eval` run mid-way, rerun, compare."""

from tests.pipelines import kill_resume


def test_kill_9_then_rerun_finishes_without_recomputing(tmp_path):
  out = tmp_path / "killed"
  cmd = kill_resume.command(out, "--config.runner.direct_running_mode=in_memory",
                            "--config.runner.direct_num_workers=1")
  before = kill_resume.start_and_kill(out, cmd, whole_group=True)  # like a lost machine
  kill_resume.rerun_and_compare(out, cmd, before, tmp_path / "clean")
  assert (out / "report.md").exists()


# -- resume against a damaged, shared or reused output directory (in-process, fake model) --

import builtins
import io
import json
import os
import pathlib
import re
import shutil
from unittest import mock

import pytest

from configs import custom as custom_config
from pipelines.beam.store import OutputError, WriteError
from pipelines.beam.testing import FakeClock
from pipelines.eval import LOCK_NAME, _LogFile, lock_output_dir, run

ADDED = json.dumps({"question": "What is 6 + 6?", "answer": "12"})


def _config(data, policy="sample_n", **dataset):
  cfg = custom_config.get_config(f"smoke=True,policy={policy}")
  cfg.model.predictor = "fake"
  cfg.dataset.update(path=str(data), **dataset)
  cfg.runner.update(direct_num_workers=1, direct_running_mode="in_memory", batch_size=2)
  if policy == "sample_n":
    cfg.policy.n = 2
  return cfg


def _run(cfg, out):
  console = io.StringIO()
  summary = run(cfg, str(out), clock=FakeClock(), progress=False, report=False, console=console)
  return summary, console.getvalue()


def _records(out) -> list[dict]:
  return [json.loads(l) for l in (pathlib.Path(out) / "results.jsonl").read_text().splitlines()]


def _same(out, clean) -> bool:
  strip = lambda rs: [{k: v for k, v in r.items() if k != "timing"} for r in rs]
  return strip(_records(out)) == strip(_records(clean))


@pytest.fixture(scope="module")
def finished(tiny, tmp_path_factory):
  """(dataset, a finished 3 x 2-sample run's directory) from conftest's questions."""
  root = tmp_path_factory.mktemp("finished")
  data = root / "q.jsonl"
  shutil.copy(tiny / "q.jsonl", data)
  _run(_config(data), root / "clean")
  return data, root / "clean"


def _copy(finished, dest):
  shutil.copytree(finished[1], dest)
  return dest, sorted(p.name for p in (dest / "store").glob("*.json"))


def _signed(record):
  """A record as the store writes it (its checksum over the rest): what a writer of a wrong
  record would leave, rather than an edit of a right one."""
  from pipelines.beam.store import CHECKSUM_FIELD, record_digest
  record = {k: v for k, v in record.items() if k != CHECKSUM_FIELD}
  return json.dumps({**record, CHECKSUM_FIELD: record_digest(record)})


def _other_sample(store, keys):
  """The record of another example than keys[0]'s, under keys[0]'s key."""
  a = json.loads((store / keys[0]).read_bytes())
  b = next(r for r in (json.loads((store / k).read_bytes()) for k in keys)
           if r["example_id"] != a["example_id"])
  return _signed({**b, "key": a["key"]}), (f"is the record of another sample (example_id "
                                           f"{b['example_id']!r}, expected {a['example_id']!r})")


def _edited(store, keys, **changes):
  """keys[0]'s record with fields changed after it was written (its checksum kept)."""
  return json.dumps({**json.loads((store / keys[0]).read_bytes()), **changes}), (
      "does not match its checksum (edited or damaged)")


DAMAGE = {  # name -> (store dir, sorted file names) -> (bytes written to the first, warning)
    "half_line": lambda s, k: ((s / k[0]).read_bytes()[:40], "is not valid JSON (truncated or damaged)"),
    "zero_bytes": lambda s, k: (b"", "is empty"),
    "nul_bytes": lambda s, k: (b"\0" * 512, "holds no JSON (blank or NUL bytes)"),
    "json_list": lambda s, k: (b"[1, 2]\n", "holds a JSON list, not a record"),
    "other_key": lambda s, k: ((s / k[1]).read_bytes(), f"holds the record of another key ({k[1][:16]!r})"),
    "other_sample": lambda s, k: _other_sample(s, k),
    "old_layout": lambda s, k: (_signed({x: v for x, v in json.loads((s / k[0]).read_bytes()).items()
                                         if x != "trace"}), "is not a result record (missing trace)"),
    # Valid JSON of the right key, changed since: was resumed as it was (the summary then
    # disagreed with itself).
    "edited_output": lambda s, k: _edited(s, k, output="something else"),
    "flipped_correct": lambda s, k: _edited(s, k, correct=not json.loads((s / k[0]).read_bytes())["correct"]),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_store_record_is_named_recomputed_and_replaced(finished, tmp_path, damage):
  out, names = _copy(finished, tmp_path / "run")
  data, written = DAMAGE[damage](out / "store", names)
  (out / "store" / names[0]).write_bytes(data.encode() if isinstance(data, str) else data)
  summary, console = _run(_config(finished[0]), out)
  assert console == f"warning: store record {out}/store/{names[0]} {written}; it is recomputed\n"
  assert (summary["run"]["resumed"], summary["run"]["computed"]) == (5, 1)
  assert summary["dead_letters"]["total"] == 0 and _same(out, finished[1])
  assert json.loads((out / "store" / names[0]).read_bytes())["key"] == names[0][:-len(".json")]


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a chmod 000 file")
def test_unreadable_store_record_is_named_and_recomputed(finished, tmp_path):
  out, names = _copy(finished, tmp_path / "run")
  (out / "store" / names[0]).chmod(0)
  summary, console = _run(_config(finished[0]), out)
  assert console == (f"warning: store record {out}/store/{names[0]} cannot be read "
                     f"(Permission denied); it is recomputed\n")
  assert summary["run"]["computed"] == 1 and _same(out, finished[1])


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_store_record_that_is_no_regular_file_is_named_and_replaced(finished, tmp_path, kind):
  """A FIFO in a record's place hung the launcher's scan (its open waited for a writer); a
  link to /dev/zero would have read forever."""
  out, names = _copy(finished, tmp_path / "run")
  path = out / "store" / names[0]
  path.unlink()
  if kind == "fifo":
    os.mkfifo(path)
  elif os.path.exists("/dev/zero"):
    path.symlink_to("/dev/zero")
  else:
    pytest.skip("no /dev/zero")
  summary, console = _run(_config(finished[0]), out)
  assert console == (f"warning: store record {path} is not a regular file (a FIFO, a socket or "
                     f"a device); it is recomputed\n")
  assert summary["run"]["computed"] == 1 and _same(out, finished[1])
  assert path.is_file() and not path.is_symlink()


def test_temporary_files_of_killed_writes_are_removed_by_the_next_run(finished, tmp_path):
  """A worker killed mid-write left KEY.json.PID.XXXXXXXX.tmp in the store for good."""
  out, names = _copy(finished, tmp_path / "run")
  stale = out / "store" / f"{names[0]}.4242.0badf00d.tmp"
  stale.write_bytes(b'{"key": "half a rec')
  other = out / "store" / "notes.tmp"  # not a name the store writes: left alone
  other.write_text("mine\n")
  summary, console = _run(_config(finished[0]), out)
  assert console == "" and summary["run"]["resumed"] == 6
  assert not stale.exists() and other.read_text() == "mine\n"


def test_a_rerun_that_computes_nothing_keeps_the_measured_throughput(finished, tmp_path):
  """A rerun of a finished run rewrote summary.json with "0 samples in 0.0 s": the run's
  seconds per example (the report's cost axis) were gone; now it keeps the measurement of
  the run that computed them, marked so, and the report says which."""
  out, _ = _copy(finished, tmp_path / "again")
  before = json.loads((out / "summary.json").read_text())
  assert before["throughput"]["samples_computed"] == 6 and before["throughput"]["span_s"] > 0
  rerun = lambda: run(_config(finished[0]), str(out), clock=FakeClock(start_ms=9e6),
                      progress=False, report=False, console=io.StringIO())  # (a later time)
  summary = rerun()
  assert summary["run"]["computed"] == 0
  assert summary["throughput"] == {**before["throughput"],
                                   "measured_in_run_started_ms": before["run"]["started_ms"]}
  from pipelines.report import write_run_report
  write_run_report(out)
  assert "Computed this run: 0 samples (an earlier run computed 6 in " in (out / "report.md").read_text()
  summary = rerun()  # and again: still the first run's measurement
  assert summary["throughput"]["measured_in_run_started_ms"] == before["run"]["started_ms"]
  from pipelines.report import recomputed_line
  assert recomputed_line({"throughput": {**summary["throughput"], "recomputed_tokens": 50}}) == ""
  # Another config resumed from the same store (a setting outside the samples' keys) is
  # not the measured config: no carry-over (it took another config's seconds).
  other = _config(finished[0])
  other.runner.batch_size = 3
  summary = run(other, str(out), clock=FakeClock(start_ms=9e6), progress=False, report=False,
                console=io.StringIO())
  assert summary["run"]["computed"] == 0 and summary["throughput"]["samples_computed"] == 0
  assert "measured_in_run_started_ms" not in summary["throughput"]
  # A run that computes something measures itself.
  lines = (finished[0]).read_text() + ADDED + "\n"
  (tmp_path / "more.jsonl").write_text(lines)
  summary, _ = _run(_config(tmp_path / "more.jsonl"), tmp_path / "more")
  assert "measured_in_run_started_ms" not in summary["throughput"]


def test_greedy_records_stored_with_the_31_bit_request_ids_are_resumed(finished, tmp_path):
  """The request ids became 64 bits (2026-12-07): a greedy sample draws nothing from its
  stream, so its key stayed, but its stored record named the 31-bit id and every one was
  called damaged and computed again. Sampled records have new keys (request_stream)."""
  from pipelines.beam import ResultStore
  from pipelines.predictors import request_id_before_2026_12_07
  clean = tmp_path / "clean"
  _run(_config(finished[0], policy="greedy"), clean)
  out = tmp_path / "run"
  shutil.copytree(clean, out)
  store = ResultStore(str(out / "store"))
  for path in (out / "store").glob("*.json"):
    record, problem = store.read(path.stem)
    assert problem is None
    old = request_id_before_2026_12_07(record["example_id"], record["sample_index"])
    assert record["trace"]["request_id"] != old
    store.put(path.stem, {**record, "trace": {**record["trace"], "request_id": old}})
  summary, console = _run(_config(finished[0], policy="greedy"), out)
  assert console == "" and (summary["run"]["resumed"], summary["run"]["computed"]) == (3, 0)
  assert _same(out, clean)  # the resumed records carry the new ids


def test_store_directory_replaced_by_a_file_is_one_line_before_any_work(finished, tmp_path):
  out, _ = _copy(finished, tmp_path / "run")
  shutil.rmtree(out / "store")
  (out / "store").write_text("not a directory\n")
  with pytest.raises(OutputError) as e:
    _run(_config(finished[0]), out)
  assert str(e.value) == f"output directory is not writable: {out}/store (a file is in the way)"
  assert (out / "results.jsonl").exists()  # nothing touched


def test_store_record_path_taken_by_a_directory_stops_with_one_line(finished, tmp_path):
  out, names = _copy(finished, tmp_path / "run")
  (out / "store" / names[0]).unlink()
  (out / "store" / names[0]).mkdir()
  before = (out / "results.jsonl").read_bytes()
  with pytest.raises(OutputError) as e:  # before any work (it was found after all of it)
    _run(_config(finished[0]), out)
  path = f"{out}/store/{names[0]}"
  assert str(e.value) == (f"store record {path} is a directory: the run stores that sample "
                          f"there; remove the directory and rerun")
  assert (out / "results.jsonl").read_bytes() == before  # the earlier run's results stay


def test_rerun_after_dataset_edit_reuses_unchanged_examples_at_their_new_place(finished, tmp_path):
  data, out = tmp_path / "q.jsonl", tmp_path / "run"
  shutil.copy(finished[0], data)
  cfg = _config(data)
  _run(cfg, out)
  lines = data.read_text().splitlines()
  edited = json.loads(lines[2])
  edited["answer"] = "9"
  data.write_text("\n".join([lines[0], json.dumps(edited), ADDED]) + "\n")  # removed, edited, added
  summary, console = _run(cfg, out)
  assert console == ""
  assert (summary["run"]["resumed"], summary["run"]["computed"]) == (2, 4)
  _run(cfg, tmp_path / "clean")
  assert _same(out, tmp_path / "clean")
  assert [r["example_index"] for r in _records(out)] == [0, 0, 1, 1, 2, 2]


def test_rerun_with_another_policy_or_scoring_reuses_nothing_and_says_so(finished, tmp_path):
  out, _ = _copy(finished, tmp_path / "run")
  summary, console = _run(_config(finished[0], policy="greedy"), out)
  assert console == (f"warning: {out}/summary.json is from a run with another config (policy.n, "
                     f"policy.name, policy.temperature and 2 more); this run replaces its results "
                     f"(their records stay in the store)\n")
  assert summary["run"]["resumed"] == 0 and summary["samples"] == 3
  _run(_config(finished[0], policy="greedy"), tmp_path / "clean")
  assert _same(out, tmp_path / "clean")
  # Text answers are scored otherwise than numbers: none of the stored records is reused.
  summary, console = _run(_config(finished[0], policy="greedy", answer_format="text"), out)
  assert console == (f"warning: {out}/summary.json is from a run with another config "
                     f"(dataset.answer_format); this run replaces its results (their records stay "
                     f"in the store)\n")
  assert summary["run"]["resumed"] == 0


def _full_disk(marker: str, after: int = 0):
  """builtins.open whose files with `marker` in their path fail every write with ENOSPC,
  from the (after + 1)-th such file on."""
  real, opened = builtins.open, [0]

  class Full:
    def __init__(self, f):
      self.f = f
    def __enter__(self):
      return self
    def __exit__(self, *exc):
      self.f.close()
    def write(self, data):
      raise OSError(28, "No space left on device")

  def fake(path, mode="r", *args, **kwargs):
    f = real(path, mode, *args, **kwargs)
    if isinstance(path, str) and marker in path and "w" in mode and path.endswith(".tmp"):
      opened[0] += 1
      if opened[0] > after:
        return Full(f)
    return f
  return mock.patch.object(builtins, "open", fake)


def test_disk_full_on_a_store_record_is_one_line_and_the_rerun_resumes(finished, tmp_path):
  out = tmp_path / "run"
  cfg = _config(finished[0])
  with _full_disk(f"{out}/store/", after=4):  # the write check's probe, then 3 records
    with pytest.raises(WriteError) as e:
      _run(cfg, out)
  assert re.fullmatch(rf"cannot write store record {out}/store/[0-9a-f]{{64}}\.json: "
                      rf"No space left on device", str(e.value)), str(e.value)
  stored = sorted(p.name for p in (out / "store").iterdir())
  assert len(stored) == 3 and all(n.endswith(".json") for n in stored)  # no partial or .tmp file
  summary, console = _run(cfg, out)
  assert console == "" and (summary["run"]["resumed"], summary["run"]["computed"]) == (3, 3)
  assert _same(out, finished[1])


def test_disk_full_on_results_is_one_line_and_no_earlier_results_are_left(finished, tmp_path):
  out, _ = _copy(finished, tmp_path / "run")
  with _full_disk(f"{out}/results.jsonl"):
    with pytest.raises(WriteError) as e:
      _run(_config(finished[0]), out)
  assert str(e.value) == f"cannot write {out}/results.jsonl: No space left on device"
  # The earlier run's results were removed before the job: none can pass for this run's.
  assert not any((out / n).exists() for n in ("results.jsonl", "summary.json", "report.md"))
  assert not list(out.glob("*.tmp"))
  summary, _ = _run(_config(finished[0]), out)
  assert summary["run"]["resumed"] == 6 and _same(out, finished[1])


def test_second_run_on_a_directory_in_use_is_refused_and_leaves_it_alone(finished, tmp_path):
  out, names = _copy(finished, tmp_path / "run")
  (out / "eval.log").write_text("the first run's log\n")
  before = {n: (out / "store" / n).read_bytes() for n in names}
  lock = lock_output_dir(str(out))  # the first run
  try:
    with pytest.raises(OutputError) as e:
      _run(_config(finished[0], policy="greedy"), out)
    assert str(e.value) == (f"output directory {out} is in use by another run (pid {os.getpid()}): "
                            f"wait for it to end or use another --output_dir")
    log = _LogFile(str(out / "eval.log"))  # the second launcher's log goes elsewhere
    assert log.close(keep=False) is None
  finally:
    os.close(lock)
  assert (out / "eval.log").read_text() == "the first run's log\n"
  assert {n: (out / "store" / n).read_bytes() for n in names} == before
  assert _same(out, finished[1]) and (out / LOCK_NAME).exists()
  summary, _ = _run(_config(finished[0]), out)  # once the first run ended
  assert summary["run"]["resumed"] == 6


def test_a_run_removes_the_shared_model_files_beam_made(finished, tmp_path):
  """Beam's cross-process model sharing leaves a lock and an address file per model in the
  temp directory; the run that made them removes them (thousands per test-suite run before)."""
  import pipelines.eval as eval_mod
  seen = {}
  real = eval_mod.remove_shared_model_files

  def spy(tag):
    temp = pathlib.Path(eval_mod.tempfile.gettempdir())
    seen["before"] = sorted(p.name for p in temp.glob(f"{tag}*"))
    real(tag)
    seen["after"] = sorted(p.name for p in temp.glob(f"{tag}*"))

  cfg = _config(finished[0], policy="greedy")
  assert cfg.runner.share_model
  with mock.patch.object(eval_mod, "remove_shared_model_files", spy):
    _run(cfg, tmp_path / "run")
  assert any(n.endswith(".address") for n in seen["before"]), seen  # Beam used this tag
  assert seen["after"] == []


def test_a_record_with_int_keys_reads_back_as_written(tmp_path):
  # JSON makes int keys strings: the checksum of the record as given never matched the one
  # read back, and the sample was computed again on every resume.
  from pipelines.beam import ResultStore
  store = ResultStore(str(tmp_path / "store"))
  (tmp_path / "store").mkdir()
  key = "ab" * 32
  store.put(key, {"key": key, "trace": {"votes": {2: 1.0, 10: 0.5}}})
  record, problem = store.read(key)
  assert problem is None and record == {"key": key, "trace": {"votes": {"2": 1.0, "10": 0.5}}}


def test_a_record_with_non_finite_floats_is_stored_as_strict_json(tmp_path):
  # Python's json writes NaN / Infinity, which strict readers (jq, JavaScript) refuse: a
  # budget decision's p95 past float range put Infinity into a record.
  import json
  from pipelines.beam import ResultStore
  store = ResultStore(str(tmp_path / "store"))
  (tmp_path / "store").mkdir()
  key = "cd" * 32
  store.put(key, {"key": key, "metrics": {"budget": [{"p95_request_ms": float("inf")}],
                                          "x": [float("nan"), -float("inf"), 1.5]}})
  text = (tmp_path / "store" / f"{key}.json").read_text()
  json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
  record, problem = store.read(key)
  assert problem is None
  assert record["metrics"] == {"budget": [{"p95_request_ms": None}], "x": [None, None, 1.5]}


def test_records_the_job_missed_or_repeated_are_taken_from_the_store(finished, tmp_path):
  # A runner that recomputes a lost worker's partitions (Dask) reran `SkipFinished` on a
  # store that had changed: the lost worker's stored samples reached neither side of the
  # split and results.jsonl lacked them (8 of 40, exit 0); the mirror case lists one twice.
  import pipelines.eval as eval_mod
  real = eval_mod._read_jsonl

  def lossy(path):  # the job's results: one missing, one twice
    records = real(path)
    return records[1:] + records[-1:] if path.endswith("results.jsonl") else records

  out = tmp_path / "run"
  with mock.patch.object(eval_mod, "_read_jsonl", lossy):
    summary, console = _run(_config(finished[0]), out)
  assert ("warning: results.jsonl: the job's output missed 1 stored record and listed 1 "
          "twice (a worker lost and its work recomputed?); rewritten from the store") in console
  assert _same(out, finished[1]) and summary["samples"] == 6
  assert summary["run"]["computed"] == 6


def test_reconciling_complete_results_reads_no_store_record(finished, tmp_path):
  from pipelines.beam.pipeline import plan_items, build_plan, reconcile_with_store
  from pipelines.beam import ResultStore
  records = _records(finished[1])
  items, _ = plan_items(build_plan(_config(finished[0]), str(tmp_path / "x")))
  store = ResultStore(str(finished[1] / "store"))
  with mock.patch.object(store, "read", side_effect=AssertionError("read")):
    got, restored, repeated = reconcile_with_store(records, items, store, str(tmp_path / "r.jsonl"))
  assert (got, restored, repeated) == (records, 0, 0) and not (tmp_path / "r.jsonl").exists()


def test_records_of_examples_the_launcher_did_not_read_stop_the_run(finished, tmp_path):
  # A cluster's workers that read another dataset (a relative path, a machine-local copy):
  # their records were scored and summed as this dataset's, exit 0.
  from pipelines.beam.pipeline import plan_items, build_plan, reconcile_with_store
  from pipelines.beam import ResultStore
  from pipelines.datasets import DatasetChangedError
  records = _records(finished[1])
  items, _ = plan_items(build_plan(_config(finished[0]), str(tmp_path / "x")))
  stranger = {**records[0], "key": "f" * 64}
  with pytest.raises(DatasetChangedError, match=r"r\.jsonl: 1 of the job's records are of "
                                                r"examples the launcher did not read"):
    reconcile_with_store(records + [stranger], items, ResultStore(str(finished[1] / "store")),
                         str(tmp_path / "r.jsonl"))


def test_planned_samples_without_a_record_or_dead_letter_stop_the_run(finished, tmp_path):
  # A cluster's workers that read fewer examples (an older copy, the same first lines): the
  # missing samples were left out of the summary, exit 0.
  from pipelines.beam.pipeline import plan_items, build_plan, check_every_item_accounted
  from pipelines.datasets import DatasetChangedError
  records = _records(finished[1])
  items, _ = plan_items(build_plan(_config(finished[0]), str(tmp_path / "x")))
  check_every_item_accounted(records, [], items, "r.jsonl")  # all there
  gone = records[-1]
  dead = [{"stage": "inference", "reason": "too long", "key": gone["key"]},
          {"stage": "input", "reason": "bad line"}]
  check_every_item_accounted(records[:-1], dead, items, "r.jsonl")  # a dead letter names it
  with pytest.raises(DatasetChangedError, match=r"^r\.jsonl: 1 planned samples have no record "
                                                r"and no dead letter: "):
    check_every_item_accounted(records[:-1], dead[1:], items, "r.jsonl")
  # A failure no item could be named for: the count is unknown, nothing refused.
  check_every_item_accounted(records[:-1], [{"stage": "scoring", "reason": "?"}], items, "r")


def test_reconciling_reads_only_records_the_store_lists(finished, tmp_path):
  # The items without a record are mostly dead letters: each took a store read (on a
  # remote store, an exists and an open request per item). Now one listing, and a read
  # for what it lists only.
  from pipelines.beam.pipeline import plan_items, build_plan, reconcile_with_store
  from pipelines.beam import ResultStore
  records = _records(finished[1])
  items, _ = plan_items(build_plan(_config(finished[0]), str(tmp_path / "x")))
  store = ResultStore(str(finished[1] / "store"))
  lost = records[0]["key"]
  unstored = [i for i in items if i.key != lost][:2]  # as if never stored (dead letters)
  listed = store.keys() - {i.key for i in unstored}
  read = []
  real = store.read
  with mock.patch.object(store, "keys", return_value=listed), \
       mock.patch.object(store, "read", side_effect=lambda k: read.append(k) or real(k)):
    got, restored, repeated = reconcile_with_store(
        [r for r in records if r["key"] not in {lost} | {i.key for i in unstored}], items,
        store, str(tmp_path / "r.jsonl"))
  assert read == [lost] and restored == 1 and repeated == 0
  assert sorted(r["key"] for r in got) == sorted(r["key"] for r in records
                                                 if r["key"] not in {i.key for i in unstored})
  read.clear()  # a store that cannot be listed: every missing item read, as before
  with mock.patch.object(store, "keys", return_value=None), \
       mock.patch.object(store, "read", side_effect=lambda k: read.append(k) or real(k)):
    again, restored, _ = reconcile_with_store(
        [r for r in records if r["key"] != lost], items, store, str(tmp_path / "r2.jsonl"))
  assert read == [lost] and restored == 1 and len(again) == len(records)


def test_a_remote_stores_keys_are_one_listing(monkeypatch):
  from apache_beam.io.filesystem import FileMetadata, MatchResult
  from apache_beam.io.filesystems import FileSystems
  from pipelines.beam import ResultStore
  asked = []

  def match(patterns):
    asked.extend(patterns)
    return [MatchResult(patterns[0], [FileMetadata(f"gs://b/run/store/{k}.json", 10)
                                      for k in ("ab" * 8, "cd" * 8)])]
  monkeypatch.setattr(FileSystems, "match", match)
  assert ResultStore("gs://b/run/store/").keys() == {"ab" * 8, "cd" * 8}
  assert asked == ["gs://b/run/store/*.json"]
  # A store that cannot be listed (no access; a path the pattern would misread): unknown,
  # so `reconcile_with_store` reads each missing record (an empty set lost them silently).
  assert ResultStore("gs://b/run[1]/store").keys() is None and len(asked) == 1

  def refuse(patterns):
    raise OSError("403 Forbidden")
  monkeypatch.setattr(FileSystems, "match", refuse)
  assert ResultStore("s3://b/run/store").keys() is None


def test_results_lines_are_strict_json_as_the_store_writes_them(tmp_path):
  # A record computed in this run went to results.jsonl as Python wrote it (NaN,
  # Infinity) while the same record resumed from the store read null: two files.
  from pipelines.beam.pipeline import _record_order, _write_jsonl
  record = {"key": "k", "example_index": 0, "sample_index": 0,
            "metrics": {"ttft_ms": float("nan"), "token_ms": [1.0, float("inf")]}}
  path = tmp_path / "results.jsonl"
  assert _write_jsonl([record], str(path), _record_order) == 1
  line = json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"constant {c}"))
  assert line["metrics"] == {"ttft_ms": None, "token_ms": [1.0, None]}


def test_line_separators_inside_records_are_text_not_ends_of_lines(tmp_path):
  # U+2028 / U+2029 / U+0085 in an example's id (and so in its records) stay raw in
  # results.jsonl; the run read its records back with str.splitlines(), which ends a line
  # there: "Unterminated string" at the very end of every run of this dataset, and
  # pipelines.report called the file not valid JSON. (A text gold holding one is a dead
  # letter now: a reply's last line could never match it.)
  data = tmp_path / "q.jsonl"
  data.write_text("".join(json.dumps({"id": f"red{sep}blue", "question": f"Name {i}.",
                                      "answer": "blue"}) + "\n"
                          for i, sep in enumerate(("\u2028", "\u2029", "\x85"))), encoding="utf-8")
  cfg = _config(data, policy="greedy", answer_format="text")
  cfg.dataset.id_field = "id"
  out = tmp_path / "run"
  console = io.StringIO()
  summary = run(cfg, str(out), clock=FakeClock(), progress=False, report=True, console=console)
  assert summary["samples"] == 3 and summary["dead_letters"]["total"] == 0
  text = (out / "results.jsonl").read_text(encoding="utf-8")
  assert "\u2028" in text and len([l for l in text.split("\n") if l]) == 3
  from pipelines import report
  assert len(report.load_run(out)[1]) == 3 and (out / "report.md").exists()


def test_the_summary_is_strict_json_with_a_configs_inf_named(tmp_path):
  # Before: `"window_s": Infinity` (Python's json), which jq and JavaScript refuse; a rerun
  # with the same config compares equal (no "another config" warning).
  data = tmp_path / "q.jsonl"
  data.write_text(ADDED + "\n")
  cfg = _config(data, policy="greedy")
  cfg.budget.window_s = float("inf")
  out = tmp_path / "run"
  _run(cfg, out)
  text = (out / "summary.json").read_text()
  json.loads(text, parse_constant=lambda name: pytest.fail(f"not strict JSON: {name}"))
  assert '"window_s": "inf"' in text
  assert "another config" not in _run(cfg, out)[1]


def test_a_greedy_runs_seed_or_filters_changed_resume_every_sample_as_it_is(tmp_path):
  # The key leaves a greedy sample's seed and top_p / top_k out; the store's check of a
  # record compared them all: every sample "the record of another sample", recomputed.
  data = tmp_path / "q.jsonl"
  data.write_text(ADDED + "\n" + json.dumps({"question": "What is 2 + 5?", "answer": "7"}) + "\n")
  out = tmp_path / "run"
  _run(_config(data, policy="greedy"), out)
  cfg = _config(data, policy="greedy")
  cfg.sampling.update(seed=7, top_p=0.5, top_k=3)
  summary, console = _run(cfg, out)
  assert summary["run"]["resumed"] == 2 and summary["run"]["computed"] == 0, console
  assert "another sample" not in console
  # The resumed records are a fresh run's of this config (their trace showed the seed and
  # filters of the run that computed them).
  _run(cfg, tmp_path / "fresh")
  assert _same(out, tmp_path / "fresh")
  assert {r["trace"]["sampling"]["seed"] for r in _records(out)} == {7}


def test_a_sample_the_sandbox_could_not_judge_is_scored_again_on_a_rerun(tmp_path, monkeypatch):
  # A sandbox error is no verdict (a setup that missed its deadline under load). Before:
  # stored and resumed, so rerunning the command never judged it.
  from configs import humaneval as humaneval_config
  from pipelines.sandbox import ExecutionResult, Sandbox, Status
  cfg = humaneval_config.get_config("smoke=True")
  cfg.model.predictor = "fake"
  cfg.dataset.n = 2
  cfg.runner.update(direct_num_workers=1, direct_running_mode="in_memory", batch_size=2)
  out = tmp_path / "run"
  real = Sandbox.run_many
  monkeypatch.setattr(Sandbox, "run_many", lambda self, programs: [
      ExecutionResult(Status.SANDBOX_ERROR, "sandbox setup did not finish before the deadline")
      for _ in programs])
  first, _ = _run(cfg, out)
  assert first["sandbox_errors"] == 2
  monkeypatch.setattr(Sandbox, "run_many", real)  # the machine is idle again
  again, _ = _run(cfg, out)
  assert again["run"]["resumed"] == 0 and again["run"]["computed"] == 2
  assert again["sandbox_errors"] == 0


def test_a_dataset_file_changed_while_the_job_runs_stops_the_run_in_one_line(tmp_path):
  # The launcher reads the dataset, the job's workers read it again: an edit in between
  # gave a record of a removed example under another's index, and a summary of neither
  # file. (A loader that edits the file stands for an editor saving it mid-run.)
  from pipelines.datasets import DatasetError
  from pipelines.predictors import FakePredictor
  data = tmp_path / "q.jsonl"
  data.write_text(ADDED + "\n")

  def editing_loader(spec):
    with open(data, "a") as f:
      f.write(json.dumps({"question": "What is 1 + 1?", "answer": "2"}) + "\n")
    return FakePredictor(0.0)
  cfg = _config(data, policy="greedy")
  out = tmp_path / "run"
  with pytest.raises(DatasetError, match=rf"^dataset file {re.escape(str(data))} changed while "
                                         r"the job ran .*: rerun; every sample computed is in "
                                         r"the store$"):
    run(cfg, str(out), clock=FakeClock(), progress=False, report=False, console=io.StringIO(),
        loader=editing_loader)
  # The job's results of the old version are not left as a run's (the store keeps them).
  assert not (out / "results.jsonl").exists() and not (out / "dead_letters.jsonl").exists()
  assert list((out / "store").glob("*.json"))
  summary, _ = _run(cfg, out)  # the rerun reads one version
  assert summary["examples"] == 2 and summary["dead_letters"]["total"] == 0


def test_a_dataset_file_only_touched_while_the_job_runs_is_the_same_dataset(tmp_path):
  # (rsync -a, a checkout or a sync client rewrites the same bytes: the check compares content)
  from pipelines.predictors import FakePredictor
  data = tmp_path / "q.jsonl"
  data.write_text(ADDED + "\n")

  def touching_loader(spec):
    os.utime(data, (1e9, 1e9))
    return FakePredictor(0.0)
  summary = run(_config(data, policy="greedy"), str(tmp_path / "run"), clock=FakeClock(),
                progress=False, report=False, console=io.StringIO(), loader=touching_loader)
  assert summary["samples"] == 1


def test_a_new_run_removes_every_earlier_result_and_unfinished_writes_of_them(tmp_path):
  """The suite's heatmap was no result file (an earlier run's stayed beside a killed
  rerun's partial outputs); a launcher killed mid-write left NAME.PID.XXXXXXXX.tmp files
  that no run removed. Files that are no result of a run stay."""
  from pipelines.eval import RESULT_FILES, remove_result_files
  from pipelines.suite.report import HEATMAP_FILE
  assert HEATMAP_FILE in RESULT_FILES
  out = tmp_path / "run"
  (out / "store").mkdir(parents=True)
  ours = [*RESULT_FILES, "summary.json.999.deadbeef.tmp", "results.jsonl.12.0123abcd.tmp",
          f"{HEATMAP_FILE}.7.00ff00ff.tmp"]
  theirs = ["notes.txt", "summary.json.bak", "summary.json.999.tmp", "other.json.1.deadbeef.tmp",
            "store/x.json"]
  for name in ours + theirs:
    (out / name).write_text("x")
  remove_result_files(str(out))
  left = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
  assert left == sorted(theirs)


def test_results_the_workers_wrote_elsewhere_are_one_line_naming_output_dir(tmp_path,
                                                                            monkeypatch):
  """A relative output_dir on an external cluster: the workers wrote results.jsonl under
  their own working directory, and the launcher said "dataset file not found:
  out/results.jsonl" (the store's samples it could not see either)."""
  from pipelines.beam import pipeline as beam_pipeline
  real = beam_pipeline._write_jsonl

  def elsewhere(records, path, key):  # a worker whose `out` leads somewhere else
    if path.endswith("/results.jsonl"):
      path = str(tmp_path / "worker_cwd" / "results.jsonl")
    return real(records, path, key)
  monkeypatch.setattr(beam_pipeline, "_write_jsonl", elsewhere)
  data = tmp_path / "q.jsonl"
  data.write_text(ADDED + "\n")
  out = tmp_path / "run"
  with pytest.raises(OutputError, match=rf"^{re.escape(str(out))}/results.jsonl is not here "
                                        r"after the job: its workers wrote their output "
                                        r"elsewhere; output_dir must be storage the launcher "
                                        r"and every worker see at the same path"):
    _run(_config(data, policy="greedy"), out)


def test_dask_losing_its_scheduler_or_giving_up_on_a_task_is_one_line():
  """distributed's FutureCancelledError (scheduler-connection-lost) and KilledWorker (a
  task whose workers died more than allowed) were ~30 lines of traceback."""
  from distributed.client import FutureCancelledError
  from distributed.scheduler import KilledWorker
  from pipelines.eval import WorkerLostError, worker_lost_error
  for cause, words in ((FutureCancelledError("finalize-1", reason="scheduler-connection-lost"),
                        "the dask scheduler's connection was lost during the run"),
                       (KilledWorker("shuffle-join-1", None, 3),
                        "dask gave up on a task whose worker processes died while running it")):
    try:
      try:
        raise cause
      except Exception as inner:
        raise RuntimeError("the job failed") from inner
    except RuntimeError as e:
      error = worker_lost_error(e)
    assert isinstance(error, WorkerLostError) and str(error).startswith(words)
    assert str(error).endswith("rerun the same command to resume" + (
        " once a scheduler runs" if "scheduler" in words else ""))
  assert worker_lost_error(FutureCancelledError("k", reason="cancelled by the user")) is None
