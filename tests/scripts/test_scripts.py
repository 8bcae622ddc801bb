"""Scripts at toy sizes on CPU: the GPU check scripts (the GPU run is scripts/gpu_check.sh),
the DeepConf threshold calibration, the sampling benchmark and bench_policies' statistics."""

import importlib.util
import json
import os
import re
import pathlib
import subprocess
import sys

import numpy as np
import pytest

SCRIPTS = pathlib.Path(__file__).resolve().parents[2] / "scripts"


def load(name):
  spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_bench_kernels_copies_exceed_the_l2_and_targets_read_the_rows():
  bk = load("bench_kernels")
  assert bk.copies_for(30 * 2 ** 20, 16) == 6  # 6 x 30 MiB >= 3 x 60 MiB
  assert bk.copies_for(2 ** 30, 16) == 1
  assert bk.copies_for(1000, 16) == 16  # never more copies than calls
  rows = [dict(name="qmm q4_0 g32 M=1 4096x14336", speedup_vs_dense=3.1, hbm_frac=0.72),
          dict(name="qmm q4_0 g32 M=8 4096x14336", speedup_vs_dense=2.9),
          dict(name="qmm q4_1 g32 M=64 14336x4096", speedup_vs_dense=1.05),
          dict(name="qmm q4_1 g32 M=1 4096x14336", speedup_vs_dense=2.5, hbm_frac=0.6),
          dict(name="qmm q8_0 g32 M=1 4096x14336", speedup_vs_dense=1.9),  # (not 4-bit)
          dict(name="decode llama3-8b B=64 ctx=4096", hbm_frac=0.71),
          dict(name="prefill", error="boom")]
  got = {t["target"]: t["met"] for t in bk.check_targets(rows)}
  assert got == {"qmm q4_0 M=1 4096x14336 >= 3x bf16 jnp.dot": True,
                 "qmm q4_0 M=8 4096x14336 >= 3x bf16 jnp.dot": False,
                 "qmm q4_0 M=1 4096x14336 >= 70% of HBM peak": True,
                 "qmm q4_1 M=1 4096x14336 >= 3x bf16 jnp.dot": False,
                 "qmm q4_1 M=64 14336x4096 >= 1x bf16 jnp.dot": True,
                 "qmm q4_1 M=1 4096x14336 >= 70% of HBM peak": False,
                 "paged decode B=64 ctx=4096 >= 70% of HBM peak": True}
  # Dispatch: the kernel until its first loss to XLA's dequantize + dot on any shape.
  xla = lambda m, shape, ratio: dict(name=f"qmm q4_0 g32 M={m} {shape}", speedup_vs_dense=1.0,
                                     speedup_vs_xla_dequant=ratio)
  rule = lambda rows: [t for t in bk.check_targets(rows) if "dequantize" in t["target"]][0]
  rows = [xla(1, "4096x14336", 2.0), xla(8, "4096x14336", 1.5), xla(8, "576x1536", 1.1),
          xla(64, "4096x14336", 1.2), xla(64, "576x1536", 0.8), xla(256, "4096x14336", 0.3)]
  assert (rule(rows)["pallas_max_rows"], rule(rows)["met"]) == (8, False)
  assert rule(rows[:3])["pallas_max_rows"] is None and rule(rows[:3])["met"]
  assert rule([xla(1, "4096x14336", 0.9)] + rows[1:])["pallas_max_rows"] == 0


def test_triton_structure_counts_the_pass_before_pipelining_and_the_final_code():
  """scripts/triton_structure.py's counts (its compiles need the CUDA plugin; the parsing
  is checked here on a dump of the same form): conversions from the IR before
  TritonGPUPipeline only (big: >= 1024 values), barriers / loads / async copies from the
  last pass's code."""
  ts = load("triton_structure")
  mark = ts.DUMP_MARK
  convert = ('%9 = "ttg.convert_layout"(%8) : (tensor<{}xf32, #blocked>) -> '
             'tensor<{}xf32, #blocked1>\n')
  loop_result = ('%7 = "ttg.convert_layout"(%50#0) : (tensor<1x2048xf8E4M3FN, #blocked>) -> '
                 'tensor<1x2048xf8E4M3FN, #blocked1>\n')
  dump = (f"{mark}TritonGPUCoalesce\n" + convert.format("32x128", "32x128") * 5 +
          f"{mark}TritonGPUPipeline\n" + convert.format("32x128", "32x128") * 2 +
          convert.format("512", "512") + convert.format("1x1024", "1x1024") + loop_result +
          f"{mark}ConvertTritonGPUToLLVM\n" + '"nvvm.barrier"() cp.async.ca.shared.global\n' +
          f"{mark}StripDebugInfo\n" + '"nvvm.barrier"() "nvvm.barrier"() ld.global.v4.b32 '
          "ld.global.v4.b32 ld.global.b16 cp.async.cg.shared.global cp.async.commit_group "
          "cp.async.wait_group cp.async.bulk.tensor.2d\n")
  assert ts.structure(dump) == dict(conversions=5, big_conversions=4, barriers=2,
                                    global_loads={"ld.global.b16": 1, "ld.global.v4.b32": 2},
                                    async_copies=2)
  with pytest.raises(RuntimeError, match="no TritonGPUPipeline"):
    ts.structure(f"{mark}StripDebugInfo\n")
  # The guard of scripts/device_jax_lowering.sh: rows past the limit (an error row has none).
  rows = [dict(case="a", big_conversions=0), dict(case="b", big_conversions=4),
          dict(case="c", error="RuntimeError: ...")]
  assert [r["case"] for r in ts.over_limit(rows, 0)] == ["b"]
  assert ts.over_limit(rows, 4) == [] and ts.over_limit(rows, None) == []


def test_cuda_compile_check_cases_lower_for_cuda_to_their_kernels():
  """The deviceless compile check's cases (run with the CUDA plugin, CUDA_COMPILE=1
  scripts/device_jax_lowering.sh) stay in step with the kernels' signatures: one case of
  each kind lowers for CUDA here, from shapes alone, to the Pallas kernel it names."""
  import jax
  cc = load("cuda_compile_check")
  spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, jax.numpy.dtype(dtype))
  cases = [*cc.qmm_cases(quick=True), *cc.attention_cases(quick=True)]
  labels = {label for label, _ in cases}
  assert len(labels) == len(cases) == 64  # every case named once
  want = {"qmm q4_1 gemv M=1 4096x14336 x=float8_e4m3fn": ["quantized_gemv_q4_g32"],
          "qmm q4_0 dot M=64 576x192 x=bfloat16": ["quantized_matmul_q4_g32"],
          "decode smollm2-135m B=64 ctx=4096 kv=float8_e4m3fn window=512":
              ["paged_decode_attention"],
          "prefill smollm2-135m B=1 T=512 start=2048 kv=bfloat16": ["paged_prefill_attention"]}
  for label, case in cases:
    if label in want:
      fn, args = cc.program(case, spec)
      lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
      assert cc.triton_kernels(lowered) == want.pop(label), label
  assert not want


def test_cuda_program_report_counts_kernels_and_fusions_by_kind():
  """The kernels-per-step report (run with the CUDA plugin) reads an optimized HLO module:
  Triton kernels by their custom-call target, XLA fusions by the computation they call."""
  import types
  report = load("cuda_program_report")
  hlo = "\n".join([
      '  %a = f32[16,576]{1,0} fusion(%x), kind=kLoop, calls=%fused_pad.149, metadata={}',
      '  %b = f32[16,576]{1,0} fusion(%x, %y), kind=kInput, calls=%fused_reduce.3',
      '  %c = f32[1,576]{1,0} fusion(%x), kind=kLoop, calls=%fused_pad',
      '  %d = (f32[1,576]) custom-call(%a), custom_call_target="__gpu$xla.gpu.triton", name="q"',
      '  %e = (s32[]) while(%t), condition=%cond, body=%body',
      '  %f = f32[4]{0} copy(%g)',
      '  %h = f32[4]{0} all-reduce(%f), replica_groups={{0,1}}, to_apply=%sum',
      '  %i = f32[4]{0} all-reduce-start(%h), replica_groups={{0,1}}, to_apply=%sum',
      '  %j = f32[8]{0} all-gather-done(%k)'])
  stats = types.SimpleNamespace(argument_size_in_bytes=2 * 2**20, alias_size_in_bytes=2**20,
                                temp_size_in_bytes=0)
  executable = types.SimpleNamespace(
      hlo_modules=lambda: [types.SimpleNamespace(to_string=lambda: hlo)],
      get_compiled_memory_stats=lambda: stats)
  row = report.program_row("decode", executable, 1.234)
  assert row == dict(program="decode", compile_s=1.2, triton_kernels=1, xla_fusions=3,
                     fusions_by_kind={"pad": 2, "reduce": 1}, while_loops=1, copies=1,
                     argument_mib=2.0, aliased_mib=1.0, temp_mib=0.0,
                     # (an async collective once, by its -start)
                     collectives={"all-reduce": 2, "all-gather": 0, "all-to-all": 0,
                                  "collective-permute": 0, "reduce-scatter": 0})


def test_gpu_engine_check_ablation_variants_trace_their_own_programs():
  # Engines of an equal model share compiled programs: the ablation's op swaps were never
  # traced, and its four rows timed one program (2026-12-06 review).
  from o1jax.engine import GenerationParams, Request
  from o1jax.engine import engine as engine_module
  check = load("gpu_engine_check")
  config, params = check.random_model_params(1, max_context=128)
  for _ in range(2):
    check.fresh_programs()
    assert not engine_module._PROGRAMS
    engine = check.make_engine(config, params, "reference", max_slots=2, num_blocks=64)
    engine.generate([Request([5, 6, 7], GenerationParams(max_new_tokens=2, ignore_eos=True))])
    assert sum(engine.trace_counts.values()) >= 2  # (prefill and decode, traced again)


def test_bench_kernels_quick_run_writes_rows(tmp_path):
  bk = load("bench_kernels")
  out = tmp_path / "bench.json"
  assert bk.main(["--quick", "--only", "decode", "--iters", "1", "--out", str(out)]) == 0
  rows = json.loads(out.read_text())["rows"]
  assert [r["name"] for r in rows] == ["decode smollm2-135m B=2 ctx=256"]
  assert rows[0]["ms"] > 0 and rows[0]["dense_ms"] > 0


def test_bench_kernels_writes_each_row_and_goes_on_past_a_failing_shape(tmp_path, monkeypatch):
  # One exception ended the rest of a kernel's shapes, and the JSON was written only at
  # the end: a stage cut by its time limit kept nothing.
  bk = load("bench_kernels")
  real = bk.random_weight

  def random_weight(key, k, n, fmt, group=None):
    if (k, n) == (576, 192):
      raise RuntimeError("out of resources")
    return real(key, k, n, fmt, group)

  monkeypatch.setattr(bk, "random_weight", random_weight)
  out = tmp_path / "bench.json"
  written = []
  real_dump = bk.json.dump
  monkeypatch.setattr(bk.json, "dump", lambda obj, f, **kw: (written.append(len(obj["rows"])),
                                                              real_dump(obj, f, **kw)))
  assert bk.main(["--quick", "--only", "qmm", "--iters", "1", "--formats", "q4_0",
                  "--out", str(out)]) == 1
  rows = json.loads(out.read_text())["rows"]
  assert [r["name"] for r in rows] == [
      "qmm q4_0 g32 M=1 576x576", "qmm q4_0 g32 M=8 576x576", "qmm q4_0 576x192",
      "qmm q4_0 g32 M=1 576x1536", "qmm q4_0 g32 M=8 576x1536"]
  assert rows[2]["error"] == "RuntimeError: out of resources"
  assert written == [1, 2, 3, 4, 5, 5]  # each row (the error too) as measured, then the end


def test_bench_kernels_weight_formats(tmp_path, capsys):
  """The first format on every shape, the others on one (the Llama-3-8B FFN shapes on a
  full run); each format's weight holds that format's storage; an unknown one is refused."""
  bk = load("bench_kernels")
  out = tmp_path / "bench.json"
  assert bk.main(["--quick", "--only", "qmm", "--iters", "1", "--formats", "q4_1,q8_0",
                  "--out", str(out)]) == 0
  names = [r["name"] for r in json.loads(out.read_text())["rows"]]
  assert names == ["qmm q4_1 g32 M=1 576x576", "qmm q4_1 g32 M=8 576x576",
                   "qmm q4_1 g32 M=1 576x192", "qmm q4_1 g32 M=8 576x192",
                   "qmm q4_1 g32 M=1 576x1536", "qmm q4_1 g32 M=8 576x1536",
                   "qmm q8_0 g32 M=1 576x576", "qmm q8_0 g32 M=8 576x576"]
  import jax

  key = jax.random.PRNGKey(0)
  q41, q80, q6k = (bk.random_weight(key, 256, 64, f) for f in ("q4_1", "q8_0", "q6_k"))
  assert (q41.bits, q41.packed.shape, q41.minimum.shape) == (4, (128, 64), (8, 64))
  # Q4_1's minimum is -8 x scale: the values of Q4_0 codes, (q - 8) x scale.
  np.testing.assert_array_equal(np.asarray(q41.minimum, np.float32),
                                np.asarray(-8 * q41.scale.astype(np.float32), np.float32))
  assert (q80.bits, q80.packed.dtype, q80.minimum) == (8, np.int8, None)
  assert (q6k.group_size, q6k.scale.dtype) == (16, np.float32)
  with pytest.raises(ValueError, match="K=96 is not a multiple of q6_k's block 256"):
    bk.random_weight(key, 96, 64, "q6_k")
  with pytest.raises(SystemExit):
    bk.main(["--quick", "--formats", "q4_0,q5_9"])
  assert "unknown format 'q5_9'" in capsys.readouterr().err


@pytest.mark.slow
def test_gpu_engine_check_correctness_in_interpret_mode(tmp_path):
  """The Pallas kernels in interpret mode against the reference, through the engine."""
  check = load("gpu_engine_check")
  out = tmp_path / "engine.json"
  assert check.main(["correctness", "--layers", "1", "--new-tokens", "3", "--sequences", "2",
                     "--max-prompt", "40", "--interpret", "--out", str(out)]) == 0
  result = json.loads(out.read_text())
  assert result["identical_token_share"] == 1.0 and result["mesh_identical_token_share"] == 1.0
  assert result["max_abs_logprob_diff"] < 1e-3 and result["mesh_max_abs_logprob_diff"] < 1e-3


def test_gpu_engine_check_throughput_rows_per_decode_steps_on_cpu(tmp_path):
  check = load("gpu_engine_check")
  out = tmp_path / "throughput.json"
  assert check.main(["throughput", "--layers", "1", "--concurrency", "2", "--new-tokens", "4",
                     "--backends", "reference", "--decode-steps", "1,4", "--out", str(out)]) == 0
  result = json.loads(out.read_text())
  assert result["warmup"]["together"] == 2  # both engines warmed up at once, then timed
  rows = result["rows"]
  assert [(r["decode_steps"], r["concurrency"]) for r in rows] == [(1, 2), (4, 2)]
  assert all(r["gen_tok_s"] > 0 and r["programs"] > 0 and r["recompiled"] == 0 for r in rows)
  import jax

  jax.clear_caches()  # engines on an equal model share programs: compile them again
  assert check.main(["throughput", "--layers", "1", "--concurrency", "2", "--new-tokens", "4",
                     "--backends", "reference", "--decode-steps", "1,4", "--serial-warmup",
                     "--out", str(out)]) == 0
  serial = json.loads(out.read_text())
  # Engines on one model share programs: warmed up one by one, the second compiles only
  # its own decode calls' (its decode steps); at once, every program is traced at least
  # once (by either engine, or both while neither had it).
  programs = [r["programs"] for r in serial["rows"]]
  assert "warmup" not in serial and programs[0] > programs[1] > 0
  assert sum(r["programs"] for r in rows) >= sum(programs)
  assert all(r["recompiled"] == 0 and r["xla_compile_s"] is not None for r in serial["rows"])


def test_gpu_engine_check_device_weights_int4_and_bf16():
  """The Llama-3-8B stage's random weights (made with jax.random), at a toy shape."""
  from o1jax.engine import GenerationParams, Request
  from pallas_kernels.quantized_tensor import QuantizedTensor

  check = load("gpu_engine_check")
  shape = dict(check.LLAMA3_8B_SHAPE, d_model=128, ffn_dim=256, n_heads=2, n_kv_heads=1,
               head_dim=64, vocab_size=512)
  for dense in (False, True):
    config, params = check.random_device_params(shape, 1, tied=False, dense_bf16=dense)
    assert isinstance(params["layers"][0]["wq"], QuantizedTensor) != dense
    kw = dict(weight_mode="dense", matmul_dtype="bfloat16") if dense else dict(weight_mode="quantized")
    engine = check.make_engine(config, params, "reference", max_slots=1, num_blocks=16, **kw)
    result = engine.generate([Request([5, 6, 7], GenerationParams(max_new_tokens=3, ignore_eos=True))])
    assert len(result[0].token_ids) == 3 and all(0 <= t < 512 for t in result[0].token_ids)


@pytest.mark.slow
def test_calibrate_deepconf_prints_a_threshold_and_its_flag(capsys):
  calibrate = load("calibrate_deepconf")
  assert calibrate.main(["--problems", "1", "--n", "2", "--max-thinking", "6", "--max-answer", "3",
                         "--max-rows", "2", "--window", "4"]) == 0  # (a window that fits)
  out = capsys.readouterr().out.strip().splitlines()
  result = json.loads(out[0])
  assert result["problems"] == 1 and result["n"] == 2 and result["threshold"] > 0
  assert out[1] == f"--config.policy.threshold={result['threshold']:.6g}"


def test_tune_qmm_checks_each_tiling_against_the_reference(tmp_path):
  tune = load("tune_qmm")
  out = tmp_path / "tune.json"
  assert tune.main(["--shape", "256x256", "--ms", "1,16", "--block-n", "128", "--k-splits", "1,2",
                    "--warps", "4", "--stages", "3", "--kernels", "dot,gemv", "--gemv-block-n", "64",
                    "--groups-per-iter", "2", "--gemv-k-splits", "2", "--gemv-warps", "1",
                    "--iters", "1",
                    "--out", str(out)]) == 0
  result = json.loads(out.read_text())
  rows = result["rows"]
  # The default tiling of each kernel first (dispatch runs it), then the grid; gemv only
  # up to 4 rows.
  assert [(r["m"], r["kernel"], r["k_splits"], r["default"]) for r in rows] == [
      (1, "dot", 4, True), (1, "dot", 1, False), (1, "dot", 2, False),
      (1, "gemv", 4, True), (1, "gemv", 2, False),
      (16, "dot", 4, True), (16, "dot", 1, False), (16, "dot", 2, False)]
  assert all(r["rel_err"] < 2e-2 and r["us"] > 0 for r in rows)
  assert isinstance(result["gemv_max_rows"], int)
  # Another format, the default tilings only (what dispatch runs: the threshold's rows).
  assert tune.main(["--shape", "256x256", "--ms", "1,16", "--format", "q4_1", "--kernels",
                    "dot,gemv", "--defaults-only", "--iters", "1", "--out", str(out)]) == 0
  result = json.loads(out.read_text())
  assert (result["format"], result["group"]) == ("q4_1", 32)
  assert [(r["m"], r["kernel"], r["default"]) for r in result["rows"]] == [
      (1, "dot", True), (1, "gemv", True), (16, "dot", True)]
  assert all(r["rel_err"] < 2e-2 for r in result["rows"])


def test_bench_sampling_prints_both_samplers_for_every_setting(capsys):
  bs = load("bench_sampling")
  assert bs.main(["--rows", "4", "--vocab", "600", "--repeats", "1"]) == 0
  rows = [l for l in capsys.readouterr().out.splitlines() if l.startswith("| temperature")]
  assert len(rows) == 7 and all(l.rstrip().endswith("x |") for l in rows)


def test_tune_qmm_keeps_the_rows_of_a_run_cut_short(tmp_path, monkeypatch):
  # The GPU check's stage limit can cut the sweep: the JSON holds every row measured so far
  # (it was written only at the end).
  tune = load("tune_qmm")
  out = tmp_path / "tune.json"
  calls = []
  real_bench = tune.bench

  def bench(*args, **kwargs):
    calls.append(1)
    if len(calls) == 4:  # the dense comparator, two tilings, then the cut
      raise KeyboardInterrupt
    return real_bench(*args, **kwargs)

  monkeypatch.setattr(tune, "bench", bench)
  with pytest.raises(KeyboardInterrupt):
    tune.main(["--shape", "256x256", "--ms", "1", "--block-n", "128", "--k-splits", "1,2",
               "--warps", "4", "--stages", "3", "--kernels", "dot", "--iters", "1",
               "--out", str(out)])
  kept = json.loads(out.read_text())
  assert len(kept["rows"]) == 2 and kept["gemv_max_rows"] is None


def test_bench_policies_paired_interval():
  bp = load("bench_policies")
  same = np.array([1, 0, 1, 0], bool)
  assert bp.paired_interval(same, same, 200, 0) == (0.0, 0.0)  # no problem differs
  a = np.array([1] * 10 + [0] * 90, bool)  # a right on 10 problems that b misses
  b = np.zeros(100, bool)
  lo, hi = bp.paired_interval(a, b, 2000, 0)
  assert 3.0 < lo < 10.0 < hi < 17.0  # around +10 points, all above 0
  # One problem: nothing to resample (scipy raised, after every policy had run).
  assert bp.paired_interval(np.array([True]), np.array([False]), 200, 0) is None


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
  """A tiny random GGUF with room for the GSM prompts (byte tokens)."""
  from o1jax.testing import tiny_config, write_gguf_checkpoint
  path = tmp_path_factory.mktemp("tiny_scripts") / "tiny.gguf"
  write_gguf_checkpoint(path, tiny_config(max_context=2048), seed=0)
  return str(path)


TINY_NUMERICS = ["--matmul-dtype", "float32", "--kv-dtype", "float32"]


def test_bench_budget_runs_every_variant_on_the_same_arrivals(tiny_gguf, tmp_path):
  out = load("bench_budget").main(["--source", tiny_gguf, "--requests", "4", "--loads", "1.0",
                                   "--slots", "2", "--max-new-tokens", "8", "--slo", "0.01",
                                   "--interval-ms", "1", "--json", str(tmp_path / "b.json"),
                                   *TINY_NUMERICS])
  runs = out["runs"]
  assert [(r["mode"], r["policy"]) for r in runs] == [
      ("fixed", "fifo"), ("fixed", "shortest_budget"), ("adaptive", "fifo"),
      ("adaptive", "shortest_budget")]
  saved = json.loads((tmp_path / "b.json").read_text())["runs"]
  for r, kept in zip(runs, saved, strict=True):
    lat = r["latency_s"]
    assert 0 < lat["p5"] <= lat["p50"] <= lat["p95"] <= lat["p99"]
    # Each request's latency is kept: the percentiles can be recomputed from the JSON.
    assert len(kept["request_latency_s"]) == 4
    assert np.percentile(kept["request_latency_s"], 95) == pytest.approx(lat["p95"], abs=1e-5)
    assert r["variation"] == pytest.approx((lat["p95"] - lat["p5"]) / 2 / lat["p50"])
    assert len(r["correct"]) == 4 and r["delta_accuracy"][1] >= 0
  fixed, adaptive = runs[0], runs[2]
  assert not fixed["budget"] and adaptive["budget"]
  # SLO 10 ms: nothing meets it, so the adaptive budget falls to its floor (16 steps: a
  # token limit of ceil(8 * 16 / 128) = 1) once requests have finished.
  assert min(s for _, s in adaptive["budget"]) == 16
  assert adaptive["tokens"] < fixed["tokens"] == 8
  assert json.loads((tmp_path / "b.json").read_text())["slo_s"] == 0.01


def test_study_scripts_run_at_toy_size(tiny_gguf, tmp_path):
  temps = load("study_temperature").main(
      ["--source", tiny_gguf, "--problems", "3", "--temperatures", "0.3,1.2",
       "--max-new-tokens", "6", "--long", "4", "--slots", "4", *TINY_NUMERICS])
  for row in temps["rows"]:
    assert len(row["lengths"]) == 3 and max(row["lengths"]) <= 6
    assert row["long_share"] == np.mean(np.asarray(row["lengths"]) > 4)
  batches = load("study_batch_latency").main(
      ["--source", tiny_gguf, "--batches", "1,2", "--new-tokens", "4", *TINY_NUMERICS,
       "--png", str(tmp_path / "b.png")])
  assert [r["batch"] for r in batches["rows"]] == [1, 2]
  # 2 slots run as 2 rows: the engine's buckets (1, 8, ...) never pad past its slots.
  assert [r["decode_batch"] for r in batches["rows"]] == [1, 2]
  assert batches["peak_read_gb_s"] > 0 and (tmp_path / "b.png").stat().st_size > 0
  r = batches["rows"][1]
  assert r["bytes_per_step"] > batches["weight_bytes"] and r["gb_s"] > 0


def test_bench_speculative_runs_every_drafter_and_compares_tokens(tiny_gguf, tmp_path):
  out = load("bench_speculative").main(
      ["--source", tiny_gguf, "--tasks", "copy,gsm", "--batches", "2", "--max-new-tokens", "6",
       "--drafters", "prompt_lookup,early_exit:1,draft_model:float32", "--max-drafts", "3",
       "--json", str(tmp_path / "s.json")])
  rows = out["rows"]
  configs = ["plain", "prompt_lookup", "early_exit:1", "draft_model:float32", "plain (again)"]
  assert [(r["task"], r["batch"], r["config"]) for r in rows] == [
      (t, 2, c) for t in ("copy", "gsm") for c in configs]
  assert all(r["same_tokens"] for r in rows)  # speculation never changes a token
  for r in rows:
    assert r["decode_tok_s"] > 0 and 0 <= r["acceptance_rate"] <= 1
    assert r["verify_calls"] <= r["decode_calls"]
  plain = [r for r in rows if r["config"].startswith("plain")]
  assert all(r["verify_calls"] == 0 for r in plain)
  assert json.loads((tmp_path / "s.json").read_text())["rows"] == json.loads(json.dumps(rows))


def test_bench_speculative_controller_mode(tiny_gguf):
  out = load("bench_speculative").main(
      ["--source", tiny_gguf, "--tasks", "copy", "--batches", "2", "--max-new-tokens", "6",
       "--max-drafts", "3", "--controller", "--rounds", "2"])
  rows = out["rows"]
  names = ["plain", "loop:prompt_lookup", "loop:lookup always", "plain (again)"]
  assert [(r["round"], r["config"]) for r in rows] == [(i, n) for i in (0, 1) for n in names]
  assert all(r["same_tokens"] for r in rows)
  for first in (0, 4):  # each round has its own baseline: its plain runs average to 1
    assert rows[first]["decode_ratio"] + rows[first + 3]["decode_ratio"] == pytest.approx(2.0)
    assert rows[first + 2]["verify_calls"] == rows[first + 2]["decode_calls"] > 0
    assert rows[first]["verify_calls"] == rows[first + 3]["verify_calls"] == 0


def test_bench_speculative_refuses_drafters_the_controller_would_ignore(capsys):
  with pytest.raises(SystemExit) as e:
    load("bench_speculative").main(["--controller", "--drafters", "early_exit:8"])
  assert e.value.code == 2
  assert "--drafters: the controller's loop drafts by prompt lookup only" in capsys.readouterr().err


def test_study_multi_exit_runs_each_exit(tiny_gguf):
  out = load("study_multi_exit").main(
      ["--source", tiny_gguf, "--exits", "1,0", "--problems", "3", "--max-new-tokens", "5",
       "--slots", "4", *TINY_NUMERICS])
  assert [(r["exit_layer"], r["full_depth"]) for r in out["rows"]] == [(1, False), (2, True)]
  for r in out["rows"]:
    assert 0 <= r["accuracy"] <= 1 and 0 < r["mean_tokens"] <= 5 and r["decode_tok_s"] > 0
  # An exit past the model's layers ran them all, labelled "layer 99".
  assert load("study_multi_exit").main(["--source", tiny_gguf, "--exits", "99"]) == 2


@pytest.mark.parametrize("script, flags", [
    # Before: tracebacks after the model loaded, or (--loads 0) a loop on NaN arrivals.
    ("bench_budget", ["--requests", "0"]), ("bench_budget", ["--loads", "0"]),
    ("bench_budget", ["--loads", "abc"]), ("bench_budget", ["--interval-ms", "nan"]),
    ("bench_budget", ["--slo", "-1"]), ("bench_budget", ["--kv-dtype", "foo"]),
    ("bench_budget", ["--prompt-style", "foo"]),
    ("study_batch_latency", ["--batches", "1,x"]), ("study_batch_latency", ["--new-tokens", "0"]),
    ("study_multi_exit", ["--problems", "0"]), ("study_multi_exit", ["--exits", "-1"]),
    # (tracebacks after the model loaded; --rounds 0 measured nothing and exited 0)
    ("bench_speculative", ["--batches", "0"]), ("bench_speculative", ["--batches", "x"]),
    ("bench_speculative", ["--max-drafts", "0"]), ("bench_speculative", ["--matmul-dtype", "foo"]),
    ("bench_speculative", ["--kv-dtype", "foo"]), ("bench_speculative", ["--rounds", "0"]),
    ("bench_speculative", ["--max-new-tokens", "0"]),
    ("bench_speculative", ["--drafters", "draft_model:int4x"]),
])
def test_latency_scripts_refuse_bad_flags_before_any_work(script, flags, capsys):
  with pytest.raises(SystemExit) as e:
    load(script).main(flags)
  assert e.value.code == 2
  last = capsys.readouterr().err.strip().splitlines()[-1]
  assert re.search(r": error: argument --[\w-]+: (expected|invalid choice)", last), last


def test_latency_scripts_name_a_checkpoint_that_does_not_load(tmp_path, capsys):
  for script in ("bench_budget", "study_batch_latency", "study_multi_exit"):
    assert load(script).main(["--source", str(tmp_path / "missing.gguf")]) == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_bench_prefill_times_every_backend_and_chunk(tiny_gguf, capsys):
  rates = load("bench_prefill").main(
      ["--source", tiny_gguf, "--chunks", "16,32", "--prompt-words", "40", "--runs", "2",
       "--kv-dtype", "float32"])
  assert list(rates) == [("auto", 16), ("auto", 32), ("reference", 16), ("reference", 32)]
  assert all(len(r) == 2 and min(r) > 0 for r in rates.values())
  assert "x auto/16" in capsys.readouterr().out


def test_bench_int8_matmul_times_every_format_per_row_count(tmp_path):
  from pallas_kernels import native

  if not native.int8_matmul_available():
    pytest.skip("the native int8 matmul does not run here")
  out = tmp_path / "int8.json"
  results = load("bench_int8_matmul").main(["--rows", "1,3", "--rounds", "1", "--layers", "1",
                                            "--json", str(out)])
  assert [r["rows"] for r in results] == [1, 3]
  for r in results:
    assert all(r[f"{f}_ms"] > 0 for f in ("q4_0", "q8_0", "iq4_lut", "iq4_8bit"))
    assert r["lut_over_8bit"] == pytest.approx(r["iq4_lut_ms"] / r["iq4_8bit_ms"])
  assert json.loads(out.read_text())["results"] == results


def test_bench_f32_matmul_times_both_paths_per_row_count(tmp_path):
  from pallas_kernels import native

  if not native.f32_matmul_available():
    pytest.skip("the native f32 matmul does not run here")
  out = tmp_path / "f32.json"
  results = load("bench_f32_matmul").main(["--rows", "1,3", "--rounds", "1", "--layers", "1",
                                           "--json", str(out)])
  assert [r["rows"] for r in results] == [1, 3]
  for r in results:
    assert r["xla_ms"] > 0 and r["native_ms"] > 0
    assert r["ratio"] == pytest.approx(r["native_ms"] / r["xla_ms"])
  assert json.loads(out.read_text())["results"] == results


def test_gpu_engine_check_speculative_rows_on_cpu(tmp_path):
  """The GPU speculative stage at a toy size: plain, three drafters, plain again, each
  with its tokens compared to plain decoding's (bench_speculative's `measure`)."""
  check = load("gpu_engine_check")
  out = tmp_path / "speculative.json"
  assert check.main(["speculative", "--layers", "2", "--concurrency", "1", "--new-tokens", "8",
                     "--max-drafts", "3", "--backends", "reference", "--out", str(out)]) == 0
  result = json.loads(out.read_text())
  assert "partial" not in result  # the runs of a concurrency, dumped as they finish
  rows = result["rows"]
  assert [r["config"] for r in rows] == ["plain", "prompt_lookup", "early_exit:8",
                                         "draft_model:same", "plain (again)"]
  assert all(r["same_tokens"] and r["generated_tokens"] == 4 * 8 for r in rows)
  assert all(r["decode_ratio"] > 0 and r["compiled_in_timed_run"] == 0 for r in rows)
  prompts = check.repeat_prompts(2, vocab=100)
  assert len(prompts[0]) == 104 and prompts[0][48:96] == prompts[0][:48]
  assert prompts[0][96:] == prompts[0][:8] and prompts[0] != prompts[1]


def test_gpu_engine_check_controller_rows_on_cpu(tmp_path):
  """The GPU controller stage at a toy size: self-consistency n=8 through the controller
  against the engine sampling the same 16 rows; every engine row runs its full budget."""
  check = load("gpu_engine_check")
  out = tmp_path / "controller.json"
  assert check.main(["controller", "--layers", "1", "--concurrency", "16", "--new-tokens", "24",
                     "--backends", "reference", "--out", str(out)]) == 0
  [row] = json.loads(out.read_text())["rows"]
  assert row["rows"] == 16 and row["engine_tokens"] == 16 * 24
  # budgets plus forced text (the answer prefix: ~20 byte tokens here)
  assert 16 * 24 <= row["controller_tokens"] <= 16 * (24 + 32)
  assert row["controller_tok_s"] > 0 and row["ratio"] > 0


def test_bench_engine_refuses_a_sampled_run_against_greedy_references(capsys):
  be = load("bench_engine")
  with pytest.raises(SystemExit):
    be.main(["--temperature", "0.8"])
  assert "add --skip-llamacpp --skip-hf" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    be.main(["--top-p", "0.9", "--skip-llamacpp", "--skip-hf"])
  assert "add --temperature" in capsys.readouterr().err


def test_check_gguf_quants_llamacpp_names_its_extra_when_llama_cpp_is_missing(capsys):
  if importlib.util.find_spec("llama_cpp") is not None:
    pytest.skip("llama-cpp-python is installed: the script runs for real (a study, not a test)")
  assert load("check_gguf_quants_llamacpp").main(["--types", "Q8_0"]) == 2
  assert "needs llama-cpp-python" in capsys.readouterr().err


def test_check_tokenizers_llamacpp_names_its_extra_when_llama_cpp_is_missing(capsys):
  if importlib.util.find_spec("llama_cpp") is not None:
    pytest.skip("llama-cpp-python is installed: the script runs for real (a study, not a test)")
  assert load("check_tokenizers_llamacpp").main(["--pre", "qwen2"]) == 2
  assert "needs llama-cpp-python" in capsys.readouterr().err


def test_check_tokenizers_llamacpp_vocabulary_merges_every_byte_pair():
  from o1jax import testing
  tokens, merges, types = load("check_tokenizers_llamacpp")._vocab()
  specials = len(testing.SPECIAL_TOKENS)
  pairs = tokens[specials + 256:specials + 256 + 256 * 256]
  words = tokens[specials + 256 + 256 * 256:]  # whole words no merge reaches (ignore_merges)
  assert len(merges) == 256 * 256 and len(tokens) == len(types)
  assert set(pairs) == {m.replace(" ", "") for m in merges}
  assert words and all(len(w) > 2 for w in words)
  assert len(set(tokens)) == len(tokens) and types == [3] * specials + [1] * (len(tokens) - specials)


def test_bench_shared_prefix_runs_both_controllers_alternating(tmp_path):
  from o1jax.testing import tiny_config, write_gguf_checkpoint
  model = tmp_path / "tiny.gguf"  # room for the 8-shot prompt in byte tokens (~2,100)
  write_gguf_checkpoint(model, tiny_config(max_context=4096), seed=0)
  out = load("bench_shared_prefix").main(
      ["--model", str(model), "--requests", "3", "--batch", "2", "--n", "2", "--max-thinking",
       "4", "--max-answer", "2", "--rounds", "1", "--prompt", "text", *TINY_NUMERICS,
       "--json", str(tmp_path / "p.json")])
  assert [(r["round"], r["share_prefixes"]) for r in out["runs"]] == [
      (0, False), (0, True), (1, True), (1, False)]
  assert len(out["speedups"]) == 1 and out["speedups"][0] > 0
  assert out["traces"] == 6 and 0 <= out["identical_traces"] <= 6
  assert min(out["prompt_tokens"]) > 2000  # the 8-shot prefix in byte tokens
  assert json.loads((tmp_path / "p.json").read_text())["runs"] == json.loads(json.dumps(out["runs"]))


def test_suite_floors_scores_replies_that_read_no_prompt():
  """A fixed "ok" follows instructions that only forbid things; a copied document finds
  every key fact; an empty reply follows nothing (scripts/suite_floors.py's rows)."""
  rows = load("suite_floors").floors(seed=0, n=20)
  by = {(r["category"], r["reply"]): r for r in rows}
  assert by[("instructions", "''")]["prompt_strict"] == 0.0
  assert by[("instructions", "'ok'")]["prompt_strict"] > 0.0
  copied = by[("summarization", "the document, copied")]
  assert copied["key_fact_recall"] == 1.0 and copied["rouge_l"] < 0.1
  assert by[("qa", "the question, copied")]["exact_match"] == 0.0


@pytest.mark.parametrize("kind, rel_rms", [("Q3_K", 0.17), ("Q6_K", 0.020)])
def test_kquant_reencoding_takes_signed_scales_as_llama_cpp(kind, rel_rms):
  """Q3_K / Q6_K scales are signed (llama.cpp's make_qx_quants): a group's largest value
  takes the lowest code (-4 / -32) whatever its sign. Positive scales clipped a positive
  peak at +3 / +31 steps (relative RMS error 0.182 / 0.0223 on a Gaussian matrix, where
  the signed value set gives 0.155 / 0.0188)."""
  from pallas_kernels.quantized_tensor import dequantize
  acc = load("matmul_accuracy")
  group, lo, hi, _, _ = acc.KQUANTS[kind]
  w = np.random.default_rng(0).standard_normal((576, 64)).astype(np.float32)
  qt = acc.kquantize(w, kind)
  back = np.asarray(dequantize(qt), np.float32)
  codes = np.asarray(qt.packed, np.int32)
  assert codes.min() >= lo and codes.max() <= hi
  assert np.sqrt(np.mean((back - w) ** 2) / np.mean(w ** 2)) < rel_rms
  groups = w.reshape(-1, group, 64)
  peak_at = np.abs(groups).argmax(axis=1)[:, None, :]
  peak, peak_back = (np.take_along_axis(a.reshape(-1, group, 64), peak_at, axis=1)
                     for a in (w, back))
  step = np.abs(np.asarray(qt.scale)).reshape(-1, 1, 64)
  assert (peak > 0).any() and (np.abs(peak - peak_back) <= 0.5 * step + 0.02 * np.abs(peak)).all()


def test_bench_policies_checks_its_flags_before_the_model_and_writes_outside_the_checkout():
  """A policy typo ended a 30-minute run at its turn (the rows before it unwritten);
  --problems 0 divided by zero after the model loaded; the default --out was relative (a
  run from the repo's root wrote into the checkout)."""
  import tempfile
  bench = load("bench_policies")
  for argv in (["--policies", "greedy_cot,self_consistancy"], ["--problems", "0"],
               ["--levels", "5"]):
    with pytest.raises(SystemExit) as e:
      bench.parse_args(argv)
    assert e.value.code == 2
  args = bench.parse_args([])
  assert args.policies == list(bench.POLICY_ROWS[:1]) + ["self_consistency", "deepconf",
                                                          "deepconf_calibrated", "best_of_n",
                                                          "think_verify_backtrack",
                                                          "budget_forcing"]
  assert os.path.isabs(args.out) and args.out.startswith(tempfile.gettempdir())


@pytest.mark.parametrize("argv, message", [
    (["throughput", "--layers", "1"], "throughput with backend pallas needs a GPU"),
    (["correctness", "--layers", "1"], "correctness compiles the Pallas kernels for a GPU"),
])
def test_gpu_engine_check_refuses_the_pallas_kernels_off_a_gpu_in_one_line(argv, message, capsys):
  with pytest.raises(SystemExit) as e:
    load("gpu_engine_check").main(argv)
  assert e.value.code == 2 and message in capsys.readouterr().err


def test_gpu_check_sh_refuses_a_machine_without_a_gpu(tmp_path):
  """Each stage failed with a traceback and the script said 0 (stage failures are exit 1)."""
  env = dict(os.environ, PATH=f"{pathlib.Path(sys.executable).parent}:{os.environ['PATH']}")
  proc = subprocess.run(["bash", str(SCRIPTS / "gpu_check.sh"), str(tmp_path / "gc"), "engine"],
                        capture_output=True, text=True, timeout=120, env=env)
  assert proc.returncode == 2 and "gpu_check.sh: no GPU" in proc.stderr
  assert not (tmp_path / "gc" / "engine.log").exists()


def test_bench_kernels_refuses_an_unknown_kernel_name(capsys):
  with pytest.raises(SystemExit) as e:  # (--only qmmm ran nothing and said 0)
    load("bench_kernels").main(["--only", "qmmm"])
  assert e.value.code == 2 and "expected comma-separated kernels" in capsys.readouterr().err


@pytest.mark.parametrize("name, flag", [
    ("bench_engine", "--model"), ("bench_prefill", "--source"), ("bench_speculative", "--source"),
    ("bench_shared_prefix", "--model"), ("bench_tensor_parallel", "--model"),
    ("bench_controller_cache", "--model"), ("study_temperature", "--source")])
def test_a_missing_checkpoint_is_one_error_line_and_exit_2(name, flag, tmp_path, capsys):
  missing = tmp_path / "nope.gguf"
  assert load(name).main([flag, str(missing)]) == 2
  assert capsys.readouterr().err == f"error: {missing}: no such file or directory\n"
  text = (SCRIPTS / f"{name}.py").read_text()
  assert 'if __name__ == "__main__":\n  run_as_script(main)' in text  # (its code is the exit's)


def test_gpu_check_sh_exit_status_names_failed_and_skipped_stages_of_this_run(tmp_path):
  """A stage skipped at the deadline left an earlier run's rc in OUTDIR, read as this run's
  (a failure that never ran); a run whose stages were all skipped said 0."""
  fake = tmp_path / "bin" / "python"  # a GPU machine whose bench stage fails
  fake.parent.mkdir()
  fake.write_text('#!/bin/bash\ncase "$*" in *bench_kernels.py*) exit 3;; esac\nexit 0\n')
  fake.chmod(0o755)
  env = dict(os.environ, PATH=f"{fake.parent}:{os.environ['PATH']}")
  out = tmp_path / "gc"
  run = lambda *args: subprocess.run(["bash", str(SCRIPTS / "gpu_check.sh"), str(out), *args],
                                     capture_output=True, text=True, timeout=120, env=env)
  proc = run("engine,bench")
  assert proc.returncode == 1 and "stages that failed or were skipped: bench (" in proc.stderr
  assert (out / "engine.rc").read_text() == "0\n" and (out / "bench.rc").read_text() == "3\n"
  proc = run("engine,bench", "10")  # no time left: both skipped
  assert proc.returncode == 1 and "stages that failed or were skipped: engine bench (" in proc.stderr
  assert (out / "bench.rc").read_text() == "skipped\n"
  assert run("engine").returncode == 0
