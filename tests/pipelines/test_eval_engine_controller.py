"""The engine and controller predictors inside the Beam graph, on a tiny random model.

Per-sample record = every results.jsonl field except `key` (its content hash names
the predictor, so engine and generator runs never share stored results) and
`timing` (wall-clock measurements).
"""

import json
import pathlib
import subprocess
import sys

import pytest
from absl import app

from configs import custom as custom_config
from configs import gsm8k as gsm8k_config
from configs import humaneval as humaneval_config
from o1jax.controller import build_policy
from pipelines.beam import build_plan
from pipelines.eval import run, validate_argv
from tests.pipelines.conftest import QUESTIONS

REPO = pathlib.Path(__file__).resolve().parents[2]


def _config(tiny, policy="greedy", predictor="engine", batch=2):
  cfg = custom_config.get_config(f"policy={policy},smoke=True")
  cfg.model.update(source=str(tiny / "tiny.gguf"), predictor=predictor)
  cfg.dataset.path = str(tiny / "q.jsonl")
  cfg.prompt.update(style="completion", template="Q: {question}\nA:")
  cfg.sampling.max_new_tokens = 8
  cfg.runner.update(direct_num_workers=1, direct_running_mode="in_memory", batch_size=batch)
  return cfg


def _records(run_dir):
  return [json.loads(l) for l in (run_dir / "results.jsonl").read_text().splitlines()]


def _stable(records):
  return [{k: v for k, v in r.items() if k not in ("key", "timing")} for r in records]


def test_engine_predictor_matches_generator_greedy_and_records_real_token_times(tiny, tmp_path):
  summaries = {}
  for predictor in ("generator", "engine"):
    summaries[predictor] = run(_config(tiny, predictor=predictor), str(tmp_path / predictor),
                               progress=False, report=False)
  gen, eng = _records(tmp_path / "generator"), _records(tmp_path / "engine")
  assert len(eng) == len(QUESTIONS)
  assert sum(r["tokens"]["completion"] for r in eng) > 0
  assert _stable(eng) == _stable(gen)
  assert {r["key"] for r in eng}.isdisjoint(r["key"] for r in gen)
  for r in eng:
    t = r["timing"]
    # One latency per decode step after the first token (whose time is the TTFT): every
    # kept token, plus the step that sampled eos.
    assert r["tokens"]["completion"] - 1 <= len(t["token_ms"]) <= r["tokens"]["completion"]
    assert 0 < t["ttft_ms"] <= t["latency_ms"] and all(x >= 0 for x in t["token_ms"])
    assert t["ttft_ms"] + sum(t["token_ms"]) == pytest.approx(t["latency_ms"], rel=1e-3, abs=0.05)
  s = summaries["engine"]
  assert s["latency_ms_per_token"]["source"] == "tokens"
  assert s["latency_ms_per_token"]["count"] == sum(len(r["timing"]["token_ms"]) for r in eng)
  assert s["ttft_ms"]["p50"] > 0
  assert summaries["generator"]["latency_ms_per_token"]["source"] == "request_latency/completion"
  assert "ttft_ms" not in summaries["generator"]


def test_a_deepconf_record_carries_its_threshold_and_stop_counts(tiny, tmp_path):
  """Before: the record dropped the request's threshold and stop counts (the Python API's
  result had them): a researcher could not check the policy's decisions from the record."""
  cfg = _config(tiny, policy="deepconf", batch=3)
  cfg.policy.update(n=4, warmup=2, max_thinking_tokens=12, max_answer_tokens=4, window=2,
                    keep_percent=90.0)
  run(cfg, str(tmp_path / "dc"), progress=False)
  for r in _records(tmp_path / "dc"):
    info, traces = r["trace"]["policy_info"], r["trace"]["traces"]
    assert set(info) == {"threshold", "stopped", "consensus_stopped", "key_mismatches"}
    assert info["stopped"] == sum(t["stopped_low_confidence"] for t in traces)
    assert info["consensus_stopped"] == sum(t["stopped_consensus"] for t in traces)
    # The threshold: the (100 - keep_percent)th percentile of the warm-up traces' lowest
    # group confidences (linear interpolation), rounded as every float of a trace.
    warm = sorted(t["lowest_group_confidence"] for t in traces[:2])
    assert info["threshold"] == pytest.approx(warm[0] + 0.1 * (warm[1] - warm[0]), abs=2e-4)


def test_controller_policy_records_traces_token_kinds_and_report(tiny, tmp_path):
  cfg = _config(tiny, policy="self_consistency", batch=3)
  cfg.policy.update(n=2, max_thinking_tokens=6, max_answer_tokens=4, temperature=5.0, top_p=1.0)
  summary = run(cfg, str(tmp_path / "sc"), progress=False)
  records = _records(tmp_path / "sc")
  assert summary["model"]["predictor"] == "controller"  # engine was swapped for the controller
  assert [r["sample_index"] for r in records] == [0, 0, 0]
  for r in records:
    t = r["trace"]
    assert t["policy"]["name"] == "self_consistency" and t["policy"]["n"] == 2
    assert len(t["traces"]) == 2 and len(t["exit_reasons"]) == 2
    assert t["traces"][0]["text"] != t["traces"][1]["text"] or t["traces"][0]["answer"] is None
    kinds = r["tokens"]
    assert kinds["thinking"] + kinds["answer"] + kinds["discarded"] == kinds["completion"] > 0
    assert kinds["thinking"] <= 2 * 6 and kinds["prompt"] > 0
    assert r["output"] in [x["text"] for x in t["traces"]]  # (no stop sequences here)
  assert summary["tokens"]["thinking"] == sum(r["tokens"]["thinking"] for r in records)
  assert summary["reasoning"]["samples_with_traces"] == 3
  for r in records:  # host-side token times of the device loop: one per token after the first
    t = r["timing"]
    assert 0 < len(t["token_ms"]) < max(x["tokens"]["generated"] for x in r["trace"]["traces"])
    assert 0 < t["ttft_ms"] <= t["latency_ms"] and min(t["token_ms"]) > 0
  assert summary["latency_ms_per_token"]["source"] == "tokens"
  stability = summary["latency_stability"]
  assert stability["per_token_cv"] >= 0 and stability["ttft_p95_ms"] > 0
  assert set(stability["pass"]) == {"per_token_cv < 0.15", "ttft_p95_ms < 320"}
  report = (tmp_path / "sc" / "report.md").read_text()
  assert "First reasoning paths" in report and "2 traces" in report
  assert (tmp_path / "sc" / "reasoning.png").stat().st_size > 0

  # Batch size does not change a controller record (keys come from request ids, not rows).
  again = _config(tiny, policy="self_consistency", batch=1)
  again.policy.update(n=2, max_thinking_tokens=6, max_answer_tokens=4, temperature=5.0, top_p=1.0)
  run(again, str(tmp_path / "sc1"), progress=False, report=False)
  assert _stable(_records(tmp_path / "sc1")) == _stable(records)


def test_a_controller_record_is_cut_at_the_stop_sequences(tiny, tmp_path):
  # Before: the loop does not stop at them and the record kept the text past them (a
  # few-shot trace's next "Question:"), where the engine's record is cut.
  cfg = _config(tiny, policy="greedy_cot", batch=3)
  cfg.policy.update(max_thinking_tokens=12, max_answer_tokens=4)
  run(cfg, str(tmp_path / "free"), progress=False, report=False)
  free = _records(tmp_path / "free")
  text = next(r["output"] for r in free if len(r["output"].strip()) >= 6)
  stop = text.strip()[3:5]
  cfg.prompt.stop = (stop,)
  run(cfg, str(tmp_path / "cut"), progress=False, report=False)
  cut = _records(tmp_path / "cut")
  for a, b in zip(free, cut, strict=True):
    assert b["trace"]["traces"] == a["trace"]["traces"]  # the same traces, the record cut
    want = a["output"][:a["output"].find(stop)] if stop in a["output"] else a["output"]
    assert b["output"] == want
    assert b["finish_reason"] == ("stop" if stop in a["output"] else a["finish_reason"])
  assert any(stop in r["output"] for r in free) and not any(stop in r["output"] for r in cut)


@pytest.mark.parametrize("policy", ["greedy", "self_consistency"])
def test_adaptive_budget_changes_limits_during_a_run_and_records_them(tiny, tmp_path, policy):
  """3 examples in batches of 2 on 2 slots, SLO 0.5 s, interval 1 ms: the first batch runs
  at the measured load of at least a full batch (2 of 2 slots, plus the next batch's item
  when it is already waiting for the model: load 1.0 -> 51 steps or 1.5 -> 42), the last
  one alone (1 of 2: load 0.5, fewer steps than 102 if the first batch's P95 latency,
  compilation included, exceeded the SLO; recorded only if that changes its limit). Every decision recorded is the formula of the
  load it names (unless the P95 clause shrank it), every record carries the limits it ran
  under, and a live budget enters the content hash."""
  from o1jax.engine.budget import allocate_budget, token_limit
  if policy == "greedy":
    fixed = _config(tiny, policy=policy, batch=2)
    fixed.sampling.max_new_tokens = 16
    run(fixed, str(tmp_path / "fixed"), progress=False, report=False)
  adaptive = _config(tiny, policy=policy, batch=2)
  adaptive.sampling.max_new_tokens = 16
  adaptive.budget.update(mode="adaptive", latency_slo_s=0.5, interval_ms=1.0)
  run(adaptive, str(tmp_path / "adaptive"), progress=False, report=False)
  records = _records(tmp_path / "adaptive")
  if policy == "greedy":
    assert {r["key"] for r in records}.isdisjoint(r["key"] for r in _records(tmp_path / "fixed"))
  first = min(r["timing"]["start_ms"] for r in records)
  batches = ([r for r in records if r["timing"]["start_ms"] == first],
             [r for r in records if r["timing"]["start_ms"] != first])
  assert [len(b) for b in batches] == [2, 1]

  def decisions(record):
    out = []
    for e in record["timing"]["budget"]:
      if e["why"].startswith("load "):
        load = float(e["why"].split(",")[0].split()[1])
        if "P95" not in e["why"]:
          assert e["steps"] == allocate_budget(0.5, load)
        out.append((load, e))
    return out

  for r in batches[0]:
    assert any(load >= 1.0 for load, _ in decisions(r))
  # The last request runs alone: a decision is recorded only where it changes its limit
  # (the budget it arrived with may already be the one its load gives), and any reads 0.5.
  assert all(load == 0.5 for load, _ in decisions(batches[1][0]))
  assert batches[1][0]["timing"]["budget"]
  if policy == "greedy":  # a plain request's token limit: ceil(16 * steps / 128), kept to
    for r in records:
      last = r["timing"]["budget"][-1]
      assert last["tokens"] == token_limit(16, last["steps"])
      assert r["tokens"]["completion"] <= last["tokens"]


def test_policy_registry_and_config_errors():
  sc = gsm8k_config.get_config("policy=deepconf,smoke=True")
  assert sc.policy.name == "deepconf" and sc.policy.n == 2 and sc.policy.warmup == 1
  policy = build_policy(sc.policy.to_dict())
  assert policy.controller and policy.num_samples == 1 and not policy.vote
  assert policy.to_dict()["keep_percent"] == sc.policy.keep_percent
  assert build_policy({"name": "sample_n", "n": 3}).num_samples == 3

  with pytest.raises(ValueError, match=r"valid policies are .*'deepconf'.*'greedy'.*'sample_n'"):
    gsm8k_config.get_config("policy=no_such_policy")
  with pytest.raises(ValueError, match=r"no params \['bogus'\]; valid: .*'warmup'"):
    build_policy({"name": "deepconf", "bogus": 1})
  with pytest.raises(app.UsageError, match=r"unknown config key 'policy.n'.*policy has keys"):
    validate_argv(["eval", "--config=configs/gsm8k.py:policy=greedy_cot", "--config.policy.n=4"])
  validate_argv(["eval", "--config=configs/gsm8k.py:policy=best_of_n", "--config.policy.score=x"])
  # A key given twice: its last value, as every absl flag (a wrapper's defaults, then yours).
  validate_argv(["eval", "--config=configs/gsm8k.py", "--config.dataset.n=1", "--config.dataset.n=2"])

  he = humaneval_config.get_config("policy=greedy_cot,smoke=True")
  with pytest.raises(ValueError, match="HumanEval.*policy=greedy or policy=sample_n"):
    build_plan(he, "unused_output_dir")
  text = custom_config.get_config("policy=self_consistency,smoke=True")
  text.dataset.update(path="unused.jsonl", answer_format="text")
  with pytest.raises(ValueError, match=r"answer_format=text rejects it: use policy=sample_n"):
    build_plan(text, "unused_output_dir")
  text.dataset.answer_format = "number"  # numbers vote in the loop
  assert build_plan(text, "unused_output_dir").predictor.name == "controller"
  plain = gsm8k_config.get_config("smoke=True")
  plain.model.predictor = "controller"
  with pytest.raises(ValueError, match="runs only controller policies"):
    build_plan(plain, "unused_output_dir")


@pytest.mark.slow
def test_embedded_model_cli_self_consistency_through_the_controller(tmp_path):
  out = tmp_path / "sc"
  cmd = [sys.executable, "-m", "pipelines.eval",
         "--config=configs/gsm8k.py:policy=self_consistency,smoke=True",
         "--config.dataset.n=2", "--config.policy.n=2", "--config.policy.max_thinking_tokens=16",
         "--config.policy.max_answer_tokens=6", "--config.runner.batch_size=2",
         "--config.runner.direct_running_mode=in_memory", "--config.runner.direct_num_workers=1",
         f"--output_dir={out}"]
  done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  summary = json.loads((out / "summary.json").read_text())
  assert summary["policy"] == "self_consistency" and summary["model"]["predictor"] == "controller"
  assert summary["samples"] == 2 and summary["dead_letters"]["total"] == 0
  assert summary["tokens"]["thinking"] > 0 and summary["reasoning"]["samples_with_traces"] == 2
  assert set(summary["accuracy"]) == {"strict", "flexible"}
  records = [json.loads(l) for l in (out / "results.jsonl").read_text().splitlines()]
  assert all(len(r["trace"]["traces"]) == 2 for r in records)
  report = (out / "report.md").read_text()
  assert "## Reasoning paths" in report and "First reasoning paths" in report
  assert (out / "reasoning.png").stat().st_size > 0


def test_speculative_engine_run_gives_the_plain_records_under_the_same_keys(tiny, tmp_path):
  """The speculative section changes how fast the engine decodes, not what it
  outputs: the same records under the same content hashes; the generator with it
  on, or the controller with a drafter it does not run, is refused before any work
  starts."""
  plain = _config(tiny, batch=3)
  plain.sampling.max_new_tokens = 16
  run(plain, str(tmp_path / "plain"), progress=False, report=False)
  spec = _config(tiny, batch=3)
  spec.sampling.max_new_tokens = 16
  spec.speculative.update(enabled=True, max_drafts=3, adaptive=False)
  summary = run(spec, str(tmp_path / "spec"), progress=False, report=False)
  want, got = _records(tmp_path / "plain"), _records(tmp_path / "spec")
  assert _stable(got) == _stable(want)
  assert [r["key"] for r in got] == [r["key"] for r in want]
  assert summary["model"]["predictor"] == "engine"
  drafted = [r["timing"].get("speculative", {}).get("drafted", 0) for r in got]
  assert sum(drafted) > 0  # it did speculate
  assert all("speculative" not in r["timing"] for r in want)
  bad = _config(tiny, predictor="generator")
  bad.speculative.enabled = True
  with pytest.raises(ValueError, match="speculative.enabled=True needs model.predictor=engine or"):
    build_plan(bad, str(tmp_path / "bad"))
  bad = _config(tiny, predictor="generator")  # (was: run with rc 0, the budget ignored)
  bad.budget.mode = "adaptive"
  with pytest.raises(ValueError, match=r"^budget.mode='adaptive' needs model.predictor=engine or "
                                       r"a controller policy; this run uses 'generator'"):
    build_plan(bad, str(tmp_path / "bad"))
  bad = _config(tiny, policy="self_consistency")
  bad.speculative.update(enabled=True, drafter="early_exit")
  with pytest.raises(ValueError, match="the controller's loop drafts by 'prompt_lookup' only"):
    build_plan(bad, str(tmp_path / "bad1"))
  bad = _config(tiny)
  bad.speculative.update(enabled=True, drafter="oracle")
  with pytest.raises(ValueError, match="speculative.drafter='oracle'"):
    build_plan(bad, str(tmp_path / "bad2"))


@pytest.mark.parametrize("policy", ["self_consistency", "deepconf"])
def test_speculative_controller_run_keys(tiny, tmp_path, policy):
  """In the controller's loop speculation leaves traces unchanged, and keys with them,
  except under a policy whose traces stop each other (deepconf's consensus stop):
  there it is part of the content hash."""
  records = {}
  for name, on in (("plain", False), ("spec", True)):
    config = _config(tiny, policy=policy, batch=3)
    config.speculative.update(enabled=on, max_drafts=3, adaptive=False)
    run(config, str(tmp_path / name), progress=False, report=False)
    records[name] = _records(tmp_path / name)
  want, got = records["plain"], records["spec"]
  drafted = [r["timing"].get("speculative", {}).get("drafted", 0) for r in got]
  assert sum(drafted) > 0 and all("speculative" not in r["timing"] for r in want)
  if policy == "self_consistency":
    assert _stable(got) == _stable(want)
    assert [r["key"] for r in got] == [r["key"] for r in want]
  else:
    assert not {r["key"] for r in got} & {r["key"] for r in want}


def test_work_lost_to_preemptions_is_recorded_summed_and_reported(tiny, tmp_path):
  """A KV pool too small for the running sequences: the engine preempts and recomputes;
  each record's timing says how many tokens it ran again, the summary sums them and the
  report says what to raise. The records' content is that of a roomy pool."""
  cfg = _config(tiny, batch=3)
  cfg.sampling.max_new_tokens = 24
  cfg.engine.update(num_blocks=3, block_size=16, max_slots=3)  # one sequence needs 2 blocks
  summary = run(cfg, str(tmp_path / "small"), progress=False, report=True)
  records = _records(tmp_path / "small")
  lost = sum(r["timing"].get("recomputed_tokens", 0) for r in records)
  assert lost > 0 and summary["throughput"]["recomputed_tokens"] == lost
  assert f"The engine recomputed {lost} tokens" in (tmp_path / "small" / "report.md").read_text()
  cfg.engine.num_blocks = 64
  roomy = run(cfg, str(tmp_path / "roomy"), progress=False, report=False)
  assert roomy["throughput"]["recomputed_tokens"] == 0
  assert _stable(_records(tmp_path / "roomy")) == [
      {k: v for k, v in r.items() if k not in ("key", "timing")} for r in records]


def test_a_reasoning_loop_larger_than_the_device_stops_the_run_at_load(tiny, tmp_path):
  """`policy.n` so large that even one request's loop cannot fit the device is found
  once, where the workers build the controller (one line, nothing stored), not as one
  dead letter per request."""
  from pipelines.beam.handler import ModelLoadError
  cfg = _config(tiny, policy="self_consistency")
  cfg.policy.n = 100_000  # (the most policies take) with a thinking budget past any device
  cfg.policy.max_thinking_tokens = 2**20
  with pytest.raises(ModelLoadError, match=r"^a worker could not load the model: the reasoning "
                                           r"loop \(131072 rows for n=100000, \d+ positions "
                                           r"each, conf_window \d+\) needs [\d,.]+ GiB but the "
                                           r"device has [\d,.]+ GiB: lower n, max_rows"):
    run(cfg, str(tmp_path / "out"), progress=False, report=False)
  assert not (tmp_path / "out" / "results.jsonl").exists()
  assert not list((tmp_path / "out").glob("store/*.json"))


@pytest.mark.parametrize("matmul_dtype, hashed", [("float32", False), ("int8", False),
                                                  ("bfloat16", True), ("float8", True)])
def test_speculation_is_hashed_with_bf16_and_fp8_matmuls(tiny, tmp_path, matmul_dtype, hashed):
  # XLA's CPU bf16 dot sums a row otherwise at some row counts (a verify call runs
  # B x (K + 1) rows): the tiny model's log p moved 2e-3, so outputs may change. Before:
  # never hashed for the engine. float8 products run in XLA's dot wherever the native f32
  # kernel does not, and e4m3 rounding makes its sums' differences whole steps (with
  # backend=reference, 5 of 16 greedy GSM answers of the embedded model changed with
  # speculation on; before: not hashed, so a rerun reused the other outputs).
  from pipelines.beam.pipeline import plan_items
  keys = {}
  for on in (False, True):
    cfg = _config(tiny)
    cfg.model.matmul_dtype = matmul_dtype
    cfg.speculative.update(enabled=on, max_drafts=3)
    plan = build_plan(cfg, str(tmp_path / f"{on}"))
    keys[on] = [item.key for item in plan_items(plan)[0]]
  assert (keys[False] != keys[True]) == hashed
