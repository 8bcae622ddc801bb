"""Topology-aware placement: a `jax.sharding.Mesh` (axes `data`, `model`) whose model-axis
groups, the tensor-parallel groups, sit on the best links between devices.

  mesh = make_mesh(model=4)                          # every device; data = count // 4
  mesh = make_mesh(model=2, topology=parse_nvidia_smi_topo(open("topo.txt").read()))
  groups = tp_groups(jax.devices(), model=4)         # the rows of that mesh

Steps: 1. a link level for every pair of devices (higher is better):
   - NVIDIA GPUs: `nvidia-smi topo -m` (NV# bonded NVLinks > PIX > PXB > PHB > NODE > SYS),
     read once per call when the devices are GPUs and the tool is there;
   - otherwise JAX's device attributes: two cores of one chip (`core_on_chip`, `coords`) >
     one process > one slice (`slice_index`) > elsewhere;
   - TPUs with `coords` go to `jax.experimental.mesh_utils`, which knows their torus;
2. the devices of each process are cut into groups of `model` that maximize, in order: the
   weakest link inside the weakest group (a tensor-parallel all-reduce runs at the speed of
   its slowest link), the sum of each group's weakest link, the sum of all links inside
   groups (exact search, up to 16 devices a process; more: device order);
3. groups become the mesh's rows: `data` index = group, `model` index = place in the group.
   A model axis larger than one process takes whole processes, in (slice, process) order.
Every process must call it with the same arguments (JAX needs the same mesh everywhere);
other hosts are assumed wired like this one, whose `nvidia-smi` is the only one it can read.

GPU numbering: nvidia-smi numbers GPUs in PCI bus order; a JAX GPU's `local_hardware_id` is
its CUDA ordinal, which is the same order under CUDA_DEVICE_ORDER=PCI_BUS_ID (and on
machines of identical GPUs, where CUDA's fastest-first order falls back to bus order). With
CUDA_VISIBLE_DEVICES=4,5,6,7, ordinal k is nvidia-smi's GPU of the k-th entry.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
import shutil
import subprocess
import warnings
from typing import Any, Optional, Sequence

import numpy as np

AXES = ("data", "model")
MAX_EXACT = 16  # devices per process searched exactly (C(15,7) = 6435 first groups at most)

# Link levels: higher is better. NV# adds its bonded link count to NVLINK.
ELSEWHERE, OTHER_PROCESS, SAME_PROCESS = 0, 1, 2
PCIE_LEVELS = {"SYS": 3, "SOC": 3, "NODE": 4, "PHB": 5, "PXB": 6, "PSB": 6, "PIX": 7}
NVLINK = 10
SAME_CHIP = 100
_LINK_NAMES = "X, NV#, PIX, PXB, PHB, NODE or SYS"


class TopologyError(ValueError):
  """Bad topology text, or a mesh shape the devices cannot take."""


class VisibleDevicesError(TopologyError):
  """CUDA_VISIBLE_DEVICES cannot be matched to nvidia-smi's table (UUIDs, MIG names, -1):
  placement then falls back to the devices' JAX attributes (`make_mesh`)."""


# -- nvidia-smi topo -m -----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class GpuTopology:
  """`nvidia-smi topo -m`, the GPU part: links between GPUs and each GPU's CPU/NUMA affinity.

  links[i][j] is the table's entry ("X", "NV18", "PIX", "SYS", ...); NIC rows and columns
  are read but not kept (they do not carry tensor-parallel traffic).
  """
  gpus: tuple[str, ...]  # "GPU0", ... in nvidia-smi's (PCI bus) order
  links: tuple[tuple[str, ...], ...]
  cpu_affinity: tuple[str, ...]  # per GPU: cores to pin its host process to, e.g. "0-55,112-167"
  numa_affinity: tuple[str, ...]  # per GPU: NUMA node, e.g. "0" (or "N/A")

  def level(self, i: int, j: int) -> int:
    """Link level between GPUs i and j (the weaker direction, should the table disagree)."""
    return min(_link_level(self.links[i][j]), _link_level(self.links[j][i]))

  def levels(self) -> np.ndarray:
    n = len(self.gpus)
    return np.array([[SAME_CHIP if i == j else self.level(i, j) for j in range(n)] for i in range(n)])


_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # nvidia-smi underlines the header
_DEVICE = re.compile(r"^[\w.:-]+$")  # GPU0, NIC0, and older drivers' RDMA names: mlx5_bond_0, hfi1_0
_ATTRIBUTES = ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID")


def _link_level(token: str) -> int:
  if token == "X":
    return SAME_CHIP
  if re.fullmatch(r"NV[1-9]\d*", token):  # (NV0 is no link: it ranked above PIX)
    # below the same chip however many links (NV90 ranked as one chip; NV10**20 overflowed)
    return min(NVLINK + int(token[2:]), SAME_CHIP - 1)
  if token in PCIE_LEVELS:
    return PCIE_LEVELS[token]
  raise TopologyError(f"nvidia-smi topo -m: unknown link {token!r} (expected {_LINK_NAMES})")


def parse_nvidia_smi_topo(text: str) -> GpuTopology:
  """The matrix printed by `nvidia-smi topo -m` (tab- or space-separated, with or without
  the header's escape codes) → GpuTopology. Raises TopologyError naming the bad line."""
  lines = [_ANSI.sub("", line).rstrip() for line in text.splitlines()]
  header_at = next((i for i, line in enumerate(lines) if line.split()[:1] == ["GPU0"]), None)
  if header_at is None:
    raise TopologyError("nvidia-smi topo -m: no header line starting with GPU0")
  header = lines[header_at]
  attributes = sorted((a for a in _ATTRIBUTES if a in header), key=header.index)
  # The device columns: every name before the attribute columns (a NIC column may carry an
  # older driver's RDMA device name, `mlx5_bond_0`, `hfi1_0`, `bnxt_re0`: a table with one
  # was refused, and placement fell back to device order).
  columns = []
  for token in header[:header.index(attributes[0]) if attributes else None].split():
    if not _DEVICE.match(token):
      break
    columns.append(token)
  rows: dict[str, list[str]] = {}
  for line in lines[header_at + 1:]:
    cells = line.split()
    if not cells or cells[0].rstrip(":") in ("Legend", "NIC"):
      break
    if cells[0] not in columns:
      raise TopologyError(f"nvidia-smi topo -m: row {cells[0]!r} is not a column of the header")
    if cells[0] in rows:  # (the last one won)
      raise TopologyError(f"nvidia-smi topo -m: row {cells[0]} appears twice")
    rows[cells[0]] = cells[1:]
  gpus = tuple(c for c in columns if re.fullmatch(r"GPU\d+", c))
  if not gpus:
    raise TopologyError("nvidia-smi topo -m: the header names no GPU")
  if gpus != tuple(f"GPU{i}" for i in range(len(gpus))):  # GPUs are found by their number
    raise TopologyError(f"nvidia-smi topo -m: the header's GPUs are {', '.join(gpus)}; "
                        f"nvidia-smi lists GPU0..GPU{len(gpus) - 1} in order")
  links, cpu, numa = [], [], []
  for gpu in gpus:
    cells = rows.get(gpu)
    if cells is None:
      raise TopologyError(f"nvidia-smi topo -m: no row for {gpu}")
    if len(cells) < len(columns):
      raise TopologyError(f"nvidia-smi topo -m: row {gpu} has {len(cells)} entries for "
                          f"{len(columns)} columns")
    if len(cells) > len(columns) + len(attributes):  # (one more link shifted every
      # attribute: the CPU affinity read "NV4")
      raise TopologyError(f"nvidia-smi topo -m: row {gpu} has {len(cells)} entries for "
                          f"{len(columns)} columns and {len(attributes)} attributes")
    row = tuple(cells[columns.index(g)] for g in gpus)
    for token in row:
      _link_level(token)  # unknown entries fail here, naming the entry
    if row[gpus.index(gpu)] != "X":
      raise TopologyError(f"nvidia-smi topo -m: row {gpu} does not have X on the diagonal")
    elsewhere = [g for g, token in zip(gpus, row) if token == "X" and g != gpu]
    if elsewhere:  # (read as the same chip)
      raise TopologyError(f"nvidia-smi topo -m: row {gpu} has X in column {elsewhere[0]}: X "
                          f"is the diagonal only")
    extra = dict(zip(attributes, cells[len(columns):]))
    links.append(row)
    cpu.append(extra.get("CPU Affinity", "N/A"))
    numa.append(extra.get("NUMA Affinity", "N/A"))
  return GpuTopology(gpus, tuple(links), tuple(cpu), tuple(numa))


def read_nvidia_smi_topo(timeout_s: float = 10.0) -> Optional[GpuTopology]:
  """This machine's GPU topology, or None where nvidia-smi is absent or fails."""
  exe = shutil.which("nvidia-smi")
  if exe is None:
    return None
  # (a failing or hanging tool fell back without a word, as a table it cannot read did not)
  fallback = "placing devices by their JAX attributes instead"
  try:
    out = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=timeout_s)
  except subprocess.TimeoutExpired:
    warnings.warn(f"nvidia-smi topo -m gave no answer in {timeout_s:g} s; {fallback}")
    return None
  except OSError as e:
    warnings.warn(f"nvidia-smi topo -m could not run ({e.strerror or e}); {fallback}")
    return None
  if out.returncode != 0:
    said = (out.stderr or out.stdout or "").strip().splitlines()
    warnings.warn(f"nvidia-smi topo -m exited {out.returncode}"
                  f"{': ' + said[-1][:200] if said else ''}; {fallback}")
    return None
  try:
    return parse_nvidia_smi_topo(out.stdout)
  except TopologyError as e:  # placement falls back to device attributes, and says why
    warnings.warn(f"{e}; placing devices by their JAX attributes instead")
    return None


# -- link levels between JAX devices ---------------------------------------------------

def _attr(device, name: str, default=None):
  value = getattr(device, name, default)
  return default if value is None else value


def _gpu_index(device, visible: Optional[str], rank: int) -> int:
  """nvidia-smi's index of a JAX GPU (see the module docstring). Another host's device has
  no local_hardware_id here: its rank among its process's devices stands in (hosts alike)."""
  ordinal = _attr(device, "local_hardware_id", rank)
  if visible:
    entries = [v.strip() for v in visible.split(",") if v.strip()]
    if not all(e.isdigit() for e in entries):
      raise VisibleDevicesError(f"CUDA_VISIBLE_DEVICES={visible!r}: only GPU indices can be "
                                f"matched to nvidia-smi's table (not UUIDs, MIG names or -1)")
    if ordinal >= len(entries):
      raise TopologyError(f"device {device.id}: CUDA ordinal {ordinal} is not in "
                          f"CUDA_VISIBLE_DEVICES={visible!r}")
    return int(entries[ordinal])
  return int(ordinal)


def link_levels(devices: Sequence[Any], topology: Optional[GpuTopology] = None,
                cuda_visible_devices: Optional[str] = None) -> np.ndarray:
  """[n, n] link levels between `devices` (see the module docstring). With a GpuTopology,
  two devices of one process take its entry for their GPUs; all hosts are read as this one."""
  n = len(devices)
  gpu = None
  if topology is not None:
    by_process: dict[int, list[int]] = {}
    for d in sorted(devices, key=lambda d: d.id):
      by_process.setdefault(d.process_index, []).append(d.id)
    rank = {i: k for ids in by_process.values() for k, i in enumerate(ids)}
    gpu = [_gpu_index(d, cuda_visible_devices, rank[d.id]) for d in devices]
    for d, g in zip(devices, gpu):
      if g >= len(topology.gpus):
        raise TopologyError(f"device {d.id} is GPU{g}, but the topology lists "
                            f"{len(topology.gpus)} GPUs ({', '.join(topology.gpus)})")
  out = np.zeros((n, n), dtype=np.int64)
  for i, j in itertools.product(range(n), range(n)):
    a, b = devices[i], devices[j]
    if i == j:
      out[i, j] = SAME_CHIP
    elif _attr(a, "slice_index", 0) != _attr(b, "slice_index", 0):
      out[i, j] = ELSEWHERE
    elif a.process_index != b.process_index:
      out[i, j] = OTHER_PROCESS
    elif gpu is not None:
      out[i, j] = SAME_CHIP if gpu[i] == gpu[j] else topology.level(gpu[i], gpu[j])
    elif _attr(a, "coords") is not None and tuple(a.coords) == tuple(_attr(b, "coords", ())):
      out[i, j] = SAME_CHIP  # two cores of one chip (TPU megacore)
    else:
      out[i, j] = SAME_PROCESS
  return out


# -- grouping ----------------------------------------------------------------------------

def best_groups(levels: np.ndarray, size: int, spare: int = 0) -> list[tuple[int, ...]]:
  """Partition range(n) into groups of `size` (see step 2 of the module docstring),
  leaving `spare` devices out (the groups chosen from all of them: tp=3 on two NVLink
  islands of 4 takes 3 of each, where cutting the list to 6 first put a group over SYS);
  ties keep index order. Exact for n <= MAX_EXACT."""
  n = len(levels)
  if not isinstance(size, (int, np.integer)) or size < 1:
    raise TopologyError(f"group size {size!r}: expected an int >= 1")
  if not 0 <= spare < size or (n - spare) % size:
    raise TopologyError(f"{n} devices cannot be cut into groups of {size}"
                        + (f" leaving {spare} out" if spare else ""))
  if size == 1:
    return [(i,) for i in range(n - spare)]
  if n > MAX_EXACT:
    return [tuple(range(s, s + size)) for s in range(0, n - spare, size)]
  cache: dict[tuple[int, int, int], Optional[tuple]] = {}

  def group_score(group):
    pairs = [int(levels[a, b]) for a, b in itertools.combinations(group, 2)]
    return min(pairs), sum(pairs)

  def best(mask: int, floor: int, left_out: int):
    # The best (sum of weakest links, sum of links, groups) over the devices in `mask`,
    # `left_out` of them in no group, using only groups whose weakest link is >= floor;
    # None if there is none.
    if mask == 0:
      return (0, 0, ()) if left_out == 0 else None
    if (mask, floor, left_out) in cache:
      return cache[(mask, floor, left_out)]
    members = [i for i in range(n) if mask >> i & 1]
    first, rest = members[0], members[1:]
    found = None
    for others in itertools.combinations(rest, size - 1):
      group = (first, *others)
      weakest, total = group_score(group)
      if weakest < floor:
        continue
      sub = best(mask & ~sum(1 << i for i in group), floor, left_out)
      if sub is None:
        continue
      candidate = (weakest + sub[0], total + sub[1], (group, *sub[2]))
      if found is None or candidate[:2] > found[:2]:
        found = candidate
    if left_out:  # `first` in no group (only if strictly better: ties keep index order)
      skip = best(mask & ~(1 << first), floor, left_out - 1)
      if skip is not None and (found is None or skip[:2] > found[:2]):
        found = skip
    cache[(mask, floor, left_out)] = found
    return found

  full = (1 << n) - 1
  for floor in sorted({int(v) for v in levels.flat}, reverse=True):
    result = best(full, floor, spare)
    if result is not None:
      return list(result[2])
  raise AssertionError("unreachable: the lowest floor admits every partition")


def _by_process(devices: Sequence[Any]) -> list[list[Any]]:
  keyed: dict[tuple, list] = {}
  for d in devices:
    keyed.setdefault((_attr(d, "slice_index", 0), d.process_index), []).append(d)
  return [keyed[k] for k in sorted(keyed)]


def _check_shape(n: int, model: int, data: Optional[int], spare: bool = False) -> int:
  """The mesh's rows (`data`) for n devices; `spare`: the n % model left over are left out."""
  for name, value in (("model", model), ("data", data)):
    if (value is not None or name == "model") and (
        isinstance(value, bool) or not isinstance(value, (int, np.integer))):
      raise TopologyError(f"{name}={value!r}: expected an int (devices)")
  if model < 1:
    raise TopologyError(f"model={model}: the model axis needs at least 1 device")
  if model > n:
    raise TopologyError(f"model={model} needs {model} devices; there are {n}")
  if spare:
    n -= n % model
  if n % model:
    divisors = [k for k in range(1, n + 1) if n % k == 0]
    raise TopologyError(f"model={model} does not divide the {n} devices (model can be one of {divisors})")
  if data is not None and data * model != n:
    raise TopologyError(f"data={data} x model={model} = {data * model} devices, but there are {n} "
                        f"(pass devices= to use fewer)")
  return n // model


def tp_groups(devices: Sequence[Any], model: int, topology: Optional[GpuTopology] = None,
              cuda_visible_devices: Optional[str] = None, spare: bool = False) -> list[list[Any]]:
  """`devices` cut into tensor-parallel groups of `model` on the best links (the mesh's
  rows); `spare`: the groups fit in one process, chosen from all its devices, the ones
  that make no whole group left out."""
  devices = list(devices)
  processes = _by_process(devices)
  if spare and len(processes) == 1 and model <= len(devices):
    _check_shape(len(devices), model, None, spare=True)
    levels = link_levels(devices, topology, cuda_visible_devices)
    return [[devices[i] for i in g] for g in best_groups(levels, model, len(devices) % model)]
  _check_shape(len(devices), model, None)
  sizes = {len(p) for p in processes}
  if len(sizes) != 1:
    raise TopologyError(f"processes hold different device counts {sorted(sizes)}: cannot build one mesh")
  per_process = sizes.pop()
  if model <= per_process:
    if per_process % model:
      raise TopologyError(f"model={model} does not divide the {per_process} devices of each process "
                          f"(a tensor-parallel group stays inside a process, or takes whole ones)")
    groups = []
    for local in processes:
      levels = link_levels(local, topology, cuda_visible_devices)
      groups += [[local[i] for i in g] for g in best_groups(levels, model)]
    return groups
  if model % per_process:
    raise TopologyError(f"model={model} spans processes of {per_process} devices: it must be a "
                        f"multiple of {per_process} (or divide it)")
  span = model // per_process
  return [[d for p in processes[s:s + span] for d in p] for s in range(0, len(processes), span)]


def repeated_device(devices: Sequence[Any]) -> Optional[Any]:
  """The first device `devices` lists a second time, or None."""
  seen = set()
  for d in devices:
    if d in seen:
      return d
    seen.add(d)
  return None


def make_mesh(model: int = 1, data: Optional[int] = None, devices: Optional[Sequence[Any]] = None,
              topology: Any = "auto", cuda_visible_devices: Optional[str] = None,
              spare: bool = False):
  """A `jax.sharding.Mesh` of shape (data, model), axes ("data", "model"), placed by topology.

  Args:
    model: devices per tensor-parallel group.
    data: groups (default: all devices // model); data * model must be the device count.
    devices: default `jax.devices()`.
    topology: "auto" (GPUs: read `nvidia-smi topo -m` when present), a GpuTopology (e.g. a
      recorded one), or None (JAX device attributes only).
    cuda_visible_devices: default the environment's CUDA_VISIBLE_DEVICES (GPU topology only).
    spare: devices // model groups chosen from all the devices of one process, the rest
      left out (tp=3 on 8 GPUs), where model need not divide the device count.
  Raises TopologyError (a ValueError) with a one-line message for a shape that cannot be built.
  """
  import jax
  from jax.sharding import Mesh
  devices = list(jax.devices() if devices is None else devices)
  if (twice := repeated_device(devices)) is not None:  # (JAX: a bare AssertionError)
    raise TopologyError(f"devices lists {twice} twice: each shard needs a device of its own")
  rows = _check_shape(len(devices), model, data, spare)
  if isinstance(topology, str):
    if topology != "auto":
      raise TopologyError(f"topology={topology!r}: expected 'auto', a GpuTopology or None")
    topology = read_nvidia_smi_topo() if devices[0].platform == "gpu" else None
    if topology is None and devices[0].platform == "tpu" and _attr(devices[0], "coords") is not None:
      from jax.experimental import mesh_utils  # knows the TPU torus
      return Mesh(mesh_utils.create_device_mesh((rows, model), devices), AXES)
  if cuda_visible_devices is None:
    cuda_visible_devices = os.environ.get("CUDA_VISIBLE_DEVICES") if topology is not None else None
  try:
    groups = tp_groups(devices, model, topology if model > 1 else None, cuda_visible_devices,
                       spare)
  except VisibleDevicesError as e:  # (was: no mesh at all on nodes that hand out GPU UUIDs)
    warnings.warn(f"{e}; placing devices by their JAX attributes instead")
    groups = tp_groups(devices, model, None, None, spare)
  return Mesh(np.array(groups, dtype=object).reshape(rows, model), AXES)


def describe(groups: Sequence[Sequence[Any]], topology: Optional[GpuTopology] = None,
             cuda_visible_devices: Optional[str] = None) -> str:
  """One line per group: its devices and its weakest link (for logs and the docs);
  cuda_visible_devices as `make_mesh` takes it (default: the environment's)."""
  if topology is not None and cuda_visible_devices is None:
    cuda_visible_devices = os.environ.get("CUDA_VISIBLE_DEVICES")
  lines = []
  for row, group in enumerate(groups):
    levels = link_levels(group, topology, cuda_visible_devices if topology else None)
    weakest = min((int(levels[a, b]) for a, b in itertools.combinations(range(len(group)), 2)),
                  default=SAME_CHIP)
    lines.append(f"data={row}: devices {[d.id for d in group]}, weakest link {_level_name(weakest)}")
  return "\n".join(lines)


def _level_name(level: int) -> str:
  if level >= SAME_CHIP:
    return "same chip"
  if level > NVLINK:
    return f"NV{level - NVLINK}"
  names = {v: k for k, v in PCIE_LEVELS.items() if k not in ("SOC", "PSB")}
  others = {ELSEWHERE: "another slice", OTHER_PROCESS: "another process", SAME_PROCESS: "same process"}
  return names.get(level, others.get(level, "?"))
