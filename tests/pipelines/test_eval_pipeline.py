"""The Beam graph with fakes: records, dead letters, handler contract, runner options."""

import json

import apache_beam as beam
import pytest
from apache_beam.ml.inference.base import PredictionResult
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.util import assert_that, equal_to

from configs import custom as custom_config
from configs import gsm8k as gsm8k_config
from pipelines.beam import PredictorModelHandler, build_pipeline, build_plan, plan_items
from pipelines.beam.testing import FakeClock, FlakyLoader
from pipelines.predictors import FakePredictor, PredictorSpec, WorkItem


def fake_config(n=6, policy="greedy"):
  cfg = gsm8k_config.get_config(f"smoke=True,policy={policy}")
  cfg.model.predictor = "fake"
  cfg.dataset.n = n
  cfg.runner.batch_size = 4
  return cfg


def test_records_are_the_fake_answers_and_results_file_is_sorted(tmp_path):
  cfg = fake_config(n=6)
  plan = build_plan(cfg, str(tmp_path))
  items, dead = plan_items(plan)
  assert len(items) == 6 and not dead
  # FakePredictor's docstring: "The answer is R." unless sha256(key) % 4 == 0 (then R + 1).
  expected = [(i.example["id"], i.sample_index, FakePredictor.text_for(i) == f"The answer is {i.example['reference']}.")
              for i in items]
  with TestPipeline() as p:
    records, dead_pc = build_pipeline(p, plan, clock=FakeClock())
    assert_that(records | beam.Map(lambda r: (r["example_id"], r["sample_index"], r["correct"])),
                equal_to(expected), label="records")
    assert_that(dead_pc, equal_to([]), label="no_dead_letters")
  lines = [json.loads(l) for l in (tmp_path / "results.jsonl").read_text().splitlines()]
  assert [r["example_index"] for r in lines] == list(range(6))
  assert all(r["timing"]["latency_ms"] == 25.0 for r in lines)  # one FakeClock step per batch
  assert len(list((tmp_path / "store").glob("*.json"))) == 6


def test_fake_answers_are_the_reference_as_written_or_one_more():
  """A float of the reference rounded big integers (12345678901234567891 -> ...7168) and
  rewrote "3.50" as 3.5: the "right" fake answer was scored wrong."""
  import hashlib
  from pipelines.tasks.gsm8k import score_gsm8k
  seen = set()
  for ref in ("12345678901234567891", "3.50", "-7", "0.125"):
    for k in range(12):
      item = WorkItem(key=f"k{k}", example={"reference": ref}, example_index=0, sample_index=k,
                      prompt="", stop=(), sampling=None, request_id=0)
      text = FakePredictor.text_for(item)
      right = bool(int(hashlib.sha256(item.key.encode()).hexdigest()[:8], 16) % 4)
      seen.add(right)
      assert score_gsm8k(text, ref).flexible_correct == right, (ref, text)
  assert seen == {True, False}


def test_the_samples_of_one_example_draw_from_distinct_streams():
  """Request ids were 31 bits of sha256: 200,000 samples of one example gave ~9 pairs one
  random stream (so the same text); the id is 63 bits now. A sampled record's key says
  which ids drew it (records of the 31-bit ids are computed again), a greedy one's not."""
  from pipelines.predictors import request_id_for
  assert len({request_id_for("ex-1", i) for i in range(200_000)}) == 200_000


def test_a_sampled_records_key_holds_its_request_stream(tmp_path, monkeypatch):
  import pipelines.beam.pipeline as pipeline_module
  from pipelines.predictors import REQUEST_STREAM
  contents = []
  canonical = pipeline_module._canonical
  monkeypatch.setattr(pipeline_module, "_canonical",
                      lambda obj: contents.append(obj) or canonical(obj))
  for policy, stream in (("sample_n", REQUEST_STREAM), ("greedy", None)):
    contents.clear()
    items, _ = plan_items(build_plan(fake_config(n=2, policy=policy), str(tmp_path)))
    keyed = [c for c in contents if isinstance(c, dict) and "sample_index" in c]
    assert len(keyed) == len(items) > 0
    assert all(c.get("request_stream") == stream for c in keyed)
    assert all(0 <= i.request_id < 2**63 for i in items)  # (an int64 in the records)


def test_samples_are_keyed_by_example_and_index(tmp_path):
  cfg = fake_config(n=3, policy="sample_n")
  cfg.policy.n = 4
  plan = build_plan(cfg, str(tmp_path))
  items, _ = plan_items(plan)
  assert [(i.example_index, i.sample_index) for i in items] == [(e, s) for e in range(3) for s in range(4)]
  assert len({i.key for i in items}) == 12 and len({i.request_id for i in items}) == 12
  # The key is a content hash: a different seed or model changes every key.
  cfg.sampling.seed = 1
  assert not {i.key for i in plan_items(build_plan(cfg, str(tmp_path)))[0]} & {i.key for i in items}
  # ... but not what cannot change a sample: sample_n's n (sample i is drawn from the seed,
  # the request and i), a greedy run's seed and filters (the argmax). Before, n=4 -> 8 and
  # a greedy run's new seed computed every sample again, to the same text.
  cfg.sampling.seed = 0
  cfg.policy.n = 8
  more = plan_items(build_plan(cfg, str(tmp_path)))[0]
  assert {i.key for i in more if i.sample_index < 4} == {i.key for i in items}
  greedy = fake_config(n=3, policy="greedy")
  keys = lambda c: [i.key for i in plan_items(build_plan(c, str(tmp_path)))[0]]
  first = keys(greedy)
  greedy.sampling.update(seed=7, top_p=0.5, top_k=3)
  assert keys(greedy) == first
  greedy.sampling.max_new_tokens += 1
  assert not set(keys(greedy)) & set(first)
  # A controller policy's seed counts at temperature 0 (its loop samples after a backtrack).
  tvb = fake_config(n=3, policy="think_verify_backtrack")
  before = keys(tvb)
  tvb.sampling.seed = 7
  assert not set(keys(tvb)) & set(before)


def test_malformed_lines_and_failed_batches_become_dead_letters(tmp_path):
  data = tmp_path / "data.jsonl"
  data.write_text("\n".join([
      json.dumps({"q": "What is 2 + 3?", "a": "5", "id": "a"}),
      "{not json",
      json.dumps({"q": "What is 4 + 4?", "id": "b"}),  # no answer field
      json.dumps({"q": "What is 9 - 1?", "a": "8", "id": "c"}),
      json.dumps({"q": "What is 1 + 1?", "a": "2", "id": "d"}),
  ]) + "\n")
  cfg = custom_config.get_config("smoke=True")
  cfg.model.predictor = "fake"
  cfg.dataset.update(path=str(data), question_field="q", answer_field="a", id_field="id")
  cfg.runner.batch_size = 1  # so only the failing example's batch fails
  plan = build_plan(cfg, str(tmp_path / "run"))
  with TestPipeline() as p:
    records, dead = build_pipeline(p, plan, clock=FakeClock(), loader=FlakyLoader(frozenset({"custom/c"})))
    assert_that(records | beam.Map(lambda r: r["example_id"]), equal_to(["custom/a", "custom/d"]), label="ok")
    assert_that(dead | beam.Map(lambda d: (d["stage"], d.get("line_number"), d.get("example_id"))),
                equal_to([("input", 2, None), ("input", 3, None), ("inference", None, "custom/c")]),
                label="dead")
  dead_lines = [json.loads(l) for l in (tmp_path / "run" / "dead_letters.jsonl").read_text().splitlines()]
  assert {d["source"] for d in dead_lines if d["stage"] == "input"} == {str(data)}
  assert "injected failure" in [d for d in dead_lines if d["stage"] == "inference"][0]["reason"]


def test_handler_contract():
  handler = PredictorModelHandler(PredictorSpec(name="fake"), batch_size=3, clock=FakeClock(step_ms=10))
  assert handler.share_model_across_processes() is True
  assert handler.batch_elements_kwargs() == {"min_batch_size": 3, "max_batch_size": 3}
  cfg = gsm8k_config.get_config("smoke=True")
  cfg.model.predictor = "fake"
  items, _ = plan_items(build_plan(cfg, "unused"))
  model = handler.load_model()
  out = handler.run_inference(items[:3], model)
  assert all(isinstance(r, PredictionResult) for r in out)
  assert [r.example for r in out] == items[:3]
  assert [r.inference["text"] for r in out] == [FakePredictor.text_for(i) for i in items[:3]]
  assert {r.inference["timing"]["latency_ms"] for r in out} == {10.0}
  assert out[0].inference["timing"]["batch_size"] == 3


@pytest.mark.parametrize("name, want", [("DirectRunner", "DirectRunner"),
                                        ("directrunner", "DirectRunner"), ("direct", "DirectRunner"),
                                        ("flink", "FlinkRunner"), ("Dask", "dask"),
                                        ("apache_beam.runners.direct.direct_runner.DirectRunner",
                                         "DirectRunner"),
                                        ("apache_beam.runners.runner.PipelineRunner",
                                         "apache_beam.runners.runner.PipelineRunner")])
def test_runner_names_are_read_as_beam_reads_them(name, want):
  # Before: "directrunner" ran on the DirectRunner (Beam's reading) without its settings
  # (the project compared the exact spelling): one worker, no progress bar, no resume counts.
  from pipelines.beam.options import beam_args, batches_sharing_a_model, runner_name
  assert runner_name(name) == want
  cfg = fake_config().runner
  cfg.name = name
  if want == "DirectRunner":
    assert "--direct_num_workers=2" in beam_args(cfg) and batches_sharing_a_model(cfg) == 2


def test_one_worker_per_cpu_sizes_the_shared_model_for_every_worker():
  # direct_num_workers=0 is Beam's one per CPU (multiprocessing.cpu_count()): the engine
  # was sized for one batch at a time, and the workers' batches queued on it.
  import multiprocessing
  from pipelines.beam.options import batches_sharing_a_model
  cfg = fake_config().runner
  cfg.direct_num_workers = 0
  assert batches_sharing_a_model(cfg) == multiprocessing.cpu_count()


@pytest.mark.parametrize("section, key, value, message", [
    # Settings of a section the run does not use, each accepted without a word before (a
    # typo stays one when the section is turned on later; an address meant a cluster).
    ("speculative", "drafter", "bogus", r"^speculative\.drafter='bogus' not in "),
    ("controller", "cache", "bogus", r"^controller cache='bogus': valid caches are "),
    ("runner", "address", "tcp://h:8786", r"^runner\.address='tcp://h:8786' is a dask "
                                          r"scheduler's, but runner\.name='DirectRunner': add "
                                          r"--config\.runner\.name=dask to run there$"),
])
def test_settings_of_an_unused_section_are_checked_too(tmp_path, section, key, value, message):
  cfg = fake_config()  # greedy, no speculation, the DirectRunner
  cfg[section][key] = value
  with pytest.raises(ValueError, match=message):
    build_plan(cfg, str(tmp_path))
    from pipelines.beam import beam_args
    beam_args(cfg.runner)


@pytest.mark.parametrize("name", ["bogus", "", "Directrunnr"])
def test_an_unknown_runner_name_is_one_line_naming_the_key(name):
  from pipelines.beam.options import runner_name
  cfg = fake_config()
  cfg.runner.name = name
  with pytest.raises(ValueError, match=rf"^runner\.name='{name}': expected one of \['DirectRunner', "
                                       rf"'dask', .*\] \(or a runner class path\)$"):
    build_plan(cfg, "unused_output_dir")
  with pytest.raises(ValueError, match=r"^--runner='bogus': expected one of"):
    runner_name("bogus", "--runner")
  # (was Beam's ModuleNotFoundError traceback once the job started)
  with pytest.raises(ValueError, match=r"^runner\.name='foo\.bar\.Runner': cannot import it "
                                       r"\(No module named 'foo'\)$"):
    runner_name("foo.bar.Runner")


def test_the_summary_names_the_runner_a_flag_after_the_double_dash_picked(tmp_path):
  """Before: `-- --runner=X` ran on X while the summary's config named the config's runner
  (DirectRunner for a job run on dask). The caller's config stays as it was."""
  from pipelines.eval import run
  cfg = fake_config(n=2)
  cfg.runner.name = "dask"
  summary = run(cfg, str(tmp_path), ["--runner=direct"], clock=FakeClock(), progress=False,
                report=False)
  assert summary["config"]["runner"]["name"] == "direct"
  assert "--runner=DirectRunner" in summary["run"]["beam_args"]
  assert cfg.runner.name == "dask" and summary["samples"] == 2
  on_disk = json.loads((tmp_path / "summary.json").read_text())
  assert on_disk["config"]["runner"]["name"] == "direct"
  # argparse's other form picks the runner too (was: the checks and flags of the config's
  # runner, DirectRunner's flags sent to Flink, "dask" given to Beam as a runner name).
  from pipelines.beam.options import DASK_RUNNER, beam_args, runner_flag
  direct = fake_config().runner
  assert runner_flag(["--runner", "dask", "--x=1"]) == "dask"
  assert beam_args(direct, ["--runner", "FlinkRunner", "--flink_master=localhost:8081"]) == [
      "--runner=FlinkRunner", "--flink_master=localhost:8081"]
  assert beam_args(direct, ["--runner", "dask"])[:2] == [f"--runner={DASK_RUNNER}",
                                                         "--dask_local_workers=2"]
  with pytest.raises(ValueError, match=r"^--runner='': expected one of"):
    beam_args(direct, ["--runner"])


@pytest.mark.parametrize("args", [
    ["--runner=DataflowRunner", "--project=my-project-123", "--region=us-central1",
     "--temp_location=gs://my-bucket/tmp"],
    ["--runner=FlinkRunner", "--flink_master=localhost:8081", "--environment_type=LOOPBACK"],
    ["--runner=SparkRunner", "--spark_master_url=spark://localhost:7077", "--environment_type=LOOPBACK"],
])
def test_graph_builds_for_each_runner(tmp_path, args):
  from pipelines.beam import beam_args
  cfg = fake_config()
  full = beam_args(cfg.runner, args)
  assert not any(a.startswith("--direct_") for a in full)  # DirectRunner flags are dropped
  p = beam.Pipeline(options=PipelineOptions(full))
  assert type(p.runner).__name__ == args[0].split("=")[1]
  build_pipeline(p, build_plan(cfg, "gs://my-bucket/run"))
  proto = p.to_runner_api()  # serializes every DoFn, as submission would
  names = {t.unique_name for t in proto.components.transforms.values()}
  for stage in ("ReadDataset", "SkipFinished", "RunInference", "Score", "WriteResults", "WriteDeadLetters"):
    assert any(n == stage or n.startswith(stage + "/") for n in names), stage
