"""Device placement: meshes built from the machine's topology (topology.py), and a
model's weights and KV pools split over a mesh's `model` axis (tensor_parallel.py).

A leaf package (JAX, NumPy, Flax's NNX split/merge), so the engine can use it.
"""

from o1jax.sharding.topology import (AXES, GpuTopology, TopologyError, best_groups, describe,
                                     link_levels, make_mesh, parse_nvidia_smi_topo,
                                     read_nvidia_smi_topo, tp_groups)
from o1jax.sharding.tensor_parallel import (DecodeCollectives, ShardingError, group_mesh,
                                            shard_model, shard_pools, tensor_parallel_size)

__all__ = [
    "AXES", "GpuTopology", "TopologyError", "best_groups", "describe", "link_levels", "make_mesh",
    "parse_nvidia_smi_topo", "read_nvidia_smi_topo", "tp_groups", "DecodeCollectives",
    "ShardingError", "group_mesh",
    "shard_model", "shard_pools", "tensor_parallel_size",
]
