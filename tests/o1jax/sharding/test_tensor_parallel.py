"""Tensor parallelism on 8 forced CPU devices (in a process of its own, tp_run.py): the
sharded engine gives the one-device engine's tokens, greedy and sampled, with f32 and
bf16 KV pools; the compiled decode step all-reduces twice per layer and gathers nothing,
also with 4-bit matrices and with the Pallas kernels (interpreted) on each device's part;
the controller's loop on a mesh gives the one-device traces (paged and contiguous caches,
shared prompt blocks, backtracking); a model that does not split evenly is refused in one
line."""

import json
import pathlib
import subprocess
import sys

import pytest

from o1jax.engine import EngineConfig


@pytest.fixture(scope="module")
def run():
  script = pathlib.Path(__file__).with_name("tp_run.py")
  root = pathlib.Path(__file__).parents[3]
  command = [sys.executable, str(script)]
  if "pretend_gpu_kind" in sys.modules:  # (scripts/device_jax_lowering.sh: the child too)
    command[1:] = ["-c", f"import pretend_gpu_kind, runpy; runpy.run_path({str(script)!r}, "
                         f"run_name='__main__')"]
  done = subprocess.run(command, capture_output=True, text=True, cwd=root, timeout=1200)
  assert done.returncode == 0, done.stderr[-3000:]
  return json.loads(done.stdout)


@pytest.mark.parametrize("case", ["tp2_kv2_float32", "tp4_kv4_float32", "tp2_kv2_bfloat16",
                                  "tp2_kv2_float8_e4m3fn"])
def test_sharded_engine_gives_the_one_device_tokens(run, case):
  r = run[case]
  assert r["same_tokens"]
  assert r["max_logit_diff"] < 1e-4
  assert (r["wq_spec"], r["wo_spec"], r["pool_spec"]) == (
      "P(None, 'model')", "P('model', None)", "P(None, None, 'model')")
  # FP8 pools' scales ([num_blocks, block_size, kv_heads]) split with their heads.
  assert r["scale_spec"] == ("P(None, None, 'model')" if "float8" in case else None)
  # The pools keep their sharding: the mesh adds no re-trace to the one-device programs.
  assert r["traces"] == r["one_device_traces"] and r["traces"]["decode"] >= 1


@pytest.mark.parametrize("case", ["tp2_kv2_float32", "tp4_kv4_float32", "tp2_kv2_bfloat16",
                                  "tp2_kv2_float8_e4m3fn"])
def test_decode_step_all_reduces_twice_per_layer_and_gathers_nothing(run, case):
  r = run[case]
  assert r["collectives"] == {"all-reduce": 2 * r["layers"], "all-gather": 0, "all-to-all": 0,
                              "collective-permute": 0}


def test_fp8_activations_on_a_mesh_give_the_one_device_tokens(run):
  # Each layer all-reduces the two row-split products as in f32, plus the largest
  # magnitude of the row-split inputs (wo's and w_down's), whose FP8 scale is the row's.
  r = run["fp8_tp2"]
  assert r["same_tokens"]
  assert r["collectives"] == {"all-reduce": 4 * r["layers"], "all-gather": 0, "all-to-all": 0,
                              "collective-permute": 0}


@pytest.mark.parametrize("case", ["paged_bfloat16", "contiguous_float32"])
def test_controller_on_a_mesh_gives_the_one_device_traces(run, case):
  # Sampled traces sharing each prompt's blocks, with backtracking, and greedy ones: the
  # same tokens and decisions as on one device, with the cache split by KV heads.
  r = run["controller"][case]
  assert r["same_sampled"] and r["same_actions"] and r["same_greedy"]
  assert r["backtracks"] > 0 and r["tokens"] > 0  # the loop really backtracked
  assert r["cache_spec"] == ("P(None, None, 'model', None)" if case.startswith("paged")
                             else "P(None, 'model', None, None)")


@pytest.mark.parametrize("case", ["dp2_tp1", "dp2_tp2"])
def test_engine_replicas_give_the_one_engine_tokens_each_on_its_own_devices(run, case):
  r = run["replicas"][case]
  assert r["same_tokens"]
  tp = int(case[-1])
  assert [len(d) for d in r["devices"]] == [tp, tp]
  assert not set(r["devices"][0]) & set(r["devices"][1])  # disjoint device groups
  assert r["requests_per_replica"] == [8, 8]  # 16 requests dealt out in turn


def test_build_engine_places_one_engine_on_the_devices_given(run):
  r = run["replicas"]["build_engine_tp2_devices"]
  assert r["same_tokens"]
  assert len(r["devices"]) == 2 and set(r["devices"]) <= {4, 5, 6, 7}


def test_sampling_on_vocabulary_split_logits_gives_the_one_device_tokens(run):
  """Every path of `sample` (candidates, the whole-row search, top-k, unfiltered, greedy)
  on logits split over the mesh's model axis."""
  assert run["sampling"]["same_tokens"], run["sampling"]


def test_uneven_split_is_one_line(run):
  assert run["tp4_kv2_error"] == ("tensor parallelism 4: the model's n_kv_heads=2 is not a "
                                  "multiple of it")


def test_fused_quantized_matrices_split_back_into_heads_on_a_mesh(run):
  r = run["quantized"]
  assert r["fused_on_one_device"] == [True, True] and r["split_on_the_mesh"] == [True, True]
  assert r["wk_spec"] == "P(None, 'model')" and r["max_logit_diff"] < 1e-4


@pytest.mark.parametrize("case", ["Q4_1_reference_bfloat16_float32",
                                  "Q4_0_pallas_float32_float8",
                                  "Q4_1_pallas_float8_e4m3fn_float32"])
def test_4bit_matrices_and_the_kernels_run_on_each_devices_part(run, case):
  # Before: XLA moved codes between devices (6 all-to-alls a layer: a row split of codes
  # packed over the whole K) and gathered every operand of a Pallas call to each device
  # (9-13 all-gathers a layer: the matrices and the KV pools; 1 all-reduce).
  r = run["kernels"][case]
  assert r["same_tokens"]
  # FP8 inputs also all-reduce the largest magnitude of the two row-split inputs (a row's
  # scale is over the whole row), as on XLA's path (test_fp8_activations_on_a_mesh...).
  per_layer = 4 if case.endswith("float8") else 2
  assert r["collectives"] == {"all-reduce": per_layer * r["layers"], "all-gather": 0,
                              "all-to-all": 0, "collective-permute": 0}
  assert r["wo_split"] == ["rows", 2] and r["wo_spec"] == "P('model', None)"


@pytest.mark.parametrize("program", ["decode", "prefill"])
def test_the_kernels_lower_for_cuda_on_each_devices_part(run, program):
  # As a GPU runs them (compiled Pallas kernels), every Triton call in its own per-device
  # region; before, none was in one (XLA gathered their operands).
  r = run["kernels"]["cuda_lowering"][program]
  assert r["triton"] > 0 and r["per_device"] == r["triton"]


def test_settings_that_cannot_split_are_named_before_any_program(run):
  r = run["errors"]
  assert r["draft"] == ("speculative draft model: tensor parallelism 2: the model's "
                        "n_kv_heads=1 is not a multiple of it")
  assert r["draft_left"] == [None, None]  # (the engine kept a drafter without its model)
  assert r["config_vs_mesh"] == ("tensor_parallel=4 but the given mesh's model axis has 2 "
                                 "devices (give one of the two)")
  assert r["int8_unfused"].endswith(": int8 matmul tiles (matmul_dtype='int8') cannot be "
                                    "split by heads; use float32 or bfloat16 matmuls with a mesh")
  assert r["group_of_3"] == 3  # (refused: "model=3 does not divide the 8 devices")
  assert r["data_axis"] == r["controller_data_axis"] == (
      "mesh has data=2: one model runs over the mesh's 'model' axis, and every other axis' "
      "devices would hold a copy of it doing the same work; give one group (group_mesh(tp)), "
      "or data_parallel=N for replicas (build_engine)")
  assert r["device_twice"] == ("mesh lists device cpu:0 twice: each shard needs a device "
                               "of its own")
  assert r["not_a_mesh"] == "mesh must be a jax.sharding.Mesh with a 'model' axis, got str"
  assert r["make_mesh_twice"] == ("devices lists cpu:0 twice: each shard needs a device of "
                                  "its own")
  assert r["replicas_and_mesh"] == "data_parallel=2 places a mesh per replica: give devices=, not mesh="
  assert r["kernel_part"] == (
      "layers.0.wo: tensor parallelism 2: a device's part (32, 64) does not suit the Pallas "
      "kernel (4-bit K=32: K//2=16 must be a multiple of group_size=32 (a group may not "
      "straddle the two nibble halves)); use backend 'auto' (XLA's product there) or fewer "
      "devices")


def test_config_checks_the_group_size():
  with pytest.raises(ValueError, match="tensor_parallel must be an int >= 1, got 0"):
    EngineConfig(tensor_parallel=0)
