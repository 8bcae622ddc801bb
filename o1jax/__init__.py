"""o1jax: a JAX/Flax + Pallas engine for test-time-compute research."""

from o1jax.xla_flags import batch_invariant_cpu_flags

# Before any JAX computation: XLA:CPU programs whose rows do not depend on their batch.
batch_invariant_cpu_flags()
