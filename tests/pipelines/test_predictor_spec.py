"""PredictorSpec: the model section's matmul_dtype, the engine section's kv_dtype and the
controller section's cache reach the model / engine / controller and the content hash."""

import json
import jax.numpy as jnp
import pytest

from configs import custom as custom_config
from configs import gsm8k as gsm8k_config
from o1jax.testing import tiny_config, write_hf_checkpoint
from o1jax.controller.sampling_policies import SamplingSpec
from pipelines.predictors import PredictorSpec, _load_model, engine_config, model_fingerprint


def test_matmul_dtype_flows_from_config_to_model_and_fingerprint(tmp_path):
  write_hf_checkpoint(tmp_path, tiny_config(max_context=64), seed=1)
  cfg = gsm8k_config.get_config("smoke=True")
  cfg.model.source = str(tmp_path)
  default = PredictorSpec.from_config(cfg.model, name="generator")
  assert default.matmul_dtype == "float32"
  cfg.model.matmul_dtype = "bfloat16"
  fast = PredictorSpec.from_config(cfg.model, name="generator")
  model, _ = _load_model(fast)
  assert model.matmul_dtype == "bfloat16"
  # results computed with other numerics must not be reused from the store
  assert model_fingerprint(fast) != model_fingerprint(default)
  assert "matmul_dtype" not in model_fingerprint(default)  # f32 hashes stay as before


def test_an_adaptive_budget_hashes_by_its_values_not_their_spelling():
  """5 and 5.0 are one SLO (a config file or dict may write either; the CLI writes floats):
  before, their content hashes differed and a resumed run computed everything again."""
  cfg = gsm8k_config.get_config("smoke=True")
  spec = lambda **b: PredictorSpec.from_config(cfg.model, name="engine", batch_size=4,
                                               engine=cfg.engine, budget={**cfg.budget, **b})
  # (as the store hashes it: JSON, where 5 and 5.0 differ; as dicts they compare equal)
  model_fingerprint_json = lambda s: json.dumps(model_fingerprint(s), sort_keys=True)
  fixed = model_fingerprint(spec())
  assert "budget" not in fixed and model_fingerprint(spec(latency_slo_s=3.0)) == fixed
  adaptive = model_fingerprint_json(spec(mode="adaptive", latency_slo_s=5.0, kv_limit=1.0))
  assert model_fingerprint_json(spec(mode="adaptive", latency_slo_s=5, kv_limit=1)) == adaptive
  assert '"latency_slo_s": 5.0' in adaptive
  assert model_fingerprint_json(spec(mode="adaptive", latency_slo_s=4.0, kv_limit=1.0)) != adaptive
  # A section's keys as given (a partial one's hash is what it was: no defaults added).
  partial = PredictorSpec.from_config(cfg.model, name="engine", batch_size=4, engine=cfg.engine,
                                      budget={"mode": "adaptive"})
  assert model_fingerprint(partial)["budget"] == {"mode": "adaptive"}


def test_kv_dtype_flows_from_config_to_engine_and_fingerprint():
  cfg = gsm8k_config.get_config("smoke=True")
  default = PredictorSpec.from_config(cfg.model, name="engine", batch_size=4, engine=cfg.engine)
  assert engine_config(default).kv_dtype == "float32"
  assert "kv_dtype" not in model_fingerprint(default)  # f32 hashes stay as before
  cfg.engine.kv_dtype = "bfloat16"
  narrow = PredictorSpec.from_config(cfg.model, name="engine", batch_size=4, engine=cfg.engine)
  assert engine_config(narrow).kv_dtype == "bfloat16"
  assert model_fingerprint(narrow)["kv_dtype"] == "bfloat16"
  assert "kv_scales" not in model_fingerprint(narrow)


def test_an_fp8_kv_runs_hash_its_per_token_scales_only():
  """An FP8 pool stores each token under its own scale: the block size, the prefill chunk
  and speculation do not change what it stores (tests/o1jax/engine/test_fp8_engine.py),
  so they stay out of the hash; the per-token scales keep runs of earlier versions (a
  scale per block) from resuming."""
  cfg = gsm8k_config.get_config("smoke=True")
  cfg.engine.kv_dtype = "float8_e4m3fn"
  spec = lambda: PredictorSpec.from_config(cfg.model, name="engine", batch_size=4,
                                           engine=cfg.engine, speculative=cfg.speculative)
  first = model_fingerprint(spec())
  assert first["kv_dtype"] == "float8_e4m3fn" and first["kv_scales"] == "per_token"
  assert "kv_writes" not in first
  cfg.engine.prefill_chunk = 64
  cfg.engine.block_size = 32
  assert model_fingerprint(spec()) == first


def test_controller_cache_flows_from_config_to_the_decode_model_and_fingerprint(tmp_path):
  from pipelines.beam import build_plan
  from pipelines.predictors import build_predictor

  write_hf_checkpoint(tmp_path, tiny_config(max_context=64), seed=1)
  cfg = gsm8k_config.get_config("policy=greedy_cot,smoke=True")
  cfg.model.source = str(tmp_path)
  paged = build_plan(cfg, "unused_output_dir").predictor
  assert dict(paged.controller) == {"cache": "paged", "block_size": 16, "num_blocks": 0,
                                    "kv_dtype": "float32"}  # the engine section's, read once
  assert model_fingerprint(paged)["controller_cache"] == {"cache": "paged", "block_size": 16}
  assert type(build_predictor(paged).controller.model).__name__ == "PagedLlama"
  cfg.controller.num_blocks = 512  # fits or raises: never another result, so not in the hash
  assert model_fingerprint(build_plan(cfg, "unused_output_dir").predictor) == model_fingerprint(paged)
  cfg.controller.cache = "contiguous"
  contiguous = build_plan(cfg, "unused_output_dir").predictor
  assert "controller_cache" not in model_fingerprint(contiguous)  # contiguous hashes stay as before
  assert type(build_predictor(contiguous).controller.model).__name__ == "ContiguousLlama"
  cfg.engine.kv_dtype = "float8_e4m3fn"  # the contiguous cache stores f32/bf16: refused at plan time
  with pytest.raises(ValueError, match="float8_e4m3fn needs cache='paged'"):
    build_plan(cfg, "unused_output_dir")
  cfg.controller.cache = "paged"
  narrow = build_plan(cfg, "unused_output_dir").predictor
  assert build_predictor(narrow).controller.model.kv_dtype == "float8_e4m3fn"
  cfg.controller.cache = "pagd"
  with pytest.raises(ValueError, match=r"cache='pagd': valid caches are \['contiguous', 'paged'\]"):
    build_plan(cfg, "unused_output_dir")


def test_a_controller_pool_no_request_fits_is_refused_at_plan_time(tmp_path):
  # Before: the plan took controller.num_blocks=1, and every request overflowed the pool
  # (each sample a dead letter, after the model loaded).
  from pipelines.beam import build_plan
  write_hf_checkpoint(tmp_path, tiny_config(max_context=64), seed=1)
  cfg = gsm8k_config.get_config("policy=self_consistency,smoke=True")
  cfg.model.source = str(tmp_path)
  cfg.policy.n = 4
  cfg.controller.num_blocks = 4
  with pytest.raises(ValueError, match=r"^controller\.num_blocks=4: a request of 4 trace\(s\) "
                                       r"needs at least 5 blocks \(each trace writes"):
    build_plan(cfg, "unused_output_dir")
  cfg.controller.num_blocks = 5  # the least one request needs (long prompts: per request)
  assert dict(build_plan(cfg, "unused_output_dir").predictor.controller)["num_blocks"] == 5
  cfg.controller.update(cache="contiguous", num_blocks=1)  # no pool: the setting is unused
  assert dict(build_plan(cfg, "unused_output_dir").predictor.controller)["cache"] == "contiguous"


@pytest.mark.parametrize("policy, predictor, attribute", [
    ("greedy_cot", "controller", "controller"), ("greedy", "engine", "engine"),
    ("greedy", "generator", "generator")])
def test_model_thinking_flows_from_config_to_every_predictor_and_fingerprint(
    tmp_path, policy, predictor, attribute):
  from pipelines.beam import build_plan
  from pipelines.predictors import build_predictor

  write_hf_checkpoint(tmp_path, tiny_config(max_context=64), seed=1)
  cfg = gsm8k_config.get_config(f"policy={policy},smoke=True")
  cfg.model.source = str(tmp_path)
  cfg.model.predictor = predictor
  auto = build_plan(cfg, "unused_output_dir").predictor
  assert auto.name == predictor
  assert getattr(build_predictor(auto), attribute).thinking is None  # ChatML names none
  assert "thinking" not in model_fingerprint(auto)  # auto follows the checkpoint: old hashes
  cfg.model.thinking = "<think> </think>"
  spec = build_plan(cfg, "unused_output_dir").predictor
  assert getattr(build_predictor(spec), attribute).thinking.close == "</think>"
  assert model_fingerprint(spec)["thinking"] == "<think> </think>"
  assert "chat_template_thinking" not in model_fingerprint(spec)
  # "off" renders a template's enable_thinking off since 2026-12-07: samples stored
  # before (which thought) are not resumed as its.
  cfg.model.thinking = "off"
  spec = build_plan(cfg, "unused_output_dir").predictor
  assert model_fingerprint(spec)["chat_template_thinking"] == "off"
  cfg.model.thinking = "sometimes"  # refused before any worker starts
  with pytest.raises(ValueError, match="model.thinking='sometimes'"):
    build_plan(cfg, "unused_output_dir")


@pytest.mark.parametrize("config_module", ["gsm8k", "humaneval", "custom", "suite"])
@pytest.mark.parametrize("native_int8", [True, False])
def test_fast_variant_sets_the_fastest_matmuls_here_and_bf16_kv(config_module, native_int8,
                                                                monkeypatch):
  import importlib
  from pallas_kernels import native

  # int8 only where the native kernel runs: the XLA int8 reference is 4-8x slower than f32.
  monkeypatch.setattr(native, "int8_matmul_available", lambda: native_int8)
  module = importlib.import_module(f"configs.{config_module}")
  exact = module.get_config("smoke=True")
  fast = module.get_config("smoke=True,fast=True")
  matmuls = "int8" if native_int8 else "float32"
  assert (exact.model.matmul_dtype, exact.engine.kv_dtype) == ("float32", "float32")
  assert (fast.model.matmul_dtype, fast.engine.kv_dtype) == (matmuls, "bfloat16")
  spec = PredictorSpec.from_config(fast.model, name="engine", batch_size=4, engine=fast.engine)
  assert model_fingerprint(spec).get("matmul_dtype") == (None if matmuls == "float32" else matmuls)
  assert model_fingerprint(spec)["kv_dtype"] == "bfloat16"
  with pytest.raises(ValueError, match="'fats=True'.*'fast'"):
    module.get_config("fats=True")


def test_engine_kv_dtype_reaches_the_controller_cache(tmp_path):
  from pipelines.beam import build_plan
  from pipelines.predictors import build_predictor

  write_hf_checkpoint(tmp_path, tiny_config(max_context=64), seed=1)
  cfg = gsm8k_config.get_config("policy=greedy_cot,smoke=True,fast=True")
  cfg.model.source = str(tmp_path)
  paged = build_predictor(build_plan(cfg, "unused_output_dir").predictor).controller.model
  assert paged.kv_dtype == "bfloat16"
  cfg.controller.cache = "contiguous"
  contiguous = build_predictor(build_plan(cfg, "unused_output_dir").predictor).controller.model
  assert contiguous.cache_dtype == jnp.bfloat16
  cfg.engine.kv_dtype = "float8_e4m3fn"
  with pytest.raises(ValueError, match="float8_e4m3fn needs cache='paged'"):
    build_predictor(build_plan(cfg, "unused_output_dir").predictor)


def test_tensor_parallel_enters_the_hash_and_needs_the_engine_or_the_controller():
  from pipelines.beam import build_plan
  cfg = gsm8k_config.get_config("smoke=True")
  cfg.engine.tensor_parallel = 2
  spec = PredictorSpec.from_config(cfg.model, name="engine", batch_size=4, engine=cfg.engine)
  assert model_fingerprint(spec)["tensor_parallel"] == 2
  assert engine_config(spec).tensor_parallel == 2
  cfg = gsm8k_config.get_config("policy=greedy_cot,smoke=True")
  cfg.engine.tensor_parallel = 2  # the controller's loop runs on the mesh too
  assert model_fingerprint(build_plan(cfg, "unused_output_dir").predictor)["tensor_parallel"] == 2
  cfg = gsm8k_config.get_config("policy=greedy,smoke=True")
  cfg.model.predictor = "generator"
  cfg.engine.tensor_parallel = 2
  with pytest.raises(ValueError, match="tensor_parallel=2 needs model.predictor=engine or a "
                                       "controller policy; this run uses 'generator'"):
    build_plan(cfg, "unused_output_dir")


def test_a_shared_engine_has_slots_for_every_batch_in_flight():
  """max_slots 0: the DirectRunner's workers that share the model each bring a batch, and
  each batch gets its slots (a second worker's batch decodes beside the first one instead
  of waiting for slots); one batch's slots where the model is not shared, Beam runs in
  memory, a cluster runner, replicas, or max_slots set. Not part of the content hash."""
  from pipelines.beam import build_plan
  slots = lambda cfg: engine_config(build_plan(cfg, "unused_output_dir").predictor).max_slots
  cfg = gsm8k_config.get_config("")
  assert (cfg.runner.batch_size, cfg.runner.direct_num_workers) == (8, 2)
  assert slots(cfg) == 16
  fp = model_fingerprint(build_plan(cfg, "unused_output_dir").predictor)
  cfg.runner.direct_num_workers = 3
  assert slots(cfg) == 24
  assert model_fingerprint(build_plan(cfg, "unused_output_dir").predictor) == fp
  for key, value in (("share_model", False), ("direct_running_mode", "in_memory"),
                     ("name", "DataflowRunner")):
    other = gsm8k_config.get_config("")
    other.runner[key] = value
    assert slots(other) == 8, key
  cfg.engine.data_parallel = 2  # replicas deal out one batch at a time
  assert slots(cfg) == 8
  cfg.engine.data_parallel, cfg.engine.max_slots = 1, 5
  assert slots(cfg) == 5


def test_data_parallel_reaches_the_engine_and_is_checked_at_plan_time():
  from pipelines.beam import build_plan
  cfg = gsm8k_config.get_config("smoke=True")
  cfg.engine.data_parallel = 2
  spec = build_plan(cfg, "unused_output_dir").predictor
  assert engine_config(spec).data_parallel == 2
  # Replicas compute each request as one engine does: the results are the same ones.
  cfg.engine.data_parallel = 1
  assert model_fingerprint(build_plan(cfg, "unused_output_dir").predictor) == model_fingerprint(spec)
  cfg.engine.data_parallel = 2
  cfg.budget.mode = "adaptive"
  with pytest.raises(ValueError, match="budget.mode=adaptive with engine.data_parallel > 1"):
    build_plan(cfg, "unused_output_dir")
  cfg = gsm8k_config.get_config("policy=greedy_cot,smoke=True")
  cfg.engine.data_parallel = 2
  with pytest.raises(ValueError, match="engine.data_parallel=2 needs model.predictor=engine; "
                                       "this run uses 'controller'"):
    build_plan(cfg, "unused_output_dir")


@pytest.mark.parametrize("predictor", ["engine", "generator"])
def test_plain_predictors_score_the_answer_and_keep_the_thinking(tiny_qwen3, predictor):
  # A reasoning model's sample through a plain predictor: `text` (what the task scores) is
  # the answer after the span, the thinking goes into the trace, tokens count both parts.
  from o1jax.controller import SamplingSpec
  from o1jax.engine import Engine, EngineConfig
  from o1jax.model import Generator, SamplingParams
  from pipelines.predictors import EnginePredictor, GeneratorPredictor, WorkItem

  llama, tok = tiny_qwen3
  if predictor == "engine":
    model = EnginePredictor(Engine(llama, tok, EngineConfig(max_slots=2, num_blocks=64)))
  else:
    model = GeneratorPredictor(Generator(llama, tok))
  prompt = "Q: 2+3?<think>\n"  # inside the span
  # Flat sampling (huge temperature): varied tokens from the tiny random model.
  item = WorkItem(key="k", example={}, example_index=0, sample_index=0, prompt=prompt, stop=(),
                  sampling=SamplingSpec(max_new_tokens=12, temperature=1e4), request_id=1)
  out = model.predict([item])[0]
  if predictor == "engine":
    direct = model.engine.generate([model_request(item)])[0].samples[0]
  else:
    direct = model.generator.generate([prompt], 12, SamplingParams(temperature=1e4),
                                      request_ids=[1])[0]
  assert direct.thinking_tokens > 0 and direct.thinking  # it thinks
  assert out["text"] == direct.text and out["trace"] == {"thinking": direct.thinking}
  assert out["tokens"] == {"prompt": len(tok.encode(prompt)), "completion": 12,
                           "thinking": direct.thinking_tokens,
                           "answer": 12 - direct.thinking_tokens}


def model_request(item):
  from o1jax.engine import GenerationParams, Request
  return Request(prompt=item.prompt, request_id=item.request_id, params=GenerationParams(
      temperature=item.sampling.temperature, max_new_tokens=item.sampling.max_new_tokens))


def test_engine_predictor_runs_concurrent_batches_in_one_engine(tiny_qwen3):
  # Two batches in flight (two worker processes calling the shared model): the second's
  # requests join the engine while the first's long sample runs, and every prediction is
  # the one that batch gets alone.
  import threading

  import numpy as np

  from o1jax.controller import SamplingSpec
  from o1jax.engine import Engine, EngineConfig
  from pipelines.predictors import EnginePredictor, WorkItem

  llama, tok = tiny_qwen3
  engine = Engine(llama, tok, EngineConfig(max_slots=4, num_blocks=64, decode_steps=2),
                  thinking="off")
  predictor = EnginePredictor(engine)

  def item(i, new_tokens):
    return WorkItem(key=str(i), example={}, example_index=i, sample_index=0, prompt=f"Q{i}: 1+{i}",
                    stop=(), sampling=SamplingSpec(max_new_tokens=new_tokens, temperature=1e4),
                    request_id=i)

  first, second = [item(0, 120), item(1, 2)], [item(2, 3), item(3, 3)]
  alone = [predictor.predict(first), predictor.predict(second)]
  rows = []
  decode = engine.decode
  engine.decode = lambda cache, batch, *a, **k: (rows.append(int(np.sum(batch.active))),
                                                 decode(cache, batch, *a, **k))[1]
  together = [None, None]
  started = threading.Event()

  def run(i, batch):
    if i == 1:
      started.wait()  # the first batch is running when the second arrives
    together[i] = predictor.predict(batch)

  threads = [threading.Thread(target=run, args=(i, b)) for i, b in enumerate((first, second))]
  threads[0].start()
  while not rows:  # the first batch's decoding has begun
    threading.Event().wait(0.01)
  started.set()
  threads[1].start()
  for t in threads:
    t.join()
  strip = lambda preds: [(p["text"], p["tokens"], p["finish_reason"]) for p in preds]
  assert [strip(p) for p in together] == [strip(p) for p in alone]
  assert max(rows) >= 3  # a decode step ran rows of both batches


def test_engine_policy_reaches_the_controller_admission_and_is_checked_at_plan_time(tmp_path):
  """engine.policy orders the engine's scheduler and a controller policy's admission
  (fifo | shortest_budget); what either cannot run is refused before work starts. An
  example's metadata max_steps becomes its request's own step limit."""
  from pipelines.beam import build_plan
  from pipelines.predictors import ControllerPredictor, WorkItem, build_predictor

  write_hf_checkpoint(tmp_path, tiny_config(max_context=64), seed=1)
  cfg = gsm8k_config.get_config("policy=greedy_cot,smoke=True")
  cfg.model.source = str(tmp_path)
  assert build_predictor(build_plan(cfg, "unused").predictor).controller.admission == "fifo"
  cfg.engine.policy = "shortest_budget"
  predictor = build_predictor(build_plan(cfg, "unused").predictor)
  assert predictor.controller.admission == "shortest_budget"
  cfg.engine.policy = "length_groups"  # the engine's, not the controller's
  with pytest.raises(ValueError, match="engine.policy='length_groups': a controller policy"):
    build_plan(cfg, "unused")
  plain = gsm8k_config.get_config("smoke=True")
  plain.engine.policy = "length_groups"
  build_plan(plain, "unused")
  plain.engine.policy = "sjf"
  with pytest.raises(ValueError, match="engine.policy='sjf': the engine scheduler takes"):
    build_plan(plain, "unused")

  seen = []

  class Recorder:
    budget = None

    def run(self, requests, policy):
      seen.extend(requests)
      raise RuntimeError("recorded")

  def item(i, metadata, stop=()):
    return WorkItem(key=str(i), example={"id": f"ex{i}", "metadata": metadata}, example_index=i,
                    sample_index=0, prompt="Q", stop=stop, sampling=SamplingSpec(), request_id=i)

  recorder = ControllerPredictor(Recorder(), {"name": "greedy_cot"})
  with pytest.raises(RuntimeError, match="recorded"):
    recorder.predict([item(0, {"max_steps": 3}), item(1, {})])
  assert [r.max_steps for r in seen] == [3, None]
  # A vote's chosen trace is one the task reads as the vote, cut at the items' stops as
  # the score cuts it (uncut, a few-shot trace's next "Q: ..." numbers were read).
  with pytest.raises(RuntimeError, match="recorded"):
    recorder.predict([item(0, {}, stop=("\n\nQ:",)), item(1, {}, stop=("\n\nQ:",))])
  reads = recorder.controller.reads_as
  assert reads("The answer is 7.\n\nQ: Tom has 12 apples.", "7")
  assert not reads("The answer is 7. Tom has 12 apples.", "7")
  with pytest.raises(ValueError, match="example 'ex1': metadata max_steps='many' is not an int"):
    recorder.predict([item(0, {}), item(1, {"max_steps": "many"})])


def test_a_failed_engine_step_takes_only_its_batch_out_of_the_shared_engine(tiny_qwen3):
  """A step that raises fails the batch that drove it (Beam sends it to dead letters); its
  requests leave the engine, so the next batch runs on free slots and gets what it gets alone."""
  from o1jax.controller import SamplingSpec
  from o1jax.engine import Engine, EngineConfig
  from pipelines.predictors import EnginePredictor, WorkItem

  llama, tok = tiny_qwen3
  engine = Engine(llama, tok, EngineConfig(max_slots=4, num_blocks=64, decode_steps=2),
                  thinking="off")
  predictor = EnginePredictor(engine)
  batch = [WorkItem(key=str(i), example={}, example_index=i, sample_index=0, prompt=f"Q{i}",
                    stop=(), sampling=SamplingSpec(max_new_tokens=6, temperature=1e4),
                    request_id=i) for i in range(3)]
  alone = predictor.predict(batch[1:])
  step, calls = engine.step, []

  def failing_step():
    calls.append(1)
    if len(calls) == 3:
      raise RuntimeError("device lost")
    step()

  engine.step = failing_step
  with pytest.raises(RuntimeError, match="device lost"):
    predictor.predict(batch[:2])
  assert not engine.has_work() and not engine._groups and engine.allocator.num_used == 0
  engine.step = step
  assert [p["text"] for p in predictor.predict(batch[1:])] == [p["text"] for p in alone]


def test_the_engine_pool_holds_every_slot_s_longest_sequence_of_the_job(tmp_path):
  """The launcher passes the job's longest prompts and largest max_new_tokens; the worker's
  engine sizes its KV pool for max_slots such sequences (64 MiB held 91 blocks: 16 slots of
  256-token answers were preempted 150 times and took twice as long). A fixed num_blocks
  stays as it is."""
  import dataclasses
  from pipelines.beam import build_plan
  from pipelines.beam.pipeline import plan_items, sized_for
  from o1jax.model.shapes import three_quarter_bucket
  from pipelines.predictors import EnginePredictor
  write_hf_checkpoint(tmp_path, tiny_config(max_context=1024), seed=1)
  (tmp_path / "q.jsonl").write_text(
      '{"question": "1+1?", "answer": "2"}\n{"question": "' + "long " * 40 + '?", "answer": "3"}\n')
  cfg = custom_config.get_config("smoke=True")
  cfg.model.update(source=str(tmp_path), predictor="engine")
  cfg.dataset.path = str(tmp_path / "q.jsonl")
  cfg.sampling.max_new_tokens = 100
  cfg.engine.kv_cache_bytes = 1 << 14  # a few blocks of the tiny model
  cfg.runner.update(batch_size=3, direct_num_workers=1, direct_running_mode="in_memory")
  plan = build_plan(cfg, str(tmp_path / "out"))
  items, _ = plan_items(plan)
  sized = sized_for(plan, items).predictor
  assert sized.max_new_tokens == 100 and len(sized.longest_prompts) == 2
  assert "long long" in sized.longest_prompts[0]  # the longest first
  engine = EnginePredictor.load(sized).engine
  longest = max(len(engine.encode_prompt(i.prompt)) for i in items)
  assert engine.num_blocks == three_quarter_bucket(3 * -(-(longest + 100) // 16))  # 3 slots
  cfg.sampling.max_new_tokens = 2000  # beyond the context: the context bounds a sequence
  long_plan = build_plan(cfg, str(tmp_path / "out"))
  capped = sized_for(long_plan, plan_items(long_plan)[0]).predictor
  assert EnginePredictor.load(capped).engine.num_blocks == three_quarter_bucket(3 * 1024 // 16)
  small = EnginePredictor.load(plan.predictor).engine  # not sized: kv_cache_bytes alone
  assert small.num_blocks < engine.num_blocks
  fixed = dataclasses.replace(sized, engine=tuple(dict(sized.engine, num_blocks=7).items()))
  assert EnginePredictor.load(fixed).engine.num_blocks == 7


def test_the_fingerprint_changes_with_any_weight_byte_and_only_with_the_content(tmp_path):
  """Before: a file was named by its size and first MiB (a GGUF's metadata: weights edited
  in place kept the keys, and the old model's stored samples were resumed as the new
  one's); a directory by its top-level file sizes."""
  import shutil
  gguf = tmp_path / "a" / "model.gguf"
  gguf.parent.mkdir()
  gguf.write_bytes(bytes(3 << 20))
  fp = lambda path: model_fingerprint(PredictorSpec(name="engine", source=str(path)))
  before = fp(gguf)
  with open(gguf, "r+b") as f:  # one byte deep in the tensor data, same size, same path
    f.seek(2 << 20)
    f.write(b"\x01")
  after = fp(gguf)
  assert after != before and after["bytes"] == before["bytes"] and after["file"] == "model.gguf"
  (tmp_path / "b").mkdir()
  shutil.copy(gguf, tmp_path / "b" / "model.gguf")  # the same bytes elsewhere: the same model
  assert fp(tmp_path / "b" / "model.gguf") == after | {"source": str(tmp_path / "b" / "model.gguf")}
  ckpt = tmp_path / "hf"
  write_hf_checkpoint(ckpt, tiny_config(), seed=1)
  (ckpt / "original").mkdir()  # what the HF loader does not read: not hashed
  (ckpt / "original" / "consolidated.bin").write_bytes(b"x")
  first = fp(ckpt)
  (ckpt / "original" / "consolidated.bin").write_bytes(b"y")
  assert fp(ckpt) == first
  weights = next(ckpt.glob("*.safetensors"))
  data = bytearray(weights.read_bytes())
  data[-1] ^= 1  # the last weight byte, same size
  weights.write_bytes(bytes(data))
  assert fp(ckpt) != first
  orbax = tmp_path / "orbax"  # an orbax checkpoint's arrays live in subdirectories
  from o1jax.checkpoint import load_checkpoint
  from o1jax.checkpoint.orbax_io import save_orbax
  loaded = load_checkpoint(str(ckpt))
  save_orbax(orbax, loaded.config, loaded.params, loaded.tokenizer)
  nested = sorted(p for p in orbax.rglob("*") if p.is_file() and p.parent != orbax)
  before = fp(orbax)
  with open(nested[-1], "ab") as f:
    f.write(b"\0")
  assert nested and fp(orbax) != before
  assert "sha256" not in fp(tmp_path / "a")  # a directory that is no checkpoint: not walked


def test_new_bytes_under_a_restored_mtime_are_hashed_again(tmp_path, monkeypatch):
  """`cp -p`, `rsync -t` and archives restore an mtime over new bytes (the red-team's find:
  a digest kept by path, size, mtime and inode was the old weights'): ctime is in the key."""
  import os
  import time
  from pipelines import predictors
  monkeypatch.setenv("HOME", str(tmp_path / "home"))  # a digest cache of its own
  monkeypatch.setattr(predictors, "_digests", None)
  path = tmp_path / "model.bin"
  path.write_bytes(b"A" * 1000)
  os.utime(path, ns=(1_600_000_000_000_000_000,) * 2)
  time.sleep(2.1)  # older than the 2 s a digest must be to be kept
  before = predictors.content_digest(str(path))
  assert predictors._digest_cache()  # kept
  stat = os.stat(path)
  path.write_bytes(b"C" * 1000)
  os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
  assert os.stat(path).st_mtime_ns == stat.st_mtime_ns and os.stat(path).st_size == stat.st_size
  assert predictors.content_digest(str(path)) != before


def test_the_fingerprint_holds_only_the_numerics_the_predictor_reads():
  # Before: the generator's keys and summary took engine.kv_dtype=bfloat16 (its cache stays
  # f32: the same outputs computed again, and a summary saying bf16), the fake model's
  # matmul_dtype and kv_dtype likewise.
  cfg = gsm8k_config.get_config("smoke=True")
  cfg.engine.kv_dtype = "bfloat16"
  cfg.model.matmul_dtype = "bfloat16"
  spec = lambda name: PredictorSpec.from_config(cfg.model, name=name, batch_size=4, engine=cfg.engine)
  assert model_fingerprint(spec("generator"))["matmul_dtype"] == "bfloat16"
  assert "kv_dtype" not in model_fingerprint(spec("generator"))
  assert {"kv_dtype", "matmul_dtype"}.isdisjoint(model_fingerprint(spec("fake")))
  for name in ("engine", "controller"):
    assert model_fingerprint(spec(name))["kv_dtype"] == "bfloat16"


def test_a_speculative_section_enabled_by_a_str_is_named():
  # "false" turned speculation on (a str is truthy), changing keys where it is hashed.
  from pipelines.predictors import speculative_config
  with pytest.raises(ValueError, match=r"^speculative.enabled must be a bool, got 'false'$"):
    speculative_config({"enabled": "false"})
  assert speculative_config({"enabled": False}) is None
  assert speculative_config({"enabled": True, "max_drafts": 3}).max_drafts == 3
