"""Bad input to the launcher (`pipelines.eval.run`): every case stops before any work with
an error naming the file or directory, or goes on with a dead letter / a warning."""

import contextlib
import io
import json
import pathlib
import re

import pytest

from configs import custom as custom_config
from o1jax.checkpoint import CheckpointError
from o1jax.controller import build_policy
from pipelines.beam.store import OutputError
from pipelines.beam.testing import FakeClock
from pipelines.datasets import DatasetError
from pipelines.eval import run

Q = [("What is 2 + 3?", "5"), ("What is 4 + 4?", "8"), ("What is 9 - 1?", "8")]


def _config(data, **model):
  cfg = custom_config.get_config("smoke=True")
  cfg.model.predictor = "fake"
  cfg.model.update(model)
  cfg.dataset.path = str(data)
  cfg.runner.update(direct_num_workers=1, direct_running_mode="in_memory", batch_size=2)
  return cfg


def _write(path, lines):
  path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
  return path


def _good_lines():
  return [json.dumps({"question": q, "answer": a}) for q, a in Q]


def _run(cfg, out, console=None):
  return run(cfg, str(out), clock=FakeClock(), progress=False, report=False, console=console)


def _nothing_written(out):
  return not list(pathlib.Path(out).glob("store/*.json")) and not (pathlib.Path(out) / "results.jsonl").exists()


# -- 1. no examples ------------------------------------------------------------------

@pytest.mark.parametrize("content", ["", "\n  \n\n"])
def test_empty_dataset_file_is_an_error_naming_it(tmp_path, content):
  data = tmp_path / "empty.jsonl"
  data.write_text(content)
  with pytest.raises(DatasetError, match=rf"^dataset file is empty: {data}$"):
    _run(_config(data), tmp_path / "out")
  assert _nothing_written(tmp_path / "out")


def test_a_pattern_matching_only_empty_files_names_them(tmp_path):
  # Before: "dataset file is empty: .../shard-*.jsonl" (the pattern, as if it were a file).
  for name in ("shard-0.jsonl", "shard-1.jsonl"):
    (tmp_path / name).write_text("\n")
  with pytest.raises(DatasetError, match=rf"^dataset files matching {tmp_path}/shard-\*\.jsonl "
                                         rf"are empty: {tmp_path}/shard-0\.jsonl, "
                                         rf"{tmp_path}/shard-1\.jsonl$"):
    _run(_config(f"{tmp_path}/shard-*.jsonl"), tmp_path / "out")


def test_dataset_with_only_bad_lines_is_an_error_and_lists_them(tmp_path):
  data = _write(tmp_path / "bad.jsonl", ["{not json", json.dumps({"question": "no answer"}), "[1]"])
  with pytest.raises(DatasetError) as e:
    _run(_config(data), tmp_path / "out")
  assert str(e.value) == (f"no usable examples in dataset file {data}: all 3 lines are malformed "
                          f"(line 1: invalid JSON: Expecting property name enclosed in double quotes at column 2); "
                          f"each line's reason is in {tmp_path / 'out' / 'dead_letters.jsonl'}")
  dead = [json.loads(l) for l in (tmp_path / "out" / "dead_letters.jsonl").read_text().splitlines()]
  assert [(d["stage"], d["line_number"]) for d in dead] == [("input", 1), ("input", 2), ("input", 3)]
  assert _nothing_written(tmp_path / "out")


# -- 2. duplicate lines ----------------------------------------------------------------

def test_duplicate_lines_run_once_with_one_warning(tmp_path):
  lines = _good_lines()
  data = _write(tmp_path / "dup.jsonl", lines + [lines[0], lines[2], lines[0]])
  console = io.StringIO()
  summary = _run(_config(data), tmp_path / "out", console=console)
  assert console.getvalue() == (f"warning: {data}: 3 duplicate lines skipped "
                                f"(the first line of each example is kept)\n")
  records = [json.loads(l) for l in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
  assert len(records) == 3 and len({r["key"] for r in records}) == 3
  assert [r["example_index"] for r in records] == [0, 1, 2]
  assert summary["examples"] == 3 and summary["run"]["duplicate_lines_skipped"] == 3
  assert summary["dead_letters"]["total"] == 0


def test_dataset_n_past_the_file_is_said_when_the_command_line_asked_for_it(tmp_path):
  # Before: n=500 on a file of 100 scored the 100 without a word. smoke's own n=8 is a
  # cap, not a request: said only when the command line set it (main passes n_given).
  data = _write(tmp_path / "short.jsonl", _good_lines() + ["{not json"])
  cfg = _config(data)
  cfg.dataset.n = 500
  console = io.StringIO()
  summary = run(cfg, str(tmp_path / "out"), clock=FakeClock(), progress=False, report=False,
                console=console, n_given=True)
  assert console.getvalue() == (f"warning: dataset.n=500: {data} holds 3 examples and 1 bad "
                                f"records; all are scored\n")
  assert summary["examples"] == 3
  quiet = io.StringIO()
  _run(_config(data), tmp_path / "out2", console=quiet)  # smoke's n=8, from the config
  assert quiet.getvalue() == ""


# -- 3. lone surrogates ----------------------------------------------------------------

def test_lone_surrogate_line_is_a_dead_letter_and_the_job_goes_on(tmp_path):
  lines = _good_lines()
  data = _write(tmp_path / "s.jsonl", [lines[0], '{"question": "What is \\ud800?", "answer": "1"}', lines[1]])
  summary = _run(_config(data), tmp_path / "out")
  assert summary["examples"] == 2
  (dead,) = [json.loads(l) for l in (tmp_path / "out" / "dead_letters.jsonl").read_text().splitlines()]
  assert (dead["stage"], dead["source"], dead["line_number"]) == ("input", str(data), 2)
  assert "lone surrogate" in dead["reason"]


def test_lone_surrogates_elsewhere_never_kill_a_run(tmp_path):
  # Text that cannot be UTF-8 can still come from the config (a command-line byte that is not
  # UTF-8 arrives as a lone surrogate): it is hashed, stored, summarized and reported.
  data = _write(tmp_path / "ok.jsonl", _good_lines())
  cfg = _config(data)
  cfg.prompt.system = "Answer\udcff briefly."
  cfg.prompt.template = "Q\ud800: {question}"
  summary = run(cfg, str(tmp_path / "out"), clock=FakeClock(), progress=False, report=True)
  assert summary["examples"] == 3 and summary["config"]["prompt"]["system"] == "Answer\udcff briefly."
  records = [json.loads(l) for l in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
  assert len(records) == 3
  stored = [json.loads(p.read_bytes()) for p in (tmp_path / "out" / "store").glob("*.json")]
  assert sorted(r["key"] for r in stored) == sorted(r["key"] for r in records)
  assert "briefly" in (tmp_path / "out" / "report.md").read_text(encoding="utf-8")
  # The rerun finds every sample in the store (same keys).
  again = run(cfg, str(tmp_path / "out"), clock=FakeClock(), progress=False, report=False)
  assert again["run"]["resumed"] == 3 and again["run"]["computed"] == 0


# -- 4. missing files ------------------------------------------------------------------

def test_missing_dataset_file_is_an_error_naming_it(tmp_path):
  with pytest.raises(DatasetError, match=rf"^dataset file not found: {tmp_path / 'nope.jsonl'}$"):
    _run(_config(tmp_path / "nope.jsonl"), tmp_path / "out")
  assert _nothing_written(tmp_path / "out")


# -- 5. output directory ---------------------------------------------------------------

def test_a_file_url_output_dir_is_the_local_directory(tmp_path):
  # Before: every sample computed, then "Unable to get filesystem from specified path"
  # reading the results back; no summary, and every rerun the same.
  data = _write(tmp_path / "ok.jsonl", _good_lines())
  summary = _run(_config(data), f"file://{tmp_path}/out")
  assert summary["samples"] == len(Q)
  assert (tmp_path / "out" / "summary.json").exists() and (tmp_path / "out" / "results.jsonl").exists()


def test_unwritable_output_dir_is_found_before_any_work(tmp_path):
  data = _write(tmp_path / "ok.jsonl", _good_lines())
  blocker = tmp_path / "a_file"
  blocker.write_text("x")
  with pytest.raises(OutputError, match=rf"^output directory is not writable: {blocker}/out \(.*\)$"):
    _run(_config(data), blocker / "out")
  # The output directory is fine but its store is not: also found first.
  out = tmp_path / "out"
  out.mkdir()
  (out / "store").write_text("not a directory")
  with pytest.raises(OutputError, match=rf"^output directory is not writable: {out}/store \(.*\)$"):
    _run(_config(data), out)
  assert not (out / "results.jsonl").exists()


# -- 6. bad checkpoints ----------------------------------------------------------------

def test_bad_checkpoint_is_found_by_the_launcher(tmp_path):
  data = _write(tmp_path / "ok.jsonl", _good_lines())
  junk = tmp_path / "junk.gguf"
  junk.write_bytes(bytes(range(256)) * 64)
  with pytest.raises(CheckpointError, match=rf"^{junk}: not a GGUF file"):
    _run(_config(data, predictor="engine", source=str(junk)), tmp_path / "out")
  from o1jax.testing import tiny_config, write_gguf_checkpoint
  good = tmp_path / "tiny.gguf"
  write_gguf_checkpoint(good, tiny_config())
  cut = tmp_path / "cut.gguf"
  cut.write_bytes(good.read_bytes()[:-1000])
  with pytest.raises(CheckpointError, match=rf"^{cut}: truncated GGUF file: tensor '.*' ends at byte"):
    _run(_config(data, predictor="engine", source=str(cut)), tmp_path / "out")
  assert _nothing_written(tmp_path / "out")



def test_a_tensor_parallel_size_the_heads_do_not_split_into_is_found_by_the_launcher(tmp_path):
  # Before: every worker found it when it loaded the model, the job started (~10 s in).
  data = _write(tmp_path / "ok.jsonl", _good_lines())
  from o1jax.testing import tiny_config, write_gguf_checkpoint
  model = tmp_path / "tiny.gguf"
  write_gguf_checkpoint(model, tiny_config(n_heads=4, n_kv_heads=2))
  cfg = _config(data, predictor="engine", source=str(model))
  cfg.engine.tensor_parallel = 4
  with pytest.raises(ValueError, match=r"^engine\.tensor_parallel=4: tensor parallelism 4: "
                                       r"tiny's n_kv_heads=2 is not a multiple of it$"):
    _run(cfg, tmp_path / "out")
  assert _nothing_written(tmp_path / "out")


def test_speculative_draft_model_checkpoint_is_checked_by_the_launcher(tmp_path):
  """Drafter draft_model loads a second checkpoint in every worker: without one, with a
  corrupt one or with another vocabulary, the launcher says so in one line before any
  work."""
  data = _write(tmp_path / "ok.jsonl", _good_lines())
  from o1jax.testing import tiny_config, write_gguf_checkpoint
  good = tmp_path / "tiny.gguf"
  write_gguf_checkpoint(good, tiny_config())
  cfg = _config(data, predictor="engine", source=str(good))
  cfg.speculative.update(enabled=True, drafter="draft_model")
  with pytest.raises(ValueError, match=r"^speculative\.drafter='draft_model' needs "
                                       r"speculative\.draft_source: the draft checkpoint"):
    _run(cfg, tmp_path / "out")
  junk = tmp_path / "draft.gguf"
  junk.write_bytes(bytes(range(256)) * 64)
  cfg.speculative.draft_source = str(junk)
  with pytest.raises(CheckpointError, match=rf"^speculative\.draft_source: {junk}: not a GGUF file"):
    _run(cfg, tmp_path / "out")
  cfg.speculative.draft_source = str(tmp_path / "missing.gguf")
  with pytest.raises(CheckpointError, match=r"^speculative\.draft_source: .*/missing\.gguf: no "
                                            r"such file or directory$"):
    _run(cfg, tmp_path / "out")
  cfg.speculative.draft_source = "embedded"  # SmolLM2's 49152 tokens, the tiny model's 259
  with pytest.raises(ValueError, match=r"^speculative\.draft_source=embedded: draft model "
                                       r"vocab_size=49152 differs from the target's 259: it must "
                                       r"share the tokenizer$"):
    _run(cfg, tmp_path / "out")
  # An early exit at or past the model's layers: said from the header (a worker loaded the
  # whole model first, then said it).
  cfg.speculative.update(drafter="early_exit", draft_source="", exit_layer=99)
  with pytest.raises(ValueError, match=r"^speculative\.exit_layer=99 must be below the model's "
                                       r"2 layers$"):
    _run(cfg, tmp_path / "out")
  assert _nothing_written(tmp_path / "out")
  assert _nothing_written(tmp_path / "out")

# -- 7. config values out of range -------------------------------------------------------

@pytest.mark.parametrize("section, key, value, message", [
    ("sampling", "max_new_tokens", -5, r"^sampling: max_new_tokens must be an int >= 1, got -5$"),
    ("sampling", "temperature", -1.0, r"^sampling: temperature must be >= 0, got -1\.0$"),
    ("engine", "max_slots", -1,  # (0 is the section's "automatic")
     r"^engine\.max_slots must be an int >= 0 \(0: runner\.batch_size x the batches sharing "
     r"the model\), got -1$"),
    ("engine", "num_blocks", -2, r"^engine\.num_blocks must be an int >= 0 \(0: from "
                                 r"kv_cache_bytes\), got -2$"),
    ("engine", "kv_cache_bytes", 0,  # (was: "or None (the default)", which no flag can give)
     r"^engine\.kv_cache_bytes must be an int >= 1 \(the KV pool's bytes; num_blocks sets it "
     r"in blocks\), got 0$"),
    ("engine", "decode_steps", 0, r"^engine\.decode_steps must be an int >= 1, got 0$"),
    ("engine", "kv_dtype", "int4", r"^engine\.kv_dtype='int4' not in \["),
    # Before: these two started the job and failed in every worker's model load (a Beam
    # traceback of ~180 lines, exit 1).
    ("model", "matmul_dtype", "int4",
     r"^model\.matmul_dtype='int4': valid values are \['float32', 'bfloat16', 'int8', 'float8'\]$"),
    ("model", "backend", "bogus",
     r"^model\.backend='bogus': valid values are \['auto', 'pallas', 'reference'\]$"),
])
def test_out_of_range_config_values_are_named_before_any_work(tmp_path, section, key, value, message):
  # Before: the engine refused each request (every sample a dead letter, exit 0), or each
  # worker failed building its engine inside Beam.
  data = _write(tmp_path / "ok.jsonl", _good_lines())
  cfg = _config(data, predictor="engine", source="embedded")
  cfg[section][key] = value
  with pytest.raises(ValueError, match=message):
    _run(cfg, tmp_path / "out")
  assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("task", ["humaneval", "suite"])
def test_a_code_prompt_style_the_task_does_not_have_is_named_before_any_work(tmp_path, task):
  # Before: HumanEval never read prompt.style (any value ran the raw completion prompt).
  import importlib
  cfg = importlib.import_module(f"configs.{task}").get_config()
  key = "style" if task == "humaneval" else "code_style"
  cfg.prompt[key] = "nope"
  with pytest.raises(ValueError, match=rf"^prompt\.{key}='nope': valid styles are "
                                       rf"\['chat', 'completion'\]$"):
    _run(cfg, tmp_path / "out")
  assert not (tmp_path / "out").exists()


def _without(cfg, dotted):
  """A copy of `cfg` (a config file of one's own) without the key or section `dotted`."""
  import ml_collections
  plain = cfg.to_dict()
  *parents, last = dotted.split(".")
  node = plain
  for part in parents:
    node = node[part]
  del node[last]
  return ml_collections.ConfigDict(plain)


@pytest.mark.parametrize("task, dotted, message", [
    ("custom", "policy", r"^config has no section 'policy': every config has \['task', 'model', "),
    ("custom", "task", r"^config has no key 'task': "),
    ("custom", "sampling.seed", r"^config key sampling\.seed is missing: the sampling section has "
                                r"\['max_new_tokens', 'temperature', 'top_k', 'top_p'\] "),
    ("custom", "runner.batch_size", r"^config key runner\.batch_size is missing: "),
    # read by the task: named by its section (task_specs.ConfigSection)
    ("custom", "dataset.answer_format", r"^dataset\.answer_format=None: expected one of "),
    ("custom", "dataset.question_field", r"^config key dataset\.question_field is missing: the "
                                         r"dataset section has \['answer_field', "),
    ("humaneval", "sandbox", r"^config has no sandbox section: task humaneval runs programs in "),
    ("humaneval", "sandbox.memory_mb", r"^config key sandbox\.memory_mb is missing: "),
])
def test_a_config_file_without_a_part_a_run_reads_is_one_line(tmp_path, task, dotted, message):
  # Before: an AttributeError or KeyError traceback from the launcher ("'policy'").
  from configs import humaneval as humaneval_config
  data = _write(tmp_path / "ok.jsonl", _good_lines())
  cfg = _config(data) if task == "custom" else humaneval_config.get_config("smoke=True")
  if task == "humaneval":
    cfg.model.predictor = "fake"
  with pytest.raises(ValueError, match=message):
    _run(_without(cfg, dotted), tmp_path / "out")
  assert not (tmp_path / "out" / "store").exists() or _nothing_written(tmp_path / "out")


@pytest.mark.parametrize("value, message", [
    (5, "config: get_config() must return an ml_collections.ConfigDict, got int"),
    ({"task": "gsm8k"}, "config: get_config() must return an ml_collections.ConfigDict, got dict")])
def test_a_config_that_is_not_a_config_dict_is_one_line(tmp_path, value, message):
  with pytest.raises(ValueError) as e:
    _run(value, tmp_path / "out")
  assert str(e.value) == message


def test_an_empty_output_dir_or_model_source_and_a_lock_that_is_a_directory_are_named(tmp_path):
  # Before: "output directory is not writable:  (No such file or directory)", ".: directory
  # holds neither o1jax_model.json ...", "output directory is not writable: DIR (Is a directory)".
  from pipelines.eval import LOCK_NAME
  data = _write(tmp_path / "ok.jsonl", _good_lines())
  with pytest.raises(OutputError, match=r"^--output_dir is empty: name the directory for the results$"):
    _run(_config(data), "")
  with pytest.raises(ValueError, match=r"^model\.source is empty: name a checkpoint \(a \.gguf file"):
    _run(_config(data, predictor="engine", source=""), tmp_path / "out")
  (tmp_path / "locked" / LOCK_NAME).mkdir(parents=True)
  with pytest.raises(OutputError) as e:
    _run(_config(data), tmp_path / "locked")
  assert str(e.value) == (f"the run lock {tmp_path}/locked/{LOCK_NAME} is a directory: remove it "
                          f"(the run creates the file)")


def _policy_run_config(tmp_path, policy: str, predictor: str = "fake"):
  """The custom task's smoke config over good lines, with `policy` on `predictor`."""
  cfg = custom_config.get_config(f"smoke=True,policy={policy}")
  cfg.model.predictor = predictor
  cfg.dataset.path = str(_write(tmp_path / "ok.jsonl", _good_lines()))
  return cfg


def test_policy_sampling_values_name_the_policy(tmp_path):
  cfg = _policy_run_config(tmp_path, "sample_n")
  cfg.policy.top_p = 2.0
  with pytest.raises(ValueError, match=r"^policy sample_n: top_p must be in \(0, 1\], got 2\.0$"):
    _run(cfg, tmp_path / "out")


@pytest.mark.parametrize("policy, field, value", [
    ("sample_n", "temperature", 0.2), ("sample_n", "top_p", 0.5),
    ("self_consistency", "top_k", 3), ("deepconf", "temperature", 0.9)])
def test_sampling_values_a_policy_replaces_are_refused(tmp_path, policy, field, value):
  # Before: run without a word with the policy's own values (a controller policy's record
  # even showed the section's, and they entered the content hash).
  cfg = _policy_run_config(tmp_path, policy, "fake" if policy == "sample_n" else "engine")
  cfg.sampling[field] = value
  own = getattr(build_policy(cfg.policy.to_dict()), field)
  with pytest.raises(ValueError, match=re.escape(
      f"sampling.{field}={value!r} is not used: policy {policy} samples with its own {field} "
      f"({own!r}); set policy.{field} instead")):
    _run(cfg, tmp_path / "out")
  assert _nothing_written(tmp_path / "out")


def test_greedy_reads_the_sampling_section(tmp_path):
  cfg = _policy_run_config(tmp_path, "greedy")
  cfg.sampling.temperature = 0.5
  _run(cfg, tmp_path / "out")
  with open(tmp_path / "out" / "results.jsonl") as f:
    assert all(json.loads(line)["trace"]["sampling"]["temperature"] == 0.5 for line in f)


# -- 8. a request the model refuses --------------------------------------------------------

class RefusingPredictor:
  """The fake predictor, refusing (as the engine refuses a prompt longer than the model's
  context: a ValueError for the whole batch) any batch holding a question with 'REFUSE'."""

  def predict(self, items):
    from pipelines.predictors import FakePredictor
    for item in items:
      if "REFUSE" in item.example["question"]:
        raise ValueError(f"request {item.request_id}: prompt has 999 tokens but the context is 128 tokens")
    return FakePredictor().predict(items)


def _refusing_loader(spec):
  del spec
  return RefusingPredictor()


@pytest.mark.parametrize("batch_size", [4, 1])
def test_a_refused_request_is_one_dead_letter_and_its_batch_runs(tmp_path, batch_size):
  # Before: the whole batch of 4 went to dead letters with the refused request's reason;
  # alone in its batch, its reason was Beam's repr ("ValueError('request ...')"): the dead
  # letter's text changed when a resumed run batched it alone.
  lines = _good_lines()
  data = _write(tmp_path / "mixed.jsonl", [lines[0], json.dumps({"question": "REFUSE me", "answer": "1"}),
                                           lines[1], lines[2]])
  cfg = _config(data)
  cfg.runner.batch_size = batch_size
  summary = run(cfg, str(tmp_path / "out"), clock=FakeClock(), progress=False, report=False,
                loader=_refusing_loader)
  records = [json.loads(l) for l in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
  assert [r["example_index"] for r in records] == [0, 2, 3]
  (dead,) = [json.loads(l) for l in (tmp_path / "out" / "dead_letters.jsonl").read_text().splitlines()]
  assert dead["stage"] == "inference" and dead["sample_index"] == 0
  assert dead["reason"].startswith("ValueError: request ") and dead["reason"].endswith("the context is 128 tokens")
  assert dead["example_id"] not in {r["example_id"] for r in records}
  assert summary["samples"] == 3 and summary["dead_letters"]["by_stage"] == {"inference": 1}


@pytest.mark.parametrize("predictor,policy", [("engine", "greedy"), ("generator", "greedy"),
                                              ("engine", "greedy_cot")])
def test_samples_whose_logits_overflow_are_inference_dead_letters(tmp_path, predictor, policy):
  """A finite weight that overflows (3e38 in the final norm: the load accepts it) gives NaN
  logits; the engine and the generator end such a sample with finish reason "error", the
  controller's traces have a NaN mean log-prob, and the job puts them in dead letters
  instead of scoring the last token id repeated."""
  import numpy as np
  from safetensors.numpy import load_file, save_file
  from o1jax.testing import tiny_config, write_hf_checkpoint
  model = tmp_path / "overflow"
  write_hf_checkpoint(model, tiny_config(max_context=512), seed=0)
  weights = load_file(str(model / "model.safetensors"))
  weights["model.norm.weight"] = np.full_like(weights["model.norm.weight"], 3e38)
  save_file(weights, str(model / "model.safetensors"))
  data = _write(tmp_path / "ok.jsonl", _good_lines())
  cfg = _config(data, predictor=predictor, source=str(model))
  if policy != "greedy":
    cfg.policy = custom_config.get_config(f"smoke=True,policy={policy}").policy
  summary = _run(cfg, tmp_path / "out")
  dead = [json.loads(l) for l in (tmp_path / "out" / "dead_letters.jsonl").read_text().splitlines()]
  assert summary["samples"] == 0 and summary["dead_letters"]["by_stage"] == {"inference": 3}
  want = ("after 0 tokens: " if policy == "greedy" else "in trace 0 (of 1): ")
  assert all(d["reason"] == f"the model's logits were not finite (NaN or inf) {want}its "
                            f"weights or activations overflow" for d in dead), dead


def _device_short_loader(spec):
  from o1jax.sharding.tensor_parallel import group_mesh
  group_mesh(2)  # this process has 1 CPU device
  raise AssertionError("unreachable")


def test_a_model_no_worker_can_load_stops_the_run_in_one_line(tmp_path):
  """A spec the launcher cannot check (here: more devices than the worker has) fails in
  the workers' `load_model`: one line naming what is missing, nothing stored. With the
  multi-processing runner the launcher gets the worker's traceback as text."""
  from pipelines.beam.handler import ModelLoadError
  from pipelines.eval import worker_error
  data = _write(tmp_path / "ok.jsonl", _good_lines())
  with pytest.raises(ModelLoadError, match=r"^a worker could not load the model: "
                                           r"tensor_parallel=2 needs 2 devices; this process "
                                           r"has 1$"):
    run(_config(data), str(tmp_path / "out"), clock=FakeClock(), progress=False, report=False,
        loader=_device_short_loader)
  assert _nothing_written(tmp_path / "out")
  text = ("Traceback (most recent call last):\n  File \"handler.py\", line 60, in load_model\n"
          "pipelines.beam.handler.ModelLoadError: a worker could not load the model: "
          "tensor_parallel=2 needs 2 devices; this process has 1 [while running "
          "'RunInference/BeamML_RunInference/ParDo(_RunInferenceDoFn)']")
  found = worker_error(RuntimeError(text))
  assert type(found) is ModelLoadError and str(found) == (
      "a worker could not load the model: tensor_parallel=2 needs 2 devices; this process has 1")
  assert worker_error(RuntimeError("ValueError: something else")) is None


@pytest.mark.parametrize("section, key, value, where, message", [
    # Before: every sample a dead letter ("the request may need 3 KV blocks but the pool has
    # 1"), exit 1 after the model ran; found once the work items are known.
    ("engine", "num_blocks", 1, "launcher",
     r"^engine\.num_blocks=1 holds 16 tokens: no request fits \(even a 1-token prompt with "
     r"the job's smallest max_new_tokens, \d+, needs"),
    # Before: every sample a dead letter with JAX's "Only interpret mode is supported on CPU
    # backend.", exit 1 "no sample was scored"; found by the workers' model load.
    ("model", "backend", "pallas", "worker",
     r"^a worker could not load the model: model\.backend='pallas' runs the Pallas kernels "
     r"compiled for a GPU, and this machine has none"),
])
def test_settings_no_request_can_run_under_stop_the_run_in_one_line(tmp_path, section, key,
                                                                    value, where, message):
  from pipelines.beam.handler import ModelLoadError
  data = _write(tmp_path / "ok.jsonl", _good_lines())
  cfg = _config(data, predictor="engine", source="embedded")
  cfg[section][key] = value
  with pytest.raises(ModelLoadError if where == "worker" else ValueError, match=message):
    _run(cfg, tmp_path / "out")
  assert _nothing_written(tmp_path / "out")


def test_a_pool_that_holds_no_prompt_of_the_job_stops_the_run_in_one_line(tmp_path):
  # 2 blocks of 16 hold a 1-token prompt and 8 new tokens, not the job's chat prompts (the
  # template alone is ~30 tokens). Before: every sample a dead letter after the model
  # loaded, exit 1 "no sample was scored".
  data = _write(tmp_path / "ok.jsonl", _good_lines())
  cfg = _config(data, predictor="engine", source="embedded")
  cfg.engine.num_blocks = 2
  cfg.sampling.max_new_tokens = 8
  with pytest.raises(ValueError, match=r"^engine\.num_blocks=2 holds 32 tokens: no request "
                                       r"fits \(the shortest need is a \d+-token prompt with "
                                       r"max_new_tokens 8: \d+ blocks of 16\); raise it"):
    _run(cfg, tmp_path / "out")
  assert _nothing_written(tmp_path / "out")


def test_weights_only_the_load_finds_bad_stop_the_run_in_one_line(tmp_path):
  """NaN weights pass the header check (they need the values): the workers' load finds
  them, and the run stops with its one line, nothing stored."""
  from o1jax.testing import tiny_config, write_gguf_with_a_nan_scale
  from pipelines.beam.handler import ModelLoadError
  data = _write(tmp_path / "ok.jsonl", _good_lines())
  path = tmp_path / "nan.gguf"
  write_gguf_with_a_nan_scale(path, tiny_config())
  with pytest.raises(ModelLoadError, match=rf"^a worker could not load the model: {path}: tensor "
                                           r"'layers\.1\.w_down' has 1 non-finite scales"):
    _run(_config(data, predictor="engine", source=str(path)), tmp_path / "out")
  assert _nothing_written(tmp_path / "out")


def test_options_the_runner_refuses_are_one_line_before_anything_is_made(tmp_path):
  # Before: Beam's "Pipeline has validations errors:" over five lines, after the output
  # directory and its store/ were made.
  data = _write(tmp_path / "ok.jsonl", _good_lines())
  cfg = _config(data)
  cfg.runner.name = "DataflowRunner"
  with pytest.raises(ValueError, match=r"^Beam flags for the DataflowRunner: Missing GCS path "
                                       r"option: temp_location; .*Missing required option: "
                                       r"project; Missing required option: region$"):
    _run(cfg, tmp_path / "out")
  assert not (tmp_path / "out").exists()


def test_a_worker_process_that_dies_is_one_line():
  """A worker killed mid-run (the out-of-memory killer) ended the launcher with Beam's ~80
  lines of traceback; the run's error is now one line (the kill itself: by hand, see the
  session note of 2026-12-06)."""
  from pipelines.eval import WorkerLostError, worker_lost_error
  try:
    try:
      raise RuntimeError("Channel closed prematurely.")
    except RuntimeError as cause:
      raise RuntimeError("Pipeline failed") from cause
  except RuntimeError as e:
    error = worker_lost_error(e)
  assert isinstance(error, WorkerLostError) and str(error) == (
      "a worker process ended during the run (Channel closed prematurely: killed, or out of "
      "memory?); the finished samples are stored: rerun the same command to resume")
  assert worker_lost_error(RuntimeError("something else")) is None
  # Dask with runner.share_model: the worker serving the model was killed; another's
  # RunInference.finish_bundle read EOF from its proxy's connection (a traceback of ~80
  # lines before).
  import gzip
  import multiprocessing
  reader, writer = multiprocessing.Pipe(duplex=False)
  writer.close()
  try:
    reader.recv()
  except EOFError as e:
    error = worker_lost_error(e)
  assert str(error) == (
      "a worker process ended during the run (the process serving the shared model: killed, "
      "or out of memory?); the finished samples are stored: rerun the same command to resume")
  # An EOF from anywhere else is the run's own error (a dataset cut short after the scan).
  try:
    gzip.decompress(gzip.compress(b"x" * 100)[:-8])
  except EOFError as e:
    assert worker_lost_error(e) is None


@pytest.mark.parametrize("runner, text", [
    ("FlinkRunner", "Unable to fetch remote job server jar at https://repo/flink-job-server.jar: "
                    "<urlopen error [Errno -2] Name or service not known>. Also failed ..."),
    ("PrismRunner", "Unable to fetch remote prism binary at https://host/prism.zip: <urlopen "
                    "error [Errno -2] Name or service not known>"),
])
def test_a_runner_that_cannot_start_its_job_server_is_one_line(runner, text):
  """Flink, Spark and Prism fetch a job server at run time (not testable end to end here:
  a machine with a network would download it); the launcher's line for Beam's error."""
  import urllib.error

  from apache_beam.options.pipeline_options import PipelineOptions

  from pipelines.eval import runner_start_error
  try:
    try:
      raise urllib.error.URLError("Name or service not known")
    except urllib.error.URLError as cause:
      raise RuntimeError(text) from cause
  except RuntimeError as e:
    error = runner_start_error(e, PipelineOptions([f"--runner={runner}"]))
  assert str(error) == f"runner {runner} could not start its job server: {text}"
  assert runner_start_error(RuntimeError("a worker failed"), PipelineOptions([])) is None


def test_a_run_that_scores_nothing_has_no_accuracy(tmp_path):
  # Before: every example refused gave "accuracy": {"exact": 0.0}, which reads as a result.
  data = _write(tmp_path / "refused.jsonl", [json.dumps({"question": f"REFUSE {i}", "answer": "1"})
                                             for i in range(3)])
  summary = run(_config(data), str(tmp_path / "out"), clock=FakeClock(), progress=False,
                report=False, loader=_refusing_loader)
  assert summary["samples"] == 0 and summary["dead_letters"]["by_stage"] == {"inference": 3}
  assert summary["accuracy"] == {} and summary["sample_accuracy"] is None


@pytest.mark.parametrize("key, value, beam_flags, message", [
    ("batch_size", 0, (), r"^runner\.batch_size=0: expected an int >= 1 \(examples per batch\)$"),
    ("direct_running_mode", "bogus", (),
     r"^Beam flags: argument --direct_running_mode: invalid choice: 'bogus' \(choose from "
     r"'in_memory', 'multi_threading', 'multi_processing'\)$"),
    ("direct_num_workers", -1, (), r"^runner\.direct_num_workers=-1: expected an int >= 0"),
    (None, None, ("--num_workers=abc",),
     r"^Beam flags: argument --num_workers: invalid int value: 'abc'$"),
    # Before: the flag won (three workers) and the summary said the config's 1.
    (None, None, ("--direct_num_workers=3",),
     r"^Beam flag --direct_num_workers=3 after -- sets what runner\.direct_num_workers=1 "
     r"holds: give --config\.runner\.direct_num_workers=3 instead$"),
    # Before: Beam dropped a flag it does not define with a warning, and the run went on
    # with the config's value (a typo) or without what the flag asked for.
    (None, None, ("--direct_num_worker=3",),
     r"^Beam flags after --: --direct_num_worker is no Beam option \(the DirectRunner would "
     r"ignore it\)$"),
    (None, None, ("--nosave_main_session", "--bogus=1"),
     r"^Beam flags after --: --bogus, --nosave_main_session are no Beam option "),
    ("name", "dask", ("--dask_local_worker=3",),
     r"^Beam flags after --: --dask_local_worker is no Beam option \(the dask runner would "
     r"ignore it\)$"),
])
def test_runner_values_are_named_before_any_work(tmp_path, key, value, beam_flags, message):
  # Before: batch_size=0 was blamed on engine.max_slots (or "batch_size must be >= 1"); a bad
  # running mode or Beam flag was argparse's usage text in eval.log and "the run failed".
  data = _write(tmp_path / "ok.jsonl", _good_lines())
  cfg = _config(data)
  if key:
    cfg.runner[key] = value
  with pytest.raises(ValueError, match=message):
    run(cfg, str(tmp_path / "out"), beam_flags, clock=FakeClock(), progress=False, report=False)
  assert _nothing_written(tmp_path / "out")


def test_chat_prompts_for_a_model_without_chat_are_found_by_the_launcher(tmp_path, monkeypatch):
  """A base model (Gemma 3 270M: no chat template, no ChatML tokens) with a chat prompt
  style: every sample went to dead letters in the workers ("give the prompt as plain
  text"), the run ended with none scored. Now one line naming the settings to change."""
  import tokenizers
  from tokenizers import models
  import o1jax.checkpoint
  from o1jax.checkpoint import Tokenizer
  from o1jax.testing import tiny_config, write_gguf_checkpoint
  base = Tokenizer(tokenizers.Tokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[])),
                   bos_id=None, eos_ids=[1], add_bos=False, chat_template=None)
  assert "no chat template" in base.chat_unavailable()
  with pytest.raises(ValueError, match=r"no chat template.*: give the prompt as plain text$"):
    base.encode_chat([{"role": "user", "content": "a"}])
  model = tmp_path / "tiny.gguf"
  write_gguf_checkpoint(model, tiny_config())
  assert o1jax.checkpoint.load_tokenizer(model).chat_unavailable() is None  # (ChatML tokens)
  monkeypatch.setattr(o1jax.checkpoint, "load_tokenizer", lambda source: base)
  data = _write(tmp_path / "ok.jsonl", _good_lines())
  cfg = _config(data, predictor="engine", source=str(model))
  assert cfg.prompt.style == "chat"
  with pytest.raises(ValueError, match=rf"^model\.source={model}: this checkpoint has no chat "
                                       r"template.*give a text prompt style \(prompt.style="):
    _run(cfg, tmp_path / "out")
  assert _nothing_written(tmp_path / "out")


def test_an_output_dir_holding_another_tasks_run_is_refused(tmp_path):
  """Every config defaults to runs/default: a suite or HumanEval run there replaced the
  default GSM8K run's results.jsonl, summary.json and report.md. The same task resumes."""
  data = _write(tmp_path / "ok.jsonl", _good_lines())
  out = tmp_path / "out"
  _run(_config(data), out)
  summary = json.loads((out / "summary.json").read_text())
  assert summary["task"] == "custom"
  _run(_config(data), out)  # the same task: a resume
  (out / "summary.json").write_text(json.dumps({**summary, "task": "gsm8k"}))
  with pytest.raises(OutputError, match=rf"^{out} holds a gsm8k run \(summary.json\): give this "
                                        r"custom run its own --output_dir$"):
    _run(_config(data), out)
  # A summary.json that cannot be read is said (the check passed over it without a word).
  for garbled, why in (('{"task": ', "JSONDecodeError"), ("[1, 2]", "a JSON list, not an object")):
    (out / "summary.json").write_text(garbled)
    console = io.StringIO()
    _run(_config(data), out, console=console)
    assert f"warning: {out}/summary.json cannot be read ({why}" in console.getvalue()


def test_files_no_run_wrote_and_datasets_among_the_results_are_left_alone(tmp_path):
  """A run deleted every results.jsonl, summary.json and report.md in its output directory
  before the job, whoever wrote them: the user's notes, a results.jsonl given as the
  dataset (the job then found no dataset); a pattern OUT/*.jsonl read the run's own dead
  letters and ended in "dataset file ... changed". Each is refused before any work."""
  from pipelines.datasets import DatasetError
  mine = tmp_path / "mine"
  mine.mkdir()
  (mine / "report.md").write_text("my notes")
  data = _write(mine / "results.jsonl", _good_lines())
  with pytest.raises(DatasetError, match=rf"^dataset.path={data} is this run's results.jsonl "
                                         rf"in --output_dir {mine}: the run writes"):
    _run(_config(data), mine)
  other = _write(tmp_path / "ok.jsonl", _good_lines())
  with pytest.raises(OutputError, match=rf"^--output_dir {mine} holds results.jsonl, report.md, "
                                        r"which no run wrote \(it has no \.o1jax-eval\.lock\): "):
    _run(_config(other), mine)
  assert (mine / "report.md").read_text() == "my notes" and data.read_text()
  pattern = tmp_path / "both"
  pattern.mkdir()
  _write(pattern / "data.jsonl", _good_lines())
  with pytest.raises(DatasetError, match=r"^dataset.path=.*/both/\*\.jsonl matches this run's "
                                         r"results.jsonl in --output_dir "):
    _run(_config(str(pattern / "*.jsonl")), pattern)
  _run(_config(str(pattern / "data.jsonl")), pattern)  # a dataset file of its own name: runs
  assert (pattern / "summary.json").exists()
  # The same through a link to the output directory, and under a directory whose name
  # reads as a pattern (both ran, then "dead_letters.jsonl changed while the job ran").
  (tmp_path / "link").symlink_to(pattern)
  with pytest.raises(DatasetError, match=r"(is|matches) this run's results.jsonl in --output_dir "):
    _run(_config(str(pattern / "*.jsonl")), tmp_path / "link")
  bracket = tmp_path / "runs[1]"
  bracket.mkdir()
  _write(bracket / "data.jsonl", _good_lines())
  with pytest.raises(DatasetError, match=r"(is|matches) this run's results.jsonl in --output_dir "):
    _run(_config(str(bracket / "*.jsonl")), bracket)
  # A run's directory copied without its lock (cp -r run/* other/) resumes there.
  copy = tmp_path / "copy"
  copy.mkdir()
  for item in pattern.iterdir():
    if item.name != ".o1jax-eval.lock" and item.is_file():
      (copy / item.name).write_bytes(item.read_bytes())
  _run(_config(str(pattern / "data.jsonl")), copy)


@pytest.mark.parametrize("section, key, value, message", [
    # Before: every sample a dead letter ("sleep length must be non-negative"), exit 1.
    ("model", "fake_delay_s", -1.0, r"^model\.fake_delay_s=-1\.0: expected seconds >= 0$"),
    ("model", "fake_delay_s", float("nan"), r"^model\.fake_delay_s=nan: expected seconds >= 0$"),
    # Before: accepted with the DirectRunner (the dask runner refused it).
    ("runner", "partitions", -5, r"^runner\.partitions=-5: expected an integer >= 0$"),
    # Before: the engine section was checked only when the engine ran.
    ("engine", "block_size", 0, r"^engine\.block_size must be"),
    ("engine", "kv_dtype", "bfloat", r"kv_dtype"),
    # Before: int(True) and float(True): top_k=True ran as top_k=1.
    ("sampling", "top_k", True, r"^sampling\.top_k=True: expected a number, not a bool$"),
    # Before: "(the generator does not speculate)" for the fake model.
    ("speculative", "enabled", True, r"this run uses 'fake' \(the fake model does not speculate\)$"),
])
def test_settings_a_fake_run_does_not_read_are_checked_before_any_work(tmp_path, section, key,
                                                                       value, message):
  data = _write(tmp_path / "ok.jsonl", _good_lines())
  cfg = _config(data)
  with cfg.unlocked() if hasattr(cfg, "unlocked") else contextlib.nullcontext():
    cfg[section][key] = value
  with pytest.raises(ValueError, match=message):
    _run(cfg, tmp_path / "out")
  assert _nothing_written(tmp_path / "out")


def test_an_output_dir_with_white_space_at_an_end_is_refused(tmp_path):
  from pipelines.beam.store import OutputError
  data = _write(tmp_path / "ok.jsonl", _good_lines())
  with pytest.raises(OutputError, match=r"starts or ends with white space"):
    _run(_config(data), f"{tmp_path}/out ")
  assert not list(tmp_path.glob("out*"))


def test_relative_paths_through_a_link_and_dotdot_name_what_the_os_resolves(tmp_path, monkeypatch):
  # The launcher makes relative paths absolute for a cluster's workers: abspath dropped
  # "link/.." lexically and named another file (a decoy of the same name here) and left a
  # stray store directory where "link/../out" does not lead.
  (tmp_path / "elsewhere" / "sub").mkdir(parents=True)
  (tmp_path / "cwd").mkdir()
  (tmp_path / "cwd" / "lnk").symlink_to(tmp_path / "elsewhere" / "sub")
  _write(tmp_path / "elsewhere" / "data.jsonl", _good_lines())
  _write(tmp_path / "cwd" / "data.jsonl", [json.dumps({"question": "decoy?", "answer": "99"})])
  monkeypatch.chdir(tmp_path / "cwd")
  summary = _run(_config("lnk/../data.jsonl"), "lnk/../out")
  assert summary["examples"] == 3
  # A file:// URL is the local path (it failed in Beam's file systems, which know no "file"
  # scheme: "pip install apache-beam[gcp]"), relative ones from here too.
  for url in ("file://lnk/../data.jsonl", f"file://{tmp_path}/elsewhere/data.jsonl"):
    assert _run(_config(url), tmp_path / "url")["examples"] == 3
  records = [json.loads(l) for l in (tmp_path / "elsewhere" / "out" / "results.jsonl").read_text().splitlines()]
  assert [r["reference"] for r in records] == [a for _, a in Q]
  assert not (tmp_path / "cwd" / "out").exists()
