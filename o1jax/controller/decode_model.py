"""The narrow decode interface the controller runs on.

A `DecodeModel` is what the reasoning loop needs from a model, and nothing more:

  params                                   pytree passed into jit (never closed over)
  vocab_size                               int
  init_cache(batch, length, plan=None)     empty cache pytree for `batch` rows of
      -> cache                             `length` positions; plan: a `CachePlan`
                                           (what the rows will do; a paged cache sizes
                                           its block pool from it)
  forward(params, cache, tokens [B, T], starts [B], logits_at [B])
      -> (logits [B, V] f32 at token logits_at[b], cache)
                                           writes the tokens at positions starts[b]..
                                           (at least up to logits_at[b]; later ones
                                           cannot change the logits and may be dropped);
                                           attends causally (key s visible iff s <= query)
  forward_all(params, cache, tokens [B, T],   as forward, with the logits of every position
      starts [B], counts [B])                 [B, T, V] f32; writes tokens[b, :counts[b]]
      -> (logits [B, T, V], cache)            (speculative verification: the last token and
                                              the drafts after it)
  prefill_rows(params, cache, rows [R],    rows[i] keeps its first starts[i] positions,
      tokens [R, T], last [R],             drops the rest and takes the prompt tokens
      starts [R]) -> cache                 tokens[i, :last[i] + 1] at positions starts[i]..
                                           starts[i] + last[i]; the other rows are
                                           untouched; rows[i] >= B is padding (ignored).
                                           Admits requests between loop calls (starts > 0:
                                           a prompt prefix taken from another row by
                                           `copy_rows` just before)
  copy_rows(cache, dst [C], src [C])       row dst[i] becomes a copy of row src[i] (dst
      -> cache                             distinct and disjoint from src; >= B: padding)
  truncate(cache, lengths [B]) -> cache    forget positions >= lengths[b]
  check(cache) -> None                     host side, after a loop call: raises if the
                                           cache lost data (a paged pool that ran out)

`forward` serves prefill (T = prompt bucket), decode (T = 1) and scratch
probes (T = 1 + probe). With a causal cache whose key s is visible only to
queries at positions >= s, truncation is free (stale entries are rewritten
before they are visible), which is what `ContiguousLlama.truncate` relies on;
the paged cache (`paged_model.PagedLlama`) releases blocks there instead.

Implementations: `ContiguousLlama` (o1jax Llama + contiguous KVCache),
`PagedLlama` (the engine's paged KV cache: rows share the prompt's blocks) and
`o1jax.controller.testing.MockDecodeModel` (hand-computable logits).

A decode model is a static argument of the compiled programs, so it must hash. The two
Llama ones hash by what their programs read (`ProgramKeyed`) and the programs hold them
without params (`program_view`); any other (the mock) hashes as it defines (identity by
default: the jit caches keep it, and its params, for the process' life).
"""

from __future__ import annotations

import copy
import dataclasses
import weakref
from typing import Any, Mapping, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from flax import nnx

from o1jax.engine import fields
from o1jax.engine.kv_cache import KV_DTYPES
from o1jax.model.llama import KVCache, Llama, check_llama
from o1jax.sharding import tensor_parallel

CACHES = ("contiguous", "paged")
CONTIGUOUS_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class CacheConfig:
  """The `controller` config section, plus the KV dtype (the engine section's).

  cache: paged (`PagedLlama`: samples share the prompt's blocks) | contiguous
  (`ContiguousLlama`: every row holds all its positions). block_size: tokens per
  block (paged). num_blocks: the paged pool; 0 = sized from the controller's plan
  (never runs out). kv_dtype: float32 | bfloat16, or float8_e4m3fn (a scale per
  token and KV head, paged only)."""

  cache: str = "paged"
  block_size: int = 16
  num_blocks: int = 0
  kv_dtype: str = "float32"

  def __post_init__(self):
    if self.cache not in CACHES:
      raise ValueError(f"controller cache={self.cache!r}: valid caches are {list(CACHES)}")
    if int(self.block_size) < 1 or int(self.num_blocks) < 0:
      raise ValueError(f"controller cache block_size={self.block_size} must be >= 1 and "
                       f"num_blocks={self.num_blocks} >= 0 (0 = sized from the plan)")
    valid = CONTIGUOUS_DTYPES if self.cache == "contiguous" else KV_DTYPES
    if self.kv_dtype not in valid:
      raise ValueError(f"kv_dtype={self.kv_dtype!r}: the {self.cache} controller cache stores "
                       f"{sorted(valid)}" + (" (float8_e4m3fn needs cache='paged')"
                                             if self.cache == "contiguous" else ""))

  def check_holds_request(self, traces: int, key: str = "controller.num_blocks") -> None:
    """`check_pool_holds_request` for this section's pool (a paged one, fixed)."""
    if self.cache == "paged":
      check_pool_holds_request(int(self.num_blocks) or None, traces, key)

  @classmethod
  def from_dict(cls, values: Mapping[str, Any] | None) -> "CacheConfig":
    values = dict(values.to_dict() if hasattr(values, "to_dict") else values or {})
    return fields.from_dict(cls, values, "controller cache section has no keys")

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def check_pool_holds_request(num_blocks: int | None, traces: int, key: str = "num_blocks",
                             prompt_blocks: int = 1) -> None:
  """A fixed paged pool smaller than a request of `traces` traces and a prompt of
  `prompt_blocks` blocks needs, refused before it runs (it overflowed after the batch's
  work, every request's traces lost): each trace writes a block of its own (its copy of
  the prompt's last block) beside the prompt's. None: sized from the plan."""
  need = traces + prompt_blocks
  if num_blocks is not None and num_blocks < need:
    prompt = "the prompt's" if prompt_blocks == 1 else f"the prompt's {prompt_blocks}"
    raise ValueError(f"{key}={num_blocks}: a request of {traces} trace(s) needs at least "
                     f"{need} blocks (each trace writes a block of its own beside {prompt}); "
                     f"raise it, or 0 sizes the pool from the plan")


@dataclasses.dataclass(frozen=True)
class CachePlan:
  """What the controller knows about a batch before it allocates the cache.

  rows: rows sharing prompts (requests x samples, padded); prompt_tokens: the
  longest prompt; new_tokens: the most positions a row writes past its prompt
  (the loop ends a row at `max_generated` tokens, and a scratch probe reaches
  at most `probe_capacity` past the end); prompts: how many prompts the rows
  hold at once (requests in flight). A contiguous cache needs none of it."""

  rows: int
  prompt_tokens: int
  new_tokens: int
  prompts: int | None = None  # prompts held at once (requests in flight); None: the batch


class ProgramKeyed:
  """Hash and equality by what the compiled programs read of a decode model: its class and
  `PROGRAM_FIELDS` (graphdef, config, cache settings, mesh), not its params. A decode model
  is a static jit argument (the controller's loop and admission programs): keyed by
  identity, every new decode model compiled its programs again, and the jit caches kept it
  alive with its weights (~1,000 memory maps and the whole model per decode model built in
  a process). `without_params` is what those caches should hold."""

  PROGRAM_FIELDS: tuple[str, ...] = ()  # set in __init__ and never changed after
  params: Any

  def _program_key(self) -> tuple:
    return (type(self),) + tuple(getattr(self, f) for f in self.PROGRAM_FIELDS)

  def __hash__(self):
    # Hashing the graphdef takes ~1.7 ms on the embedded model, and the jit hashes its
    # static arguments on every call: computed once.
    if "_program_hash" not in self.__dict__:
      self._program_hash = hash(self._program_key())
    return self._program_hash

  def __eq__(self, other):
    return other is self or (type(other) is type(self) and hash(other) == hash(self)
                             and other._program_key() == self._program_key())

  def without_params(self) -> "ProgramKeyed":
    """A copy without the params (equal to this model): calls take them as an argument."""
    view = copy.copy(self)
    view.params = None
    return view


# One program view per distinct decode model while any is in use: the jit caches find a
# call's static arguments by identity then, not by comparing graphdefs on every call.
_VIEWS: "weakref.WeakValueDictionary[ProgramKeyed, ProgramKeyed]" = weakref.WeakValueDictionary()


def program_view(model):
  """What a static jit argument should hold of `model`: a `ProgramKeyed` model without its
  params (the one view of every equal model); any other decode model as it is (keyed as
  it defines)."""
  if not isinstance(model, ProgramKeyed):
    return model
  view = model.without_params()
  return _VIEWS.setdefault(view, view)


@runtime_checkable
class DecodeModel(Protocol):
  params: Any
  vocab_size: int

  def init_cache(self, batch: int, length: int, plan: CachePlan | None = None) -> Any:
    ...

  def forward(self, params, cache, tokens: jax.Array, starts: jax.Array, logits_at: jax.Array):
    ...

  def forward_all(self, params, cache, tokens: jax.Array, starts: jax.Array,
                  counts: jax.Array):
    ...

  def prefill_rows(self, params, cache, rows: jax.Array, tokens: jax.Array,
                   last: jax.Array, starts: jax.Array) -> Any:
    ...

  def copy_rows(self, cache, dst: jax.Array, src: jax.Array) -> Any:
    ...

  def truncate(self, cache, lengths: jax.Array) -> Any:
    ...

  def check(self, cache) -> None:
    ...


def place_on_mesh(model: Llama, mesh):
  """(mesh in Auto mode, the model's weights on it) or (None, the model)."""
  if mesh is None:
    return None, model
  mesh = tensor_parallel.auto_mesh(mesh)
  return mesh, tensor_parallel.shard_model(model, mesh)


def prefill_batch_major_rows(forward, params, cache, rows, tokens, last, starts):
  """`prefill_rows` for a cache whose every leaf is batch-major: gather the rows,
  run the prompt through them from `starts`, scatter them back (padding rows >= B are
  dropped)."""
  sub = jax.tree.map(lambda x: jnp.take(x, rows, axis=0, mode="clip"), cache)
  _, sub = forward(params, sub, tokens, starts, last)
  return jax.tree.map(lambda x, y: x.at[rows].set(y, mode="drop"), cache, sub)


def copy_batch_major_rows(cache, dst, src):
  """`copy_rows` for a cache whose every leaf is batch-major."""
  return jax.tree.map(
      lambda x: x.at[dst].set(jnp.take(x, src, axis=0, mode="clip"), mode="drop"), cache)


class ContiguousLlama(ProgramKeyed):
  """`Llama` over the contiguous `KVCache` ([B, KVH, S, D] per layer).

  The model is split once (graphdef static, `params` = its nnx.State passed
  into every jitted call). Hash and equality are by the program's fields
  (`ProgramKeyed`), so a loop object holding this model is a valid static jit
  argument, shared by equal models. mesh: a mesh with a
  "model" axis: weights and cache split by heads (o1jax/sharding/tensor_parallel.py;
  the controller runs its calls with the mesh set)."""

  PROGRAM_FIELDS = ("graphdef", "config", "cache_dtype", "mesh")

  def __init__(self, model: Llama, cache_dtype=jnp.float32, mesh=None):
    check_llama(model, "ContiguousLlama")
    self.mesh, model = place_on_mesh(model, mesh)
    self.graphdef, self.params = nnx.split(model)
    self.config = model.config
    self.vocab_size = model.config.vocab_size
    self.cache_dtype = cache_dtype

  def init_cache(self, batch: int, length: int, plan: CachePlan | None = None) -> KVCache:
    del plan  # every row holds all `length` positions
    cache = KVCache.zeros(self.config, batch, length, self.cache_dtype)
    if self.mesh is not None:
      cache = tensor_parallel.shard_contiguous(cache, self.mesh)
    return cache

  def forward(self, params, cache, tokens, starts, logits_at):
    model = nnx.merge(self.graphdef, params)
    return model(tokens.astype(jnp.int32), starts.astype(jnp.int32), cache,
                 logits_at=logits_at.astype(jnp.int32))

  def forward_all(self, params, cache, tokens, starts, counts):
    del counts  # a contiguous row holds every position: all T are written
    model = nnx.merge(self.graphdef, params)
    return model(tokens.astype(jnp.int32), starts.astype(jnp.int32), cache)

  def prefill_rows(self, params, cache, rows, tokens, last, starts):
    # Positions past the new prompt keep stale K/V: rewritten before they are visible.
    return prefill_batch_major_rows(self.forward, params, cache, rows, tokens, last, starts)

  def copy_rows(self, cache, dst, src):
    return copy_batch_major_rows(cache, dst, src)

  def truncate(self, cache, lengths):
    del lengths  # causal visibility by position makes stale entries harmless
    return cache

  def check(self, cache):
    del cache  # a contiguous cache cannot run out
