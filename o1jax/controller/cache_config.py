"""The controller's KV cache, chosen by config: `build_decode_model`.

  ctl = Controller(build_decode_model(llama, {"cache": "paged", "kv_dtype": "bfloat16"}),
                   tokenizer)

The values a run uses live in `configs/` (the `controller` section, and the
engine section's `kv_dtype`, which the controller shares); `CacheConfig`
(decode_model.py) holds the checks, made once when the config is read.
"""

from __future__ import annotations

from typing import Any, Mapping

from o1jax.controller.decode_model import CONTIGUOUS_DTYPES, CacheConfig, ContiguousLlama
from o1jax.controller.paged_model import PagedLlama


def build_decode_model(model, section: Mapping[str, Any] | CacheConfig | None = None, *,
                       mesh=None):
  """The DecodeModel for a `Llama` as a cache section says (None: the defaults):
  contiguous -> ContiguousLlama; paged -> PagedLlama(block_size, num_blocks or None).
  mesh: split the weights and the cache over its "model" axis (tensor parallelism)."""
  config = section if isinstance(section, CacheConfig) else CacheConfig.from_dict(section)
  if config.cache == "paged":
    return PagedLlama(model, block_size=config.block_size, num_blocks=config.num_blocks or None,
                      kv_dtype=config.kv_dtype, mesh=mesh)
  return ContiguousLlama(model, cache_dtype=CONTIGUOUS_DTYPES[config.kv_dtype], mesh=mesh)
