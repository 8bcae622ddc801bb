"""Device placement: meshes built from the machine's topology (o1jax/sharding/topology.py).

A leaf package: it imports JAX and NumPy only, so model, engine and controller can use it.
"""

from o1jax.sharding.topology import (AXES, GpuTopology, TopologyError, best_groups, describe,
                                     link_levels, make_mesh, parse_nvidia_smi_topo,
                                     read_nvidia_smi_topo, tp_groups)

__all__ = [
    "AXES", "GpuTopology", "TopologyError", "best_groups", "describe", "link_levels", "make_mesh",
    "parse_nvidia_smi_topo", "read_nvidia_smi_topo", "tp_groups",
]
