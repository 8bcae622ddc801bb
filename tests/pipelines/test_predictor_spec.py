"""PredictorSpec: the model section's matmul_dtype, the engine section's kv_dtype and the
controller section's cache reach the model / engine / controller and the content hash."""

import jax.numpy as jnp
import pytest

from configs import gsm8k as gsm8k_config
from o1jax.testing import tiny_config, write_hf_checkpoint
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


def test_kv_dtype_flows_from_config_to_engine_and_fingerprint():
  cfg = gsm8k_config.get_config("smoke=True")
  default = PredictorSpec.from_config(cfg.model, name="engine", batch_size=4, engine=cfg.engine)
  assert engine_config(default).kv_dtype == "float32"
  assert "kv_dtype" not in model_fingerprint(default)  # f32 hashes stay as before
  cfg.engine.kv_dtype = "bfloat16"
  narrow = PredictorSpec.from_config(cfg.model, name="engine", batch_size=4, engine=cfg.engine)
  assert engine_config(narrow).kv_dtype == "bfloat16"
  assert model_fingerprint(narrow)["kv_dtype"] == "bfloat16"


def test_controller_cache_flows_from_config_to_the_decode_model_and_fingerprint(tmp_path):
  from pipelines.beam import build_plan
  from pipelines.predictors import build_predictor

  write_hf_checkpoint(tmp_path, tiny_config(max_context=64), seed=1)
  cfg = gsm8k_config.get_config("policy=greedy_cot,smoke=True")
  cfg.model.source = str(tmp_path)
  paged = build_plan(cfg, "unused_output_dir").predictor
  assert dict(paged.controller) == {"cache": "paged", "block_size": 16, "num_blocks": 0,
                                    "kv_dtype": "float32",  # the engine section's, read once
                                    "thinking": "auto"}
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


def test_controller_thinking_flows_from_config_to_the_controller_and_fingerprint(tmp_path):
  from pipelines.beam import build_plan
  from pipelines.predictors import build_predictor

  write_hf_checkpoint(tmp_path, tiny_config(max_context=64), seed=1)
  cfg = gsm8k_config.get_config("policy=greedy_cot,smoke=True")
  cfg.model.source = str(tmp_path)
  auto = build_plan(cfg, "unused_output_dir").predictor
  assert build_predictor(auto).controller.thinking is None  # a ChatML template names none
  assert "thinking" not in model_fingerprint(auto)  # auto follows the checkpoint: old hashes
  cfg.controller.thinking = "<think> </think>"
  spec = build_plan(cfg, "unused_output_dir").predictor
  assert build_predictor(spec).controller.thinking.close == "</think>"
  assert model_fingerprint(spec)["thinking"] == "<think> </think>"
  cfg.controller.thinking = "sometimes"  # refused before any worker starts
  with pytest.raises(ValueError, match="controller.thinking='sometimes'"):
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
