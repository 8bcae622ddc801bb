"""Topology-aware placement: recorded `nvidia-smi topo -m` tables → tensor-parallel groups on the
best links; a real mesh on 8 forced CPU devices (in a subprocess: XLA_FLAGS must precede jax)."""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from o1jax.sharding import (GpuTopology, TopologyError, best_groups, describe,
                            parse_nvidia_smi_topo, tp_groups)

HERE = pathlib.Path(__file__).parent
REPO = HERE.parents[2]


def topo(name: str) -> GpuTopology:
  return parse_nvidia_smi_topo((HERE / "topologies" / f"{name}.txt").read_text())


@dataclasses.dataclass(frozen=True)
class FakeGpu:
  """The attributes placement reads from a JAX device."""
  id: int
  process_index: int = 0
  local_hardware_id: int = 0
  platform: str = "gpu"


def gpus(n=8, processes=1):
  per = n // processes
  return [FakeGpu(id=i, process_index=i // per, local_hardware_id=i % per) for i in range(n)]


def ids(groups):
  return [[d.id for d in g] for g in groups]


def test_parse_reads_links_and_affinity_from_the_real_layout():
  t = topo("nv18_8gpu")  # tabs, the header's underline escape codes, NIC columns, legend
  assert t.gpus == tuple(f"GPU{i}" for i in range(8))
  assert t.links[0][:3] == ("X", "NV18", "NV18")
  assert t.cpu_affinity[0] == "0-55,112-167" and t.cpu_affinity[7] == "56-111,168-223"
  assert t.numa_affinity == ("0",) * 4 + ("1",) * 4
  spaced = topo("islands_2x4_interleaved")  # space-aligned, as copied from a terminal
  assert spaced.links[0][:3] == ("X", "SYS", "NV12") and spaced.numa_affinity[:2] == ("0", "1")
  # Link order: NVLink (more bonded links better) > PIX > PXB > PHB > NODE > SYS.
  pcie = topo("pcie_only_8gpu")
  assert pcie.level(0, 1) > pcie.level(0, 2) > pcie.level(0, 4)
  assert t.level(0, 1) > pcie.level(0, 1) and t.level(0, 1) > topo("islands_2x4").level(0, 1)


def test_any_nvlink_count_ranks_below_the_same_chip():
  # Before: NV90 ranked as the same chip ("weakest link same chip" for two GPUs), and
  # NV10**20 overflowed the level array (a traceback from tp_groups).
  for count in (90, 10**20):
    t = parse_nvidia_smi_topo(f"\tGPU0\tGPU1\tGPU2\nGPU0\t X \tNV{count}\tNV2\n"
                              f"GPU1\tNV{count}\t X \tNV2\nGPU2\tNV2\tNV2\t X \n")
    assert t.level(0, 0) > t.level(0, 1) > t.level(0, 2)
    assert ids(tp_groups(gpus(3), 2, t, spare=True)) == [[0, 1]]
    assert "same chip" not in describe([gpus(3)[:2]], t, cuda_visible_devices="")


def test_nic_columns_of_older_drivers_are_read_as_nics():
  # Before: "row 'mlx5_bond_0' is not a column of the header", and placement by device order.
  text = ("\tGPU0\tGPU1\tmlx5_bond_0\thfi1_0\tCPU Affinity\tNUMA Affinity\n"
          "GPU0\t X \tNV4\tPXB\tSYS\t0-31\t0\n"
          "GPU1\tNV4\t X \tSYS\tPXB\t0-31\t0\n"
          "mlx5_bond_0\tPXB\tSYS\t X \tSYS\n"
          "hfi1_0\tSYS\tPXB\tSYS\t X \n\nLegend:\n\n  X    = Self\n")
  t = parse_nvidia_smi_topo(text)
  assert t.gpus == ("GPU0", "GPU1") and t.links == (("X", "NV4"), ("NV4", "X"))
  assert t.cpu_affinity == ("0-31", "0-31") and t.numa_affinity == ("0", "0")


@pytest.mark.parametrize("text, message", [
    ("no table here\n", "no header line starting with GPU0"),
    # Before: accepted, GPU2 then read as GPU1 / the last row of GPU1 kept.
    ("\tGPU0\tGPU2\nGPU0\t X \tNV4\nGPU2\tNV4\t X \n",
     r"the header's GPUs are GPU0, GPU2; nvidia-smi lists GPU0..GPU1 in order"),
    ("\tGPU0\tGPU1\nGPU0\t X \tNV4\nGPU1\tNV4\t X \nGPU1\tSYS\t X \n", "row GPU1 appears twice"),
    ("\tGPU0\tGPU1\nGPU0\t X \tNV4\nGPU1\tNV4\t X \tQQQ\nGPU2\tX\n", "row 'GPU2' is not a column"),
    ("\tGPU0\tGPU1\nGPU0\t X \tNV4\nGPU1\tFOO\t X \n", "unknown link 'FOO'"),
    ("\tGPU0\tGPU1\nGPU0\t X \tNV4\n", "no row for GPU1"),
    ("\tGPU0\tGPU1\nGPU0\t X \nGPU1\tNV4\t X \n", "row GPU0 has 1 entries for 2 columns"),
])
def test_bad_tables_are_one_line_errors(text, message):
  with pytest.raises(TopologyError, match=message) as e:
    parse_nvidia_smi_topo(text)
  assert "\n" not in str(e.value)


@pytest.mark.parametrize("model, expected", [
    (8, [[0, 1, 2, 3, 4, 5, 6, 7]]),
    (4, [[0, 1, 2, 3], [4, 5, 6, 7]]),
    (2, [[0, 1], [2, 3], [4, 5], [6, 7]]),
])
def test_full_nvlink_any_grouping_is_best_and_order_is_kept(model, expected):
  assert ids(tp_groups(gpus(), model, topo("nv18_8gpu"))) == expected


@pytest.mark.parametrize("name, model, expected", [
    ("islands_2x4", 4, [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("islands_2x4", 2, [[0, 1], [2, 3], [4, 5], [6, 7]]),
    ("islands_2x4_interleaved", 4, [[0, 2, 4, 6], [1, 3, 5, 7]]),
    ("islands_2x4_interleaved", 2, [[0, 2], [1, 3], [4, 6], [5, 7]]),
    ("pcie_only_8gpu", 2, [[0, 1], [2, 3], [4, 5], [6, 7]]),  # behind one switch (PIX)
    ("pcie_only_8gpu", 4, [[0, 1, 2, 3], [4, 5, 6, 7]]),  # one socket (NODE), never across (SYS)
])
def test_tensor_parallel_groups_are_the_nvlink_islands(name, model, expected):
  t = topo(name)
  groups = tp_groups(gpus(), model, t)
  assert ids(groups) == expected
  if name.startswith("islands"):  # every group on NVLink only
    assert all(line.endswith("weakest link NV12") for line in describe(groups, t).splitlines())


def test_interleaved_islands_with_cuda_visible_devices():
  # Only GPUs 4..7 are visible: CUDA ordinals 0..3 are nvidia-smi's GPU4..GPU7, whose
  # islands are {4, 6} and {5, 7}, i.e. ordinals {0, 2} and {1, 3}.
  visible = [FakeGpu(id=i, local_hardware_id=i) for i in range(4)]
  groups = tp_groups(visible, 2, topo("islands_2x4_interleaved"), cuda_visible_devices="4,5,6,7")
  assert ids(groups) == [[0, 2], [1, 3]]
  # describe() reads the mapping it is given (it read the environment's only): ordinals 0
  # and 1 are GPU0 and GPU2 (NVLink) under "0,2,1,3", GPU0 and GPU1 (SYS) without it.
  pair = [visible[:2]]
  assert describe(pair, topo("islands_2x4_interleaved"), cuda_visible_devices="0,2,1,3") == (
      "data=0: devices [0, 1], weakest link NV12")
  assert describe(pair, topo("islands_2x4_interleaved"), cuda_visible_devices="0,1,2,3") == (
      "data=0: devices [0, 1], weakest link SYS")
  with pytest.raises(TopologyError, match="not UUIDs"):  # (make_mesh falls back: below)
    tp_groups(visible, 2, topo("islands_2x4_interleaved"), cuda_visible_devices="GPU-1a2b,GPU-3c4d")


@dataclasses.dataclass(frozen=True)
class RemoteGpu:
  """Another host's device as JAX shows it here: no local_hardware_id."""
  id: int
  process_index: int
  local_hardware_id: None = None
  platform: str = "gpu"


def test_several_processes_groups_stay_inside_a_host_or_take_whole_hosts():
  devices = gpus(16, processes=2)  # two hosts wired like islands_2x4
  t = topo("islands_2x4")
  assert ids(tp_groups(devices, 4, t)) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
  # The other host's devices are matched to the table by their rank in their process.
  mixed = gpus(16, processes=2)[:8] + [RemoteGpu(id=8 + i, process_index=1) for i in range(8)]
  interleaved = topo("islands_2x4_interleaved")
  assert ids(tp_groups(mixed, 4, interleaved)) == [
      [0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
  assert ids(tp_groups(devices, 16, t)) == [list(range(16))]
  with pytest.raises(TopologyError, match="model=12 spans processes of 8 devices"):
    tp_groups(gpus(24, processes=3), 12, t)


def test_best_groups_maximizes_the_weakest_link_first():
  # 4 devices: 0-1 and 2-3 are fast (9), 0-2 fastest (10) but then 1-3 would be slow (1).
  levels = [[100, 9, 10, 1], [9, 100, 1, 1], [10, 1, 100, 9], [1, 1, 9, 100]]
  import numpy as np
  assert best_groups(np.array(levels), 2) == [(0, 1), (2, 3)]


@pytest.mark.parametrize("model, message", [
    (3, r"model=3 does not divide the 8 devices \(model can be one of \[1, 2, 4, 8\]\)"),
    (0, "model=0: the model axis needs at least 1 device"),
    (16, r"^model=16 needs 16 devices; there are 8$"),
    ("4", r"^model='4': expected an int \(devices\)$"),  # (was a TypeError)
    (2.0, r"^model=2\.0: expected an int \(devices\)$"),
])
def test_impossible_shapes_are_one_line_errors(model, message):
  with pytest.raises(TopologyError, match=message):
    tp_groups(gpus(), model, topo("nv18_8gpu"))


_CPU_SCRIPT = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from o1jax.sharding import TopologyError, make_mesh, parse_nvidia_smi_topo
out = {"devices": len(jax.devices())}
for model in (1, 2, 4, 8):
  mesh = make_mesh(model=model)
  out[f"shape_{model}"] = [list(mesh.axis_names), [int(s) for s in mesh.devices.shape]]
# A recorded GPU table applied to the CPU devices (matched by id): rows follow the islands.
islands = parse_nvidia_smi_topo(open(sys.argv[1]).read())
mesh = make_mesh(model=4, data=2, topology=islands)
out["islands"] = [[d.id for d in row] for row in mesh.devices]
# The mesh is usable: a matmul sharded over both axes matches the unsharded one.
x = jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16)
w = jnp.ones((16, 8), jnp.float32)
xs = jax.device_put(x, NamedSharding(mesh, P("data", None)))
ws = jax.device_put(w, NamedSharding(mesh, P(None, "model")))
out["matmul_ok"] = bool(np.allclose(jax.jit(jnp.dot)(xs, ws), x @ w))
for kwargs in ({"model": 3}, {"model": 2, "data": 3}):
  try:
    make_mesh(**kwargs)
  except TopologyError as e:
    out.setdefault("errors", []).append(str(e))
# Data-parallel replicas: groups placed over every device, then the first taken (the device
# list was cut first: 3 x TP=2 paired GPUs 0 and 1 over SYS).
from o1jax.engine.replicas import replica_meshes
out["replicas"] = [[d.id for d in m.devices[0]] for m in replica_meshes(3, 2, topo=islands)]
# GPU UUIDs in CUDA_VISIBLE_DEVICES cannot be matched to the table: placed by attributes,
# with a warning (was: no mesh at all).
import warnings
with warnings.catch_warnings(record=True) as caught:
  warnings.simplefilter("always")
  mesh = make_mesh(model=2, topology=islands, cuda_visible_devices="GPU-1a2b,GPU-3c4d")
out["uuid_groups"] = [[d.id for d in row] for row in mesh.devices]
out["uuid_warning"] = [str(w.message) for w in caught]
print(json.dumps(out))
"""


def test_mesh_on_8_forced_cpu_devices():
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
         "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
  proc = subprocess.run([sys.executable, "-c", _CPU_SCRIPT,
                         str(HERE / "topologies" / "islands_2x4_interleaved.txt")],
                        capture_output=True, text=True, env=env, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  assert out["devices"] == 8
  assert out["shape_1"] == [["data", "model"], [8, 1]]
  assert out["shape_2"] == [["data", "model"], [4, 2]]
  assert out["shape_4"] == [["data", "model"], [2, 4]]
  assert out["shape_8"] == [["data", "model"], [1, 8]]
  assert out["islands"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
  assert out["matmul_ok"]
  assert out["errors"] == [
      "model=3 does not divide the 8 devices (model can be one of [1, 2, 4, 8])",
      "data=3 x model=2 = 6 devices, but there are 8 (pass devices= to use fewer)"]
  assert out["replicas"] == [[0, 2], [1, 3], [4, 6]]  # NVLink pairs of the islands
  assert out["uuid_groups"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
  assert out["uuid_warning"] == [
      "CUDA_VISIBLE_DEVICES='GPU-1a2b,GPU-3c4d': only GPU indices can be matched to "
      "nvidia-smi's table (not UUIDs, MIG names or -1); placing devices by their JAX "
      "attributes instead"]


def test_groups_that_leave_devices_out_are_chosen_from_all_of_them():
  """tp=3 on two NVLink islands of 4: the list was cut to 6 devices first, and the second
  group sat over SYS ([[0,1,2],[3,4,5]]) while 4, 5, 6 were free on NVLink."""
  t = topo("islands_2x4")
  groups = tp_groups(gpus(8), 3, t, spare=True)
  assert ids(groups) == [[0, 1, 2], [4, 5, 6]]
  assert all("SYS" not in line for line in describe(groups, t, "").splitlines())
  # Ties keep index order; the whole partition when nothing is left out.
  assert best_groups(np.full((4, 4), 5), 2, spare=0) == [(0, 1), (2, 3)]
  assert best_groups(np.full((5, 5), 5), 2, spare=1) == [(0, 1), (2, 3)]
  with pytest.raises(TopologyError, match="5 devices cannot be cut into groups of 2 leaving 2 out"):
    best_groups(np.full((5, 5), 5), 2, spare=2)
  with pytest.raises(TopologyError, match=r"group size 0: expected an int >= 1"):
    best_groups(np.full((4, 4), 5), 0)


@pytest.mark.parametrize("script, said", [
    ("echo 'NVML: driver not loaded' >&2; exit 9", r"nvidia-smi topo -m exited 9: NVML: driver not loaded"),
    ("sleep 5", r"nvidia-smi topo -m gave no answer in 0.5 s")])
def test_an_nvidia_smi_that_fails_or_hangs_is_said(tmp_path, monkeypatch, script, said):
  """It fell back to device order without a word (a table it could not read was said)."""
  from o1jax.sharding import topology
  tool = tmp_path / "nvidia-smi"
  tool.write_text(f"#!/bin/sh\n{script}\n")
  tool.chmod(0o755)
  monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
  with pytest.warns(UserWarning, match=said + r"; placing devices by their JAX attributes instead"):
    assert topology.read_nvidia_smi_topo(timeout_s=0.5) is None


@pytest.mark.parametrize("table, said", [
    ("GPU0\tGPU1\tCPU Affinity\tNUMA Affinity\nGPU0\t X \tNV4\tNV4\t0-31\t0\nGPU1\tNV4\t X \t0-31\t0\n",
     r"row GPU0 has 5 entries for 2 columns and 2 attributes"),
    ("GPU0\tGPU1\nGPU0\t X \t X \nGPU1\tNV4\t X \n", r"row GPU0 has X in column GPU1"),
    ("GPU0\tGPU1\nGPU0\t X \tNV0\nGPU1\tNV0\t X \n", r"unknown link 'NV0'")])
def test_malformed_tables_are_named_not_read_askew(table, said):
  """A row one link too long shifted its attributes (the CPU affinity read "NV4"), X off
  the diagonal read as the same chip, NV0 ranked above PCIe."""
  with pytest.raises(TopologyError, match=said):
    parse_nvidia_smi_topo(table)
