"""Continuous-batching engine over the paged KV cache.

One engine iteration (`Engine.step`):
  1. admit waiting sequences into free decode slots (policy order), reusing
     cached prefix blocks so shared prompt text is not recomputed;
  2. run at most one prefill call: a chunk of up to `prefill_chunk` prompt
     tokens spread over up to `max_prefill_seqs` sequences (so a long prompt
     never stalls decoding for more than one chunk; rows are padded to the
     longest, so a call of several rows computes no more positions than one);
  3. prompts that finished prefilling fork into their n samples (shared blocks);
  4. run the decode loop for every decoding sequence, one device call of up to
     `decode_steps` steps: each step writes a row's last token's K/V and samples
     the next one (the first generated token too); eos, stop ids, the budget and
     the context stop a row on the device (blocks for the whole call are
     reserved before it);
  5. append tokens, check eos / stop ids / stop strings / budget (a stop string
     drops what the row sampled past it), free finished sequences' blocks and
     slots at once.
The host is visited once per call, not once per token. A call runs a single
step while a prompt is prefilling or a waiting request could take a free slot
(so prefill chunks interleave with decoding as before), and while requests wait
for a slot it stops at the first row's budget (so no slot idles).
When a sequence needs a block and none is free, the lowest-priority sequence
(latest arrival) is preempted: its blocks are freed and it is recomputed later
from its tokens. Prefill covers prompt[:-1]; the last prompt token is the first
decode input, so every token, first included, is sampled by the same step.

Shapes are bucketed (decode batch, block-table width, prefill batch and chunk
length) so a long run compiles a small fixed set of programs; a prefill or decode call
whose bucket is not compiled yet runs padded in a bigger compiled one until compiling its
own pays off (engine/shape_plan.py: short jobs compile fewer programs). Each trace is
logged and counted in `Engine.trace_counts`.
"""

from __future__ import annotations

import collections
import collections.abc
import contextvars
import dataclasses
import functools
import logging
import math
import os
import threading
import time
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from pallas_kernels import ops as kernel_ops

from o1jax.checkpoint import load_checkpoint
from o1jax.checkpoint.tokenizer import LONE_SURROGATE, continuation_text
from o1jax import compilation_cache
from o1jax.compilation_cache import release_programs_near_map_limit
from o1jax.engine import fields
from o1jax.engine import steps
from o1jax.engine.allocator import BlockAllocator, OutOfBlocks
from o1jax.engine.budget import BudgetLoop, token_limit
from o1jax.engine.kv_cache import KV_DTYPES, PagedKVCache, copy_blocks
from o1jax.engine.metrics import MetricsCollector, RequestMetrics
from o1jax.engine.shape_plan import ShapePlan, decode_fits
from o1jax.engine.speculative import (Acceptance, SpeculationPlanner, SpeculativeConfig,
                                      check_draft_vocabulary, prompt_lookup)
from o1jax.model import thinking as thinking_lib
from o1jax.model.generation import encode_prompt
from o1jax.model.llama import Llama, check_llama
from o1jax.model.sampling import (KEY_ID_RANGE, SamplingParams, check_int, check_key_id,
                                  is_int, key_id_words, sequence_key)
from o1jax.model.shapes import pow2_bucket, three_quarter_bucket
from o1jax.model.thinking import SpanReader, ThinkingSpan
from o1jax.sharding import tensor_parallel

log = logging.getLogger(__name__)


class _BoundStep:
  """step_fn(graphdef, state, *args) as fn(state_leaves, *args). Equal (and hashed) by
  the step, the graphdef and the state's tree structure, all its programs read: the
  params are the calls' argument. (Binding them here rather than passing them per call
  saves ~3 ms of host time per decode step: hashing a static graphdef, flattening the
  NNX state.)"""

  def __init__(self, step_fn, graphdef, state_def):
    functools.update_wrapper(self, step_fn)  # its name in logs; __wrapped__: the step
    self.graphdef, self.state_def = graphdef, state_def

  def __call__(self, state_leaves, *args):
    return self.__wrapped__(self.graphdef, jax.tree.unflatten(self.state_def, state_leaves),
                            *args)

  def _key(self):
    return self.__wrapped__, self.graphdef, self.state_def

  def __eq__(self, other):
    return type(other) is _BoundStep and self._key() == other._key()

  def __hash__(self):
    return hash(self._key())


class _Counted:
  """fn, counting each trace in the calling engine's `trace_counts` and logging it."""

  def __init__(self, name: str, fn):
    functools.update_wrapper(self, fn)
    self.name = name

  def __call__(self, *args):
    counts = _TRACE_COUNTS.get()
    if counts is not None:
      counts[self.name] += 1
    shapes = [tuple(x.shape) for x in jax.tree.leaves(args[1:]) if hasattr(x, "shape")][-12:]
    log.info("engine: compiling %s for shapes %s", self.name, shapes)
    return self.__wrapped__(*args)


# Every engine's jitted calls, keyed by what they compile (`Engine._jit`), and the calling
# engine's trace counter while one of them runs.
_PROGRAMS: dict[tuple, Any] = {}
_TRACE_COUNTS: contextvars.ContextVar[collections.Counter | None] = contextvars.ContextVar(
    "engine_trace_counts", default=None)

POLICIES = ("fifo", "shortest_budget", "length_groups")
# A prefill call's fixed cost in positions computed, for packing its rows (see
# `_prefill_rows`): ~90 with bf16 matmuls on a 2-core CPU (a 1 x 48 call took 65 ms,
# an 8 x 48 one 220 ms); more on a GPU, where a small call is mostly launch overhead.
PREFILL_CALL_OVERHEAD = 64


# --- configuration, requests, results -------------------------------------------------


def _device_memory(device) -> tuple[int, bool]:
  """(bytes, reported): an accelerator's memory limit (True), or the host's RAM where
  the device reports none (a CPU; False)."""
  try:
    stats = device.memory_stats() or {}
  except Exception:  # a backend without memory stats
    stats = {}
  if stats.get("bytes_limit"):
    return int(stats["bytes_limit"]), True
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), False


def device_memory_bytes(device) -> int:
  """All the memory `device` has (see `_device_memory`): what no buffer can exceed."""
  return _device_memory(device)[0]


def pool_memory_limit(device) -> int:
  """Bytes a KV pool may take on `device`: half an accelerator's memory, or a quarter of
  the host's RAM where the device reports no limit (a CPU)."""
  total, reported = _device_memory(device)
  return total // 2 if reported else total // 4


def check_fits_device(nbytes: int, what: str, lower: str, device=None) -> None:
  """ValueError naming `what` and the settings to `lower` when `nbytes` exceed all the
  memory of `device` (default: the first): checked before allocating, so a size typo is one
  line here rather than an out-of-memory error from inside XLA (or a swapping host)."""
  have = device_memory_bytes(device or jax.devices()[0])
  if nbytes > have:
    raise ValueError(f"{what} needs {nbytes / 2**30:,.1f} GiB but the device has "
                     f"{have / 2**30:,.1f} GiB: lower {lower}")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Static engine settings (memory, batching, shapes, policy)."""

  max_slots: int = 32  # decode slots = largest decode batch
  block_size: int = 16
  num_blocks: int | None = None  # KV pool size in blocks; or derive from kv_cache_bytes
  kv_cache_bytes: int | None = None  # used when num_blocks is None (default 256 MiB)
  kv_dtype: str = "float32"  # or "float8_e4m3fn" (a scale per token and KV head)
  max_context: int | None = None  # default: the model's max_context
  prefill_chunk: int = 128  # prompt tokens per prefill call (all rows together)
  max_prefill_seqs: int = 4  # rows of a prefill call
  min_chunk_bucket: int = 16
  min_table_blocks: int = 8  # smallest table width bucket (then powers of two; decode also 3/4)
  # Decode batch sizes that get a program; a batch runs in the smallest one that fits.
  decode_buckets: tuple[int, ...] = (1, 8, 32, 64, 128, 256)
  # Decode steps per device call (see the module doc); 1 = a host round trip per token.
  decode_steps: int = 8
  # Admission order. shortest_budget = priority by remaining steps: the waiting request
  # with the fewest tokens left to its limit gets a slot first, and under memory pressure
  # the running one with the most left is preempted first.
  policy: str = "fifo"  # "fifo" | "shortest_budget" | "length_groups"
  prefix_caching: bool = True
  max_top_logprobs: int = 20
  # Devices one model is split over by heads (tensor parallelism); 1 = one device. The
  # group is placed by the devices' topology (o1jax.sharding.make_mesh); Engine(mesh=)
  # takes a mesh of your own instead.
  tensor_parallel: int = 1
  data_parallel: int = 1  # engine replicas in one process (engine/replicas.py), one per group
  # The pool holds at least max_slots x this many tokens (pipelines pass their job's longest
  # prompt + max_new_tokens), up to half the device's memory; None: kv_cache_bytes alone.
  # A fixed num_blocks is kept as it is.
  min_tokens_per_slot: int | None = None
  # A prefill or decode call whose shape is not compiled yet may run padded in a bigger one
  # until compiling its own pays off (engine/shape_plan.py); the same tokens either way.
  reuse_compiled_shapes: bool = True

  def __post_init__(self):
    if self.policy not in POLICIES:
      raise ValueError(f"policy={self.policy!r} not in {POLICIES}")
    if self.kv_dtype not in KV_DTYPES:
      raise ValueError(f"kv_dtype={self.kv_dtype!r} not in {sorted(KV_DTYPES)}")
    # Sizes are ints: a float reaches numpy shapes mid-step, after blocks were taken.
    for name in ("max_slots", "block_size", "prefill_chunk", "max_prefill_seqs", "decode_steps",
                 "tensor_parallel", "data_parallel", "min_chunk_bucket", "min_table_blocks",
                 "max_top_logprobs"):
      check_int(getattr(self, name), name, 0 if name == "max_top_logprobs" else 1)
    if not isinstance(self.reuse_compiled_shapes, (bool, np.bool_)):
      raise ValueError(f"reuse_compiled_shapes must be True or False, got "
                       f"{self.reuse_compiled_shapes!r}")
    # None takes the default; 0 must not (it read as "unset" and silently did).
    for name in ("num_blocks", "kv_cache_bytes", "max_context", "min_tokens_per_slot"):
      value = getattr(self, name)
      if value is not None and (not is_int(value) or value < 1):
        raise ValueError(f"{name} must be an int >= 1 or None (the default), got {value!r}")
    buckets = self.decode_buckets
    if (isinstance(buckets, (str, bytes)) or not isinstance(buckets, collections.abc.Iterable)
        or not all(is_int(b) and b >= 1 for b in buckets)):
      raise ValueError(f"decode_buckets={buckets!r} must be batch sizes (ints >= 1)")
    object.__setattr__(self, "decode_buckets", tuple(int(b) for b in buckets))  # hashable
    if not isinstance(self.prefix_caching, (bool, np.bool_)):
      raise ValueError(f"prefix_caching={self.prefix_caching!r} must be a bool")


MAX_STOP_CHARS = 4096  # a stop string's length (the stream scans its prefixes per token)


def _stop_prefix_at_end(text: str, stop: str) -> int:
  """The longest k < len(stop) with text ending in stop[:k] (0 if none): what the stream
  holds back, since the next token may complete the stop string. Only k whose last
  character is text's are compared (C-speed `find`), not every prefix."""
  if not text:
    return 0
  last, k = text[-1], min(len(stop) - 1, len(text))
  while k > 0:
    k = stop.rfind(last, 0, k) + 1  # the longest prefix ending in `last`, at most k long
    if k and text.endswith(stop[:k]):
      return k
    k -= 1
  return 0


@dataclasses.dataclass(frozen=True)
class GenerationParams(SamplingParams):
  """Sampling (temperature, top_k, top_p, min_p, seed: `SamplingParams`, checked there) and
  stopping for one request (all n samples)."""

  max_new_tokens: int = 256
  # Stop strings, matched in the text (special tokens skipped) or as a special token's whole
  # spelling: the sample ends with the token that completes one (kept in token_ids); the
  # text ends before the first one's first occurrence (thinking.hits_stop).
  stop: tuple[str, ...] = ()
  stop_token_ids: tuple[int, ...] = ()  # extra stop ids (not included)
  ignore_eos: bool = False
  n: int = 1  # samples of the prompt (prefilled once, blocks shared)
  # Per-token log p of the sampled tokens under the model's distribution (log-softmax of
  # the logits before temperature and filters, as vLLM's default), and this many most
  # likely alternatives per token.
  logprobs: bool = False
  top_logprobs: int = 0

  def __post_init__(self):
    super().__post_init__()
    # Everything a decode call reads is checked here: an error inside `step` leaves the
    # request queued with its blocks, and every later call fails on it.
    for name, low in (("max_new_tokens", 1), ("n", 1), ("top_logprobs", 0)):
      check_int(getattr(self, name), name, low)
    for name in ("ignore_eos", "logprobs"):
      if not isinstance(getattr(self, name), (bool, np.bool_)):
        raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
    stop = (self.stop,) if isinstance(self.stop, str) else self.stop
    if (not isinstance(stop, collections.abc.Iterable) or isinstance(stop, bytes)
        or isinstance(stop, collections.abc.Mapping)):  # (a dict gave its keys)
      raise ValueError(f"stop must be a str or a list of str, got {self.stop!r}")
    stop = tuple(stop)
    bad = [s for s in stop if not isinstance(s, str) or not s]
    if bad:
      raise ValueError(f"stop strings must be non-empty str, got {bad[0]!r}")
    # (text is decoded Unicode: a lone surrogate never matched; the stream's hold-back
    # scans each stop string's prefixes per token: 200,000 characters took 0.4 s a token)
    bad = [s for s in stop if LONE_SURROGATE.search(s) or len(s) > MAX_STOP_CHARS]
    if bad:
      raise ValueError(f"stop string {bad[0][:40]!r}{'...' if len(bad[0]) > 40 else ''} "
                       f"({len(bad[0])} characters) must be at most {MAX_STOP_CHARS} "
                       f"characters of valid Unicode (no lone surrogate)")
    object.__setattr__(self, "stop", stop)
    ids = self.stop_token_ids
    if isinstance(ids, (str, bytes)) or not isinstance(ids, collections.abc.Iterable):
      raise ValueError(f"stop_token_ids must be a list of token ids, got {ids!r}")
    ids = tuple(ids)
    bad = [i for i in ids if not is_int(i) or i < 0]
    if bad:  # (the vocabulary's end is the engine's check)
      raise ValueError(f"stop_token_ids must be token ids (ints >= 0), got {bad[0]!r}")
    object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in ids))

  @classmethod
  def from_dict(cls, values: dict) -> "GenerationParams":
    """Builds params from a dict, naming any unknown keys."""
    return fields.from_dict(cls, values, "unknown generation parameter(s)")


@dataclasses.dataclass
class Request:
  """prompt: text, token ids, or chat messages [{"role", "content"}]."""

  prompt: str | Sequence[int] | Sequence[dict]
  params: GenerationParams | dict = dataclasses.field(default_factory=GenerationParams)
  request_id: int | str | None = None


@dataclasses.dataclass
class SampleResult:
  index: int
  text: str
  token_ids: list[int]
  # "stop" (eos, stop id or stop string), "length", "pruned" (a live budget stopped this
  # sample of an n > 1 request: the lowest-confidence one running; see Engine._prune), or
  # "error" (the model's logits were not finite: its text ends before that token)
  finish_reason: str
  logprobs: list[float] | None = None
  top_logprobs: list[list[tuple[int, float]]] | None = None
  preemptions: int = 0
  # With a thinking span (Engine(thinking=...)): `text` is the answer after it; this is the
  # thinking, markers removed ("" when the sample did not think), and its token count.
  thinking: str | None = None
  thinking_tokens: int = 0


@dataclasses.dataclass
class RequestResult:
  request_id: int | str
  prompt_token_ids: list[int]
  samples: list[SampleResult]
  metrics: RequestMetrics

  # Sample 0 as the result, for n == 1.
  @property
  def text(self) -> str:
    return self.samples[0].text

  @property
  def token_ids(self) -> list[int]:
    return self.samples[0].token_ids

  @property
  def finish_reason(self) -> str:
    return self.samples[0].finish_reason

  @property
  def logprobs(self) -> list[float] | None:
    return self.samples[0].logprobs

  @property
  def top_logprobs(self):
    return self.samples[0].top_logprobs


@dataclasses.dataclass
class StreamEvent:
  sample: int
  token_id: int | None  # None on the closing event of a sample
  text: str  # text added by this token
  logprob: float | None
  finish_reason: str | None  # set on the sample's last event


# --- host-side sequence state ---------------------------------------------------------------


class _Group:
  """One request: its samples, metrics and stream buffer."""

  def __init__(self, owner, index, request_id, key_id, prompt_ids, params, metrics):
    self.owner = owner  # the engine that queued it (`Engine._own`)
    self.index = index  # position in submission order
    self.request_id = request_id
    self.key_id = key_id  # int (or a str id's words) the sampling keys derive from
    self.prompt_ids = prompt_ids
    self.params: GenerationParams = params
    self.metrics: RequestMetrics = metrics
    self.samples: list[_Seq | None] = [None] * params.n
    self.unfinished = params.n
    self.events: collections.deque[StreamEvent] | None = None
    self.stop_ids: list[int] = []  # tokens that end a sample on the device (_make_group)
    self.limit = params.max_new_tokens  # tokens per sample: max_new_tokens, or the budget's


class _Seq:
  """One sequence: tokens (prompt + generated), its blocks and progress."""

  def __init__(self, group: _Group, sample: int, tokens: list[int], arrival: int, fork_n: int):
    self.group = group
    self.sample = sample
    self.tokens = tokens
    self.arrival = arrival  # priority: lower = older = kept under memory pressure
    self.fork_n = fork_n  # > 1: unforked prompt of an n-sample request
    self.blocks: list[int] = []
    self.n_computed = 0  # tokens whose K/V are in the blocks
    # Leading tokens whose draft-model K/V is in the draft pool (drafter draft_model).
    # 0 at every admission, prefix-cached blocks included: a sequence catches up over
    # its whole prompt itself (`Engine._catch_up_draft`).
    self.draft_computed = 0
    self.generated: list[int] = []
    self.logprobs: list[float] = []  # kept when the request asks for them
    self.logprob_sum = 0.0  # always: its confidence when the budget prunes (Engine._prune)
    self.top: list[list[tuple[int, float]]] = []
    self.finish_reason: str | None = None
    self.preemptions = 0
    self.text_len = 0  # characters already streamed
    self.key = None  # np.uint32 [2]
    self.pending_keys: set = set()  # prefix keys of blocks it is prefilling
    self.acceptance = Acceptance()  # of its speculative drafts (engine/speculative.py)
    self.span: SpanReader | None = None  # where its answer begins (a thinking span only)

  @property
  def prefill_target(self) -> int:
    return len(self.tokens) - 1  # the last token is fed by the decode step

  @property
  def remaining_budget(self) -> int:
    return self.group.limit - len(self.generated)


# --- the engine -------------------------------------------------------------------------------


def _weight_bytes(leaves) -> int:
  return sum(getattr(leaf, "nbytes", 0) for leaf in leaves)


class Engine:
  """Offline batch generation, streaming, and the jitted pieces for the controller."""

  def __init__(self, model, tokenizer, config: EngineConfig = EngineConfig(), *,
               clock: Callable[[], float] = time.perf_counter, budget: BudgetLoop | None = None,
               speculative: SpeculativeConfig | None = None, draft_model: Llama | None = None,
               mesh: Mesh | None = None, thinking: str | ThinkingSpan | None = "auto"):
    """draft_model: the drafter of speculative drafter "draft_model" (else the engine
    loads `speculative.draft_source`); it must share the target's vocabulary.
    mesh: a `jax.sharding.Mesh` with a "model" axis: the weights and the KV pools are
    split over it by heads (tensor parallelism, o1jax/sharding/tensor_parallel.py);
    outputs are the one-device engine's up to the all-reduced sums' order (logits ~1e-6
    apart: a near-tie can fork; an FP8 pool's code can round the other way and move
    later logits ~1e-3).
    thinking: a reasoning model's thinking span (o1jax/model/thinking.py): "auto" (the
    markers its chat template names, if any), "on", "off", "<open> <close>", or a
    ThinkingSpan. With a span a sample's text is its answer after the span, its thinking
    is `SampleResult.thinking`, and stop strings apply to the answer only."""
    # (each was an AttributeError at its first use, or never: a str budget was kept)
    check_llama(model, "Engine")
    if not all(hasattr(tokenizer, a) for a in ("encode", "decode", "eos_ids")):
      raise ValueError(f"tokenizer must be the checkpoint's tokenizer (ck.tokenizer), got "
                       f"{type(tokenizer).__name__}")
    if not isinstance(config, EngineConfig):
      raise ValueError(f"config must be an EngineConfig, got {type(config).__name__}")
    for name, value, cls in (("budget", budget, BudgetLoop),
                             ("speculative", speculative, SpeculativeConfig)):
      if value is not None and not isinstance(value, cls):
        raise ValueError(f"{name} must be a {cls.__name__} or None, got {type(value).__name__}")
    if config.data_parallel > 1:
      raise ValueError(f"data_parallel={config.data_parallel}: one Engine is one replica; "
                       f"build replicas with o1jax.engine.build_engine (EngineReplicas)")
    # What the config can only be checked against with the model (else a decode call fails).
    vocab = model.config.vocab_size
    if config.max_top_logprobs > vocab:
      raise ValueError(f"max_top_logprobs={config.max_top_logprobs} exceeds the model's "
                       f"vocabulary of {vocab} tokens")
    bs = config.block_size
    # (asked for by name: 'auto' takes XLA's attention for pages the kernels cannot tile)
    if (getattr(model, "backend", "reference") == "pallas"
        and not kernel_ops.pallas_block_size_ok(bs)):
      raise ValueError(f"block_size={bs} must be a power of two in [8, 128] for the Pallas "
                       f"attention kernels")
    if mesh is None and config.tensor_parallel > 1:
      mesh = tensor_parallel.group_mesh(config.tensor_parallel)
    elif mesh is not None:
      tensor_parallel.check_mesh(mesh)
      if config.tensor_parallel > 1 and (
          tensor_parallel.tensor_parallel_size(mesh) != config.tensor_parallel):
        raise tensor_parallel.ShardingError(
            f"tensor_parallel={config.tensor_parallel} but the given mesh's model axis has "
            f"{tensor_parallel.tensor_parallel_size(mesh)} devices (give one of the two)")
    self.mesh = mesh = None if mesh is None else tensor_parallel.auto_mesh(mesh)
    if mesh is not None:
      model = tensor_parallel.shard_model(model, mesh)
    self.model = model
    self.tokenizer = tokenizer
    self.thinking = thinking_lib.resolve(thinking, tokenizer)
    self._chat_kwargs = thinking_lib.template_kwargs(thinking, tokenizer)
    self.config = config
    # The latency-aware budget (engine/budget.py): it scales every request's token
    # limit, re-evaluated on its clock between device calls. None: max_new_tokens.
    self.budget = budget
    self.model_config = mc = model.config
    self.clock = clock
    if config.max_context is not None and config.max_context > mc.max_context:
      # (it was cut to the model's silently: the caller planned for a context it lacks)
      raise ValueError(f"max_context={config.max_context} exceeds the model's context of "
                       f"{mc.max_context} tokens")
    self.max_context = config.max_context or mc.max_context
    # Shape settings past what a context can use: a program that never finishes compiling
    # (decode_steps=1e9), a host loop of 1e8 turns, a table of 30 GB (each found at the first
    # generate, as a hang or an out-of-memory error).
    context_blocks = math.ceil(self.max_context / config.block_size)
    for name, value, most, what in (
        ("decode_steps", config.decode_steps, self.max_context,
         f"the context's tokens, max_context={self.max_context}"),
        ("min_chunk_bucket", config.min_chunk_bucket, max(config.prefill_chunk, 16),
         f"max(prefill_chunk={config.prefill_chunk}, 16)"),
        ("min_table_blocks", config.min_table_blocks, max(context_blocks, 8),
         f"max(the {context_blocks} blocks of one context, 8)")):
      if value > most:
        raise ValueError(f"{name}={value} must be <= {most} ({what})")
    self._graphdef, self._state = nnx.split(model)
    self.eos_ids = frozenset(tokenizer.eos_ids) | frozenset(mc.eos_ids)
    # (shapes only: a probe block of a typo'd block_size was itself an out-of-memory error)
    probe = jax.eval_shape(lambda: PagedKVCache.create(1, 1, config.block_size, mc.n_kv_heads,
                                                       mc.head_dim, config.kv_dtype))
    per_block = probe.bytes_per_block() * mc.n_layers
    if config.num_blocks is not None:
      num_blocks = config.num_blocks
    else:
      num_blocks = max(1, (config.kv_cache_bytes or 256 << 20) // per_block)
      if config.min_tokens_per_slot:  # every slot can hold a whole sequence: no preemption
        num_blocks = max(num_blocks, self._blocks_for_slots(config, per_block))
    self.num_blocks = int(num_blocks)
    # A mesh splits the pool by KV heads: each device holds its share.
    shards = 1 if mesh is None else dict(mesh.shape).get(tensor_parallel.MODEL_AXIS, 1)
    check_fits_device(per_block * self.num_blocks // shards,
                      f"the KV pool ({self.num_blocks} blocks of {config.block_size} tokens, "
                      f"{config.kv_dtype})", "num_blocks, kv_cache_bytes or block_size")
    self.cache = self._new_pool(mc)
    self.allocator = BlockAllocator(self.num_blocks, config.block_size,
                                    prefix_caching=config.prefix_caching)
    self.kv_bytes = per_block * self.num_blocks
    log.info("engine: KV pool %d blocks x %d tokens (%s) = %.1f MiB; %d decode slots",
             self.num_blocks, config.block_size, config.kv_dtype, self.kv_bytes / 2**20,
             config.max_slots)
    self.trace_counts: collections.Counter[str] = collections.Counter()
    self.metrics = MetricsCollector()
    self.metrics.set_blocks(0, self.num_blocks)
    self._waiting: list[_Seq] = []
    self._prefilling: list[_Seq] = []
    self._running: list[_Seq] = []
    self._groups: list[_Group] = []
    self._arrivals = 0
    # Queues, pools and programs are one thread's at a time: threads that share the engine
    # take turns per step (their requests still decode in the same batches).
    self._lock = threading.RLock()
    # Cancels asked for inside a step (a stream garbage-collected mid-step closes itself
    # there, in whichever thread steps: the RLock lets it in), applied when the step ends.
    self._stepping = False
    self._cancel_after_step: list[_Group] = []
    self._warned_nonfinite = False
    self._table_cap = pow2_bucket(math.ceil(self.max_context / config.block_size),
                                  config.min_table_blocks)
    # Prefill calls rent a bigger compiled shape until compiling their own pays off.
    self._prefill_shapes = (ShapePlan(PREFILL_CALL_OVERHEAD) if config.reuse_compiled_shapes
                            else None)
    self._decode_shapes = (ShapePlan(fits=decode_fits)
                           if config.reuse_compiled_shapes else None)
    # Calls pass the flat state leaves (`_BoundStep`).
    self._state_leaves, self._state_def = jax.tree.flatten(self._state)
    self._decode_jit = self._jit("decode", self._bound(steps.decode_loop),
                                 static_argnums=(6, 7, 9), donate_argnums=(1,))
    self._prefill_jit = self._jit("prefill", self._bound(steps.prefill_step), donate_argnums=(1,))
    self._copy_jit = self._jit("copy", copy_blocks, donate_argnums=(0,))
    self._verify_jit = self._jit("verify", self._bound(steps.verify_step), static_argnums=(5,),
                                 donate_argnums=(1,))
    self._draft_jit = self._jit("draft", self._bound(steps.draft_greedy), static_argnums=(4, 5),
                                donate_argnums=(1,))
    self._head_t = self._transposed_head(model)
    self.draft_model: Llama | None = None
    self.set_speculative(speculative, draft_model)

  def _blocks_for_slots(self, config: EngineConfig, per_block: int) -> int:
    """Blocks for max_slots sequences of min_tokens_per_slot tokens (a pool too small
    for the running sequences preempts and recomputes them: 16 slots of 256-token
    answers in 64 MiB took twice as long), at most half the device's memory."""
    tokens = min(config.min_tokens_per_slot, self.max_context)
    # Rounded up to a bucket: the pool's size is in every program's signature, so jobs of
    # similar lengths share compiled programs (and the persistent compilation cache).
    want = three_quarter_bucket(config.max_slots * -(-tokens // config.block_size))
    cap = pool_memory_limit(jax.devices()[0]) // per_block
    if want > cap:
      log.warning("engine: %d slots x %d tokens need %d KV blocks (%.0f MiB); using %d, half "
                  "the device's memory: long sequences may be preempted and recomputed",
                  config.max_slots, tokens, want, want * per_block / 2**20, cap)
    return min(want, cap)

  def set_speculative(self, speculative: SpeculativeConfig | None,
                      draft_model: Llama | None = None) -> None:
    """Turns speculative decoding on (engine/speculative.py: drafts checked in one
    forward; the same tokens as without it) or off (None: one token per row per
    decode step), between runs: the engine must be idle. Compiled programs are kept."""
    if self.has_work():
      raise ValueError("set_speculative needs an idle engine: requests are still running")
    # Everything that can refuse runs before the engine changes: a refused setting leaves
    # the engine as it was (it kept the new drafter without its draft model, and the next
    # run failed with an AttributeError).
    exit_layer = (speculative.resolved_exit_layer(self.model_config.n_layers)
                  if speculative is not None and speculative.drafter == "early_exit" else 0)
    draft = self._resolve_draft_model(self.model, speculative, draft_model)
    if draft is not None and draft is not self.draft_model:
      self._init_draft_model(draft)  # the same draft model keeps its pool and compiled calls
    self.speculative, self._exit_layer, self.draft_model = speculative, exit_layer, draft
    # One draft step's cost relative to a plain step, until the planner measures calls:
    # the early exit runs its share of the layers; a draft model reads its weight bytes.
    if draft is not None:
      share = _weight_bytes(self._draft_leaves) / _weight_bytes(self._state_leaves)
    else:
      share = self._exit_layer / self.model_config.n_layers
    self._planner = (SpeculationPlanner(speculative, draft_step_share=share)
                     if speculative is not None else None)

  @staticmethod
  def _resolve_draft_model(model, speculative: SpeculativeConfig | None,
                           draft_model: Llama | None) -> Llama | None:
    """The draft model of drafter draft_model: `draft_model`, or `speculative.draft_source`
    loaded with the target's backend and matmul dtype. None for the other drafters."""
    if speculative is None or speculative.drafter != "draft_model":
      if draft_model is not None:
        raise ValueError("Engine(draft_model=) needs speculative drafter 'draft_model'")
      return None
    if draft_model is None:
      if not speculative.draft_source:
        raise ValueError("speculative drafter 'draft_model' needs speculative.draft_source or "
                         "Engine(draft_model=)")
      ck = load_checkpoint(speculative.draft_source)
      draft_model = Llama(ck.config, ck.params, backend=model.backend, interpret=model.interpret,
                          matmul_dtype=model.matmul_dtype)
    check_draft_vocabulary(model.config, draft_model.config)
    return draft_model

  def _init_draft_model(self, draft: Llama) -> None:
    """The draft model's pool and jitted calls.

    Its pool has the target pool's blocks (number and size; the draft model's own
    layers, kv heads and head dim, the engine's kv_dtype), so the target's block
    tables address it too: one allocator, and a sequence's draft K/V lives in the
    blocks it holds. Shared blocks (prefix caching, forks) may get their draft K/V
    rewritten by another sequence with the same tokens at the same positions: the
    same values. The draft pool never changes outputs, only how many drafts are
    accepted (verification is exact). Its memory is not part of kv_cache_bytes.
    A draft model with a shorter context drafts only below it (`_speculate_once`)."""
    dc = draft.config
    if self.mesh is not None:  # first: a draft model that does not split is named here
      try:
        draft = tensor_parallel.shard_model(draft, self.mesh)
      except tensor_parallel.ShardingError as e:
        raise tensor_parallel.ShardingError(f"speculative draft model: {e}") from None
    pool = self._new_pool(dc)
    log.info("engine: draft model %s, %d layers; its KV pool %.1f MiB", dc.name, dc.n_layers,
             pool.bytes_per_block() * self.num_blocks / 2**20)
    graphdef, state = nnx.split(draft)
    leaves, state_def = jax.tree.flatten(state)
    self.draft_cache, self._draft_leaves = pool, leaves
    self._draft_prefill_jit = self._jit(
        "draft_prefill", self._bound(steps.prefill_step, graphdef, state_def), donate_argnums=(1,))
    # The drafting call over the draft model (early_exit's runs the target's first layers).
    self._draft_model_jit = self._jit(
        "draft", self._bound(steps.draft_greedy, graphdef, state_def), static_argnums=(4, 5),
        donate_argnums=(1,))
    self._draft_head_t = self._transposed_head(draft)
    self._draft_context = min(self.max_context, dc.max_context)

  def _new_pool(self, mc) -> PagedKVCache:
    """An empty KV pool of the engine's blocks for a model of config `mc` (split by KV
    heads over the mesh, if any)."""
    cfg = self.config
    pool = PagedKVCache.create(mc.n_layers, self.num_blocks, cfg.block_size, mc.n_kv_heads,
                               mc.head_dim, cfg.kv_dtype)
    return pool if self.mesh is None else tensor_parallel.shard_pools(pool, self.mesh)

  @staticmethod
  def _transposed_head(model) -> jax.Array | None:
    """[V, d] copy of a dense f32 output head for batched decode (see steps.forward).
    None for bf16 matmuls and f32 tiles (`TiledF32Weight`): their products are fast
    in the stored layout."""
    head = model.head_weight
    if not isinstance(head, jax.Array) or head.dtype != jnp.float32:
      return None
    return jnp.asarray(head.T)

  # -- jitted pieces ---------------------------------------------------------------

  def _bound(self, step_fn, graphdef=None, state_def=None):
    """step_fn(graphdef, state, *args) as fn(state_leaves, *args): the target model's
    graphdef and state structure, or the given ones (the draft model's)."""
    graphdef = self._graphdef if graphdef is None else graphdef
    state_def = self._state_def if state_def is None else state_def
    return _BoundStep(step_fn, graphdef, state_def)

  def _jit(self, name: str, fn, **jit_kwargs):
    """The jitted fn, shared by every engine whose fn is equal (`_BoundStep`: the same step
    of an equal graphdef and state structure; no params) and mesh: a second engine on
    the same model compiles nothing again. Each trace (= each compilation of a new
    shape) is counted in the calling engine's `trace_counts` and logged. On a mesh,
    every call runs with it set, so ops that XLA cannot partition run per shard
    (`pallas_kernels.ops`). What a trace depends on must be in its arguments (static
    ones for host decisions: the decode loop's `fixed_trips`), not read from the process:
    another engine's program would be taken for it."""
    # (The key hashes the graphdef: once here, not per call.)
    key = (name, fn, self.mesh, tuple(sorted(jit_kwargs.items())))
    program = _PROGRAMS.get(key)
    if program is None:
      program = _PROGRAMS[key] = compilation_cache.jit(_Counted(name, fn), **jit_kwargs)
    counts, mesh = self.trace_counts, self.mesh

    @functools.wraps(fn)
    def call(*args):
      caller = _TRACE_COUNTS.set(counts)
      try:
        if mesh is None:
          return program(*args)
        with jax.set_mesh(mesh):
          return program(*args)
      finally:
        _TRACE_COUNTS.reset(caller)

    call.lower = program.lower  # as a jitted function's (not counted)
    return call

  @property
  def graphdef(self):
    return self._graphdef

  @property
  def state(self):
    return self._state

  def decode(self, cache: PagedKVCache, batch: steps.DecodeBatch, limits, stop_ids,
             max_iterations: int, top_logprobs: int, num_steps: int, fixed_trips: bool):
    """The jitted decode loop (`steps.decode_loop`, cache donated): `max_iterations`
    steps of at most `num_steps` (`fixed_trips`: exactly `num_steps`, the ones after
    every row stopped idle). Returns (LoopOutput, cache)."""
    # The transposed head only pays off from batch 8 (at batch 1 the stored layout is faster).
    head_t = self._head_t if batch.tokens.shape[0] >= 8 else None
    return self._decode_jit(self._state_leaves, cache, batch, limits, stop_ids,
                            jnp.int32(max_iterations), num_steps, top_logprobs, head_t,
                            fixed_trips)

  def prefill(self, cache: PagedKVCache, tokens, starts, chunk_lens, block_tables) -> PagedKVCache:
    """The jitted prefill step (cache donated). Returns the cache."""
    return self._prefill_jit(self._state_leaves, cache, tokens, starts, chunk_lens,
                             block_tables)

  # -- request intake ----------------------------------------------------------------

  def encode_prompt(self, prompt) -> list[int]:
    """Text, token ids, or chat messages -> token ids (chat template applied; checked)."""
    return encode_prompt(self.tokenizer, prompt, self.model_config.vocab_size, self._chat_kwargs)

  def _make_group(self, request: Request | dict | str, index: int) -> _Group:
    if isinstance(request, str):
      request = Request(prompt=request)
    elif isinstance(request, dict):
      unknown = sorted(set(request) - {"prompt", "params", "request_id"})
      if unknown:
        raise ValueError(f"unknown request field(s) {unknown}; known: prompt, params, request_id")
      if "prompt" not in request:  # (was Request's TypeError, naming no request)
        raise ValueError("a request dict needs a 'prompt'")
      request = Request(**request)
    elif not isinstance(request, Request):
      raise ValueError(f"request must be a Request, a dict or a prompt str, got "
                       f"{type(request).__name__}")
    params = request.params
    if isinstance(params, dict):
      params = GenerationParams.from_dict(params)
    elif not isinstance(params, GenerationParams):
      raise ValueError(f"params must be GenerationParams or a dict, got {type(params).__name__}")
    ids = self.encode_prompt(request.prompt)
    if len(ids) >= self.max_context:
      raise ValueError(f"prompt has {len(ids)} tokens but the context is {self.max_context} "
                       f"tokens (room for >= 1 new token needed)")
    if params.n > self.config.max_slots:
      raise ValueError(f"n={params.n} samples exceed the engine's {self.config.max_slots} decode slots")
    if params.top_logprobs > self.config.max_top_logprobs:
      raise ValueError(f"top_logprobs={params.top_logprobs} > max_top_logprobs="
                       f"{self.config.max_top_logprobs} of the engine config")
    vocab = self.model_config.vocab_size
    bad = [i for i in params.stop_token_ids if i >= vocab]
    if bad:
      raise ValueError(f"stop_token_ids outside the vocabulary [0, {vocab}): {bad[:5]}")
    rid = request.request_id
    if isinstance(rid, bool) or not (rid is None or is_int(rid) or isinstance(rid, str)):
      # (1.0 and 1 would get different random streams; a bool is no id)
      raise ValueError(f"request_id must be an int, a str or None, got {rid!r}")
    if is_int(rid) and not KEY_ID_RANGE[0] <= rid < KEY_ID_RANGE[1]:
      # An int id (numpy's too) is folded into the sampling keys as it is (a str is hashed).
      raise ValueError(f"request_id={rid} must be in [0, 2**64) (or a str)")
    worst = min(len(ids) + params.max_new_tokens, self.max_context)
    need = math.ceil(worst / self.config.block_size)
    if need > self.num_blocks:
      raise ValueError(f"the request may need {need} KV blocks but the pool has "
                       f"{self.num_blocks}: raise num_blocks/kv_cache_bytes")
    if request.request_id is None:  # (an index of -5 failed every request's next step)
      check_key_id(index, "index (a request without a request_id is numbered by it)")
    rid = index if request.request_id is None else request.request_id
    key_id = key_id_words(rid)
    metrics = RequestMetrics(arrival=self.clock(), prompt_tokens=len(ids))
    group = _Group(self, index, rid, key_id, ids, params, metrics)
    # eos (unless ignored) and the stop ids; [-1] (matches nothing) when there are none.
    stop = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_ids))
    group.stop_ids = sorted(stop) or [-1]
    if self.budget is not None:
      self._set_limit(group, self.budget.steps, "budget at arrival")
    return group

  def add_request(self, request: Request | dict | str, index: int | None = None) -> _Group:
    """Validates and queues one request; returns its handle. Without a request_id it is
    numbered in arrival order on this engine (its sampling keys: unique among the requests
    added, but dependent on that order; give a request_id for a stream of its own). (The
    count of requests in flight was its number: two requests could share one stream.)"""
    with self._lock:
      group = self._make_group(request, self._arrivals if index is None else index)
      self._queue(group)
      return group

  def _queue(self, group: _Group) -> None:
    self._groups.append(group)
    self._waiting.append(_Seq(group, 0, list(group.prompt_ids), self._arrivals, group.params.n))
    self._arrivals += 1

  # -- public API ------------------------------------------------------------------------

  def _make_groups(self, requests: Sequence[Request | dict | str]) -> list[_Group]:
    """Every request validated (see `_make_group`), before any is queued."""
    if isinstance(requests, (str, bytes, dict, Request)):  # else a str runs a request per character
      raise ValueError(f"requests must be a list of requests, got one {type(requests).__name__}")
    if not isinstance(requests, collections.abc.Iterable):
      raise ValueError(f"requests must be a list of requests, got {type(requests).__name__}")
    requests = list(requests)
    if len(requests) == 1:
      return [self._make_group(requests[0], 0)]
    groups = []
    for i, r in enumerate(requests):  # one bad request of many: which one
      try:
        groups.append(self._make_group(r, i))
      except ValueError as e:
        rid = getattr(r, "request_id", r.get("request_id") if isinstance(r, dict) else None)
        named = f" (request_id={rid!r})" if rid is not None else ""
        raise ValueError(f"request {i}{named}: {e}") from e
    return groups

  def check_requests(self, requests: Sequence[Request | dict | str]) -> None:
    """Raises the ValueError `generate` would raise for a bad request; queues nothing."""
    self._make_groups(requests)

  def generate(self, requests: Sequence[Request | dict | str]) -> list[RequestResult]:
    """Runs every request to completion; results in input order.

    All requests are validated before any work starts (a bad one raises
    ValueError and nothing runs). A request without request_id uses its
    position in `requests` as id (for its sampling keys).

    Threads may share an engine: each call runs until its own requests are done, and the
    calls take turns per step, so their requests decode in the same batches."""
    with self._lock:
      groups = self._make_groups(requests)
      for g in groups:
        self._queue(g)
    try:
      while True:
        with self._lock:
          if not any(g.unfinished for g in groups):
            return [self.result(g) for g in groups]
          self.step()
    except BaseException:  # (an interrupt too) the next call must not inherit these requests
      with self._lock:
        for g in groups:
          self.cancel(g)
      raise

  def stream(self, request: Request | dict | str) -> Iterator[StreamEvent]:
    """Yields one StreamEvent per generated token (all samples), as they come.

    Other queued requests keep running in the same batches. A request without a
    request_id is numbered 0, as `generate([request])` numbers it, so it streams the
    tokens that call returns: two sampled streams of it draw the same tokens (give each
    its own request_id for streams of their own)."""
    group = self.add_request(request, index=0)
    group.events = collections.deque()
    try:
      while group.unfinished or group.events:
        while group.events:
          yield group.events.popleft()
        with self._lock:
          if group.unfinished:
            self.step()
    finally:  # also when the caller stops reading early: its slots and blocks come back
      self.cancel(group)

  def _own(self, group) -> None:
    """ValueError unless `group` is a handle this engine's `add_request` returned (another
    engine's handle was marked finished here while its own engine still decoded it)."""
    if not isinstance(group, _Group):
      raise ValueError(f"expected a request handle from add_request, got {type(group).__name__}")
    if group.owner is not self:
      raise ValueError(f"request {group.request_id!r} was queued on another Engine")

  def cancel(self, group: _Group) -> None:
    """Forgets a request queued with `add_request`: its unfinished samples leave the
    queues (finish reason "cancelled") and their blocks are freed. For a caller that
    will not collect it (it failed, or stopped reading a stream); a no-op when the
    request was already collected."""
    with self._lock:
      self._own(group)
      if self._stepping:  # (removing its rows mid-step broke the step's own bookkeeping)
        self._cancel_after_step.append(group)
        return
      self._cancel(group)

  def _cancel(self, group: _Group) -> None:
    for queue in (self._waiting, self._prefilling, self._running):
      for seq in [q for q in queue if q.group is group]:
        queue.remove(seq)
        self.allocator.free_all(seq.blocks)
        seq.blocks = []
        seq.finish_reason = seq.finish_reason or "cancelled"
    group.unfinished = 0
    if group in self._groups:
      self._groups.remove(group)
    self.metrics.set_blocks(self.allocator.num_used, self.num_blocks)

  def run_until_idle(self) -> None:
    """Steps until every request added with `add_request` has finished (then read
    each with `result`)."""
    with self._lock:
      while self._waiting or self._prefilling or self._running:
        self.step()

  def has_work(self) -> bool:
    return bool(self._waiting or self._prefilling or self._running)

  # -- one iteration -----------------------------------------------------------------------

  def step(self) -> None:
    """One scheduler iteration: admit, one prefill chunk, one decode step (see module doc).

    If a device call fails (e.g. out of device memory) after its donated KV pool was
    consumed, the pool is rebuilt and every sequence that held blocks is requeued for
    recomputation (`_recover_pools`) before the error propagates: the caller cancels
    its own requests, the others go on with the tokens they would have had."""
    with self._lock:
      self._step()

  def _step(self) -> None:
    release_programs_near_map_limit()
    t0 = self.clock()
    self._stepping = True
    try:
      self._apply_budget()
      self._admit()
      self._prefill_once()
      self._decode_once()
    except BaseException:
      self._recover_pools()
      raise
    finally:
      self._stepping = False
      while self._cancel_after_step:
        self._cancel(self._cancel_after_step.pop(0))
    self.metrics.busy_seconds += self.clock() - t0
    self.metrics.set_blocks(self.allocator.num_used, self.num_blocks)

  def _recover_pools(self) -> None:
    """After a failed step: if a KV pool's buffers were deleted (donated to a device call
    that did not return them), empty pools replace both, every sequence holding blocks is
    preempted (recomputed from its tokens when admitted again), and the allocator starts
    empty (its cached prefixes pointed into the lost pool). No-op when the pools are intact."""
    pools = [self.cache] + ([self.draft_cache] if self.draft_model is not None else [])
    if not any(leaf.is_deleted() for pool in pools for leaf in jax.tree.leaves(pool)):
      return
    lost = list(self._prefilling) + list(self._running)
    log.warning("engine: a device call failed after taking the KV pool; rebuilding it and "
                "requeueing %d sequences for recomputation", len(lost))
    for seq in lost:
      self._preempt(seq)
    self.allocator = BlockAllocator(self.num_blocks, self.config.block_size,
                                    prefix_caching=self.config.prefix_caching)
    self.cache = self._new_pool(self.model_config)
    if self.draft_model is not None:
      self.draft_cache = self._new_pool(self.draft_model.config)
    self.metrics.pool_rebuilds += 1
    self.metrics.set_blocks(self.allocator.num_used, self.num_blocks)

  def _apply_budget(self) -> None:
    """Re-evaluates the budget (on its clock) and applies it to every unfinished request:
    a running sample at or past its new limit stops now ("length")."""
    if self.budget is None:
      return
    queued = sum(s.fork_n for s in self._waiting)
    decision = self.budget.tick(busy=self._slots_in_use(), queued=queued,
                                slots=self.config.max_slots,
                                kv_use=self.allocator.num_used / self.num_blocks)
    if decision is None:
      return
    for group in {id(s.group): s.group for s in self._waiting + self._prefilling + self._running
                  }.values():
      self._set_limit(group, decision.steps, decision.why)
    # Running samples, and preempted ones waiting to be recomputed (which were recomputed,
    # then given a token past the new limit).
    for seq in [s for s in self._running + self._prefilling + self._waiting
                if s.generated and s.remaining_budget <= 0]:
      self._stop(seq, "length")
    if decision.prune:
      self._prune()

  def _prune(self) -> None:
    """The budget's pruning rule for n > 1 requests: each request with two or more running
    samples stops the one with the lowest mean log-probability so far (a sample with no
    tokens yet counts as certain; ties: the highest sample index), finish reason "pruned"."""
    running: dict[int, list[_Seq]] = collections.defaultdict(list)
    for seq in self._running:
      running[id(seq.group)].append(seq)
    for seqs in running.values():
      if len(seqs) >= 2:
        weakest = min(seqs, key=lambda q: (q.logprob_sum / len(q.generated) if q.generated
                                           else 0.0, -q.sample))
        self._stop(weakest, "pruned")

  def _stop(self, seq: _Seq, reason: str) -> None:
    """Finishes a running sample from outside a decode step (its stream is closed too)."""
    if seq.group.events is not None:
      self._emit(seq, None, 0.0, reason)
    self._finish(seq, reason)

  def _set_limit(self, group: _Group, steps: int, why: str) -> None:
    limit = token_limit(group.params.max_new_tokens, steps)
    if group.metrics.budget and limit == group.limit:
      return
    group.limit = limit
    group.metrics.budget.append({"at_ms": round((self.clock() - group.metrics.arrival) * 1e3, 1),
                                 "steps": steps, "tokens": limit, "why": why})

  def _slots_in_use(self) -> int:
    return len(self._running) + sum(s.fork_n for s in self._prefilling)

  def _admission_order(self) -> list[_Seq]:
    """Preempted sequences first (they already paid), then by policy."""
    policy = self.config.policy
    if policy == "fifo":
      key = lambda s: (s.preemptions == 0, s.arrival)
    elif policy == "shortest_budget":
      key = lambda s: (s.preemptions == 0, s.remaining_budget, s.arrival)
    else:  # length_groups: similar prompt lengths admitted together
      key = lambda s: (s.preemptions == 0, pow2_bucket(len(s.tokens), 16), s.arrival)
    return sorted(self._waiting, key=key)

  def _prefix_keys(self, seq: _Seq) -> set:
    """Prefix-cache keys of the full blocks this sequence's prefill would compute: not
    those cached already (else every request sharing a cached system prompt waited
    for the one prefilling: one admission per step)."""
    if not self.config.prefix_caching:
      return set()
    target = seq.prefill_target
    keys = self.allocator.block_keys(seq.tokens, target // self.config.block_size)
    return set(keys[self.allocator.cached_prefix(seq.tokens, target):])

  def _admit(self) -> None:
    # Blocks some admitted sequence is computing right now: a request sharing
    # one of them waits for it instead of computing the same prefix again.
    in_flight = set().union(*(s.pending_keys for s in self._prefilling))
    for seq in self._admission_order():
      if self._slots_in_use() + seq.fork_n > self.config.max_slots:
        if self.config.policy == "fifo":
          break  # keep arrival order strict
        continue
      keys = self._prefix_keys(seq)
      if keys & in_flight:
        continue
      # Admit only if its uncached prompt fits now: avoids admitting into thrash.
      target = seq.prefill_target
      cached = self.allocator.match_prefix(seq.tokens, target)
      need = math.ceil(target / self.config.block_size) - len(cached) + seq.fork_n
      if need > self.allocator.num_free and (self._running or self._prefilling):
        self.allocator.free_all(cached)
        break
      self._waiting.remove(seq)
      seq.blocks = cached
      seq.n_computed = len(cached) * self.config.block_size
      if seq.preemptions == 0:
        seq.group.metrics.prompt_tokens_computed += target - seq.n_computed
      else:  # the cost of preemption: its prompt and generated tokens run again
        seq.group.metrics.recomputed_tokens += target - seq.n_computed
      if seq.n_computed >= target:
        self._start_decoding(seq)
      else:
        seq.pending_keys = keys
        in_flight |= keys
        self._prefilling.append(seq)

  def _start_decoding(self, seq: _Seq) -> None:
    """Prompt done: fork into the request's samples (sharing every block)."""
    group = seq.group
    seq.key = np.asarray(sequence_key(group.params.seed, group.key_id, seq.sample), np.uint32)
    group.samples[seq.sample] = seq
    self._running.append(seq)
    for j in range(1, seq.fork_n):
      child = _Seq(group, j, list(seq.tokens), seq.arrival, 1)
      child.blocks = list(seq.blocks)
      for b in child.blocks:
        self.allocator.incref(b)
      child.n_computed = seq.n_computed
      child.draft_computed = seq.draft_computed
      child.key = np.asarray(sequence_key(group.params.seed, group.key_id, j), np.uint32)
      group.samples[j] = child
      self._running.append(child)
    seq.fork_n = 1

  # -- memory ------------------------------------------------------------------------------

  def _preempt(self, seq: _Seq) -> None:
    """Frees a sequence's blocks and requeues it for recomputation."""
    log.info("engine: preempting request %r sample %d (%d tokens)", seq.group.request_id,
             seq.sample, len(seq.tokens))
    self.allocator.free_all(seq.blocks)
    seq.blocks, seq.n_computed, seq.draft_computed = [], 0, 0
    seq.preemptions += 1
    self.metrics.preemptions += 1
    if seq in self._running:
      self._running.remove(seq)
    if seq in self._prefilling:
      self._prefilling.remove(seq)
    self._waiting.append(seq)

  def _allocate_for(self, seq: _Seq) -> int | None:
    """A block for `seq`, preempting lower-priority sequences (maybe `seq` itself)."""
    while True:
      try:
        return self.allocator.allocate()
      except OutOfBlocks:
        victim = max(self._running + self._prefilling, key=self._preemption_rank)
        self._preempt(victim)
        if victim is seq:
          return None

  def _preemption_rank(self, seq: _Seq):
    """Higher = preempted first: the latest arrival, or under shortest_budget the most
    remaining steps (then the latest arrival)."""
    if self.config.policy == "shortest_budget":
      return (seq.remaining_budget, seq.arrival)
    return (seq.arrival,)

  def _ensure_blocks(self, seq: _Seq, upto: int, copies: list[tuple[int, int]]) -> bool:
    """Blocks for positions [n_computed, upto) owned by `seq` alone (copy-on-write
    of a shared partial block). False if `seq` itself had to be preempted."""
    bs = self.config.block_size
    first = seq.n_computed // bs
    if first < len(seq.blocks) and self.allocator.is_shared(seq.blocks[first]):
      new = self._allocate_for(seq)
      if new is None:
        return False
      copies.append((seq.blocks[first], new))
      self.allocator.decref(seq.blocks[first])
      seq.blocks[first] = new
    while len(seq.blocks) * bs < upto:
      new = self._allocate_for(seq)
      if new is None:
        return False
      seq.blocks.append(new)
    return True

  def _run_copies(self, copies: list[tuple[int, int]]) -> None:
    """Copy-on-write of blocks (src, dst), in the draft model's pool too."""
    if not copies:
      return
    # One copy per destination, the last planned: a row whose copy was planned can be
    # preempted by a later row's allocation in the same call, and its destination handed
    # out again (as that row's copy destination); a scatter's order over duplicate
    # indices is undefined (on a GPU the stale copy could win).
    copies = list({b: (a, b) for a, b in copies}.values())
    n = pow2_bucket(len(copies), 8)
    src = np.zeros(n, np.int32)
    dst = np.full(n, self.num_blocks, np.int32)
    for i, (a, b) in enumerate(copies):
      src[i], dst[i] = a, b
    src, dst = jnp.asarray(src), jnp.asarray(dst)
    self.cache = self._copy_jit(self.cache, src, dst)
    if self.draft_model is not None:
      self.draft_cache = self._copy_jit(self.draft_cache, src, dst)

  def _decode_rows(self, n: int) -> int:
    """Rows of a decode call for n sequences: the smallest bucket that fits, but never
    more than max_slots (16 slots padded to 32 rows did twice the work per step)."""
    fits = [b for b in self.config.decode_buckets if b >= n]
    return min(min(fits) if fits else pow2_bucket(n), max(n, self.config.max_slots))

  def _table_width(self, seqs: Sequence[_Seq], decode: bool = False,
                   chunk: int = 0) -> int:
    """Block-table width of a call over `seqs`; a prefill call of `chunk` tokens (its
    padded length T) also needs width * block_size >= T, which the rows' own blocks
    do not give when T is padded past them (a non-power-of-two block size: 13 blocks
    of 5 for a 65-token chunk bucketed to 96; a min_chunk_bucket above the rows'
    blocks): every prefill of those failed."""
    need = max(len(s.blocks) for s in seqs)
    # Decode cost grows with the width on the XLA attention path (every row
    # gathers all of it): a CPU step at 12 vs 16 blocks took 41 vs 44 / 86 vs
    # 92 / 190 vs 211 ms at batch 1 / 8 / 32, so decode also uses 3/4 buckets.
    bucket = three_quarter_bucket if decode else pow2_bucket
    width = min(bucket(need, self.config.min_table_blocks), self._table_cap)
    return max(width, pow2_bucket(-(-chunk // self.config.block_size)))

  def _table(self, seqs: Sequence[_Seq], rows: int, decode: bool = False,
             width: int | None = None) -> np.ndarray:
    width = width or self._table_width(seqs, decode)
    tables = np.zeros((rows, width), np.int32)
    for i, s in enumerate(seqs):
      tables[i, :len(s.blocks)] = s.blocks
    return tables

  # -- prefill -----------------------------------------------------------------------------

  def _chunk_bucket(self, n: int) -> int:
    """Length T of a prefill call whose longest row has n tokens (n <= prefill_chunk).
    Powers of two and 3/4 of them: prefill is compute-bound, and 40-token prompts
    padded to 64 wasted 37% of it."""
    cfg = self.config
    return min(three_quarter_bucket(n, cfg.min_chunk_bucket),
               pow2_bucket(cfg.prefill_chunk, cfg.min_chunk_bucket))

  def _prefill_rows(self) -> list[tuple[_Seq, int]]:
    """The rows of the next prefill call, (sequence, prompt tokens it computes): in
    arrival order, at most `prefill_chunk` tokens over at most `max_prefill_seqs` rows.
    A call of several rows is padded to max_prefill_seqs rows of its longest. Of the
    first k sequences taken whole (k = 1 .. max_prefill_seqs), or every sequence cut to
    the longest piece for which max_prefill_seqs rows stay within one chunk's positions,
    the call is the one with the most prompt tokens per cost, a call costing its
    positions plus PREFILL_CALL_OVERHEAD (neither one row per call for chat-length
    prompts, nor a long row padding short ones to 4 x 128 positions)."""
    cfg = self.config
    rows_padded = cfg.max_prefill_seqs
    queue = sorted(self._prefilling, key=lambda s: s.arrival)[:rows_padded]

    def rows_within_budget(limit: int) -> list[tuple[_Seq, int]]:
      rows, budget = [], cfg.prefill_chunk
      for seq in queue:
        if budget <= 0:
          break
        n = min(seq.prefill_target - seq.n_computed, budget, limit)
        rows.append((seq, n))
        budget -= n
      return rows

    def per_cost(rows) -> float:
      padded = 1 if len(rows) == 1 else rows_padded
      positions = padded * self._chunk_bucket(max(n for _, n in rows))
      return sum(n for _, n in rows) / (positions + PREFILL_CALL_OVERHEAD)

    whole = rows_within_budget(cfg.prefill_chunk)
    if not whole:
      return []
    candidates = [whole[:k] for k in range(1, len(whole) + 1)]
    if self._prefill_piece:
      candidates.append(rows_within_budget(self._prefill_piece))
    return max(candidates, key=per_cost)  # ties: the first (fewer rows)

  @functools.cached_property
  def _prefill_piece(self) -> int:
    """The longest piece for which max_prefill_seqs rows stay within one chunk's
    positions (0: none); a constant of the config."""
    rows, one_chunk = self.config.max_prefill_seqs, self._chunk_bucket(self.config.prefill_chunk)
    return next((t for t in range(one_chunk // rows, 0, -1)
                 if rows * self._chunk_bucket(t) <= one_chunk), 0)

  def _prefill_once(self) -> None:
    batch: list[tuple[_Seq, int]] = []
    copies: list[tuple[int, int]] = []
    for seq, n in self._prefill_rows():
      if seq not in self._prefilling:  # preempted while making room for another
        continue
      if self._ensure_blocks(seq, seq.n_computed + n, copies):
        batch.append((seq, n))
    batch = [(s, n) for s, n in batch if s in self._prefilling]
    if not batch:
      return
    self._run_copies(copies)
    # Two row counts only: one sequence, or the full prefill batch.
    seqs = [s for s, _ in batch]
    # (Every recorded shape holds its chunk in its width, so a rented bigger one does too.)
    t = self._chunk_bucket(max(n for _, n in batch))
    wanted = (1 if len(batch) == 1 else self.config.max_prefill_seqs, t,
              self._table_width(seqs, chunk=t))
    shape = self._prefill_shapes.choose(wanted) if self._prefill_shapes else wanted
    rows, t, width = shape
    tokens = np.zeros((rows, t), np.int32)
    starts = np.zeros(rows, np.int32)
    lens = np.zeros(rows, np.int32)
    for i, (s, n) in enumerate(batch):
      tokens[i, :n] = s.tokens[s.n_computed:s.n_computed + n]
      starts[i], lens[i] = s.n_computed, n
    tables = self._table(seqs, rows, width=width)
    traces, start = self.trace_counts["prefill"], self.clock()
    self.cache = self.prefill(self.cache, jnp.asarray(tokens), jnp.asarray(starts),
                              jnp.asarray(lens), jnp.asarray(tables))
    if self._prefill_shapes is not None:
      self._observe_prefill(shape, start, compiled=self.trace_counts["prefill"] > traces)
    for s, n in batch:
      s.n_computed += n
      self.allocator.register_prefix(s.tokens, s.blocks, s.n_computed)
      if s.n_computed >= s.prefill_target:
        s.pending_keys = set()
        self._prefilling.remove(s)
        self._start_decoding(s)

  def _observe_prefill(self, shape, start: float, compiled: bool) -> None:
    """Feeds the shape plan: a compile's cost (the dispatch: the run is asynchronous),
    and the first runs of each shape (one sync each: the device is idle at a prefill's
    dispatch, the previous decode call having returned its tokens)."""
    plan = self._prefill_shapes
    if compiled:
      start_run = self.clock()
      plan.observe_compile(shape, start_run - start)
      start = start_run
    if plan.wants_timing(shape):
      jax.block_until_ready(self.cache)
      plan.observe_run(shape, self.clock() - start)

  # -- decode ------------------------------------------------------------------------------

  def _decode_once(self) -> None:
    running = sorted(self._running, key=lambda s: s.arrival)
    if not running:
      return
    # The planner times whole calls, host work included (drafting, tables, appending):
    # a verify call returns to the host for every few tokens, a plain one every 8 steps.
    if self._planner is not None:
      # The planner times the call, not the prefill chunk dispatched before it (some
      # calls wait for one, some not: verify and plain timings would mix the two).
      waited = self.clock()
      jax.block_until_ready(self.cache)
      self.metrics.decode_seconds += self.clock() - waited  # as the call would have waited
    call_start, call_traces = self.clock(), sum(self.trace_counts.values())
    if self.speculative is not None and self._speculate_once(running, call_start):
      return
    iterations = self._call_iterations(running)
    fixed = steps.fixed_trip_loops()
    if fixed:  # a loop of fixed trips runs them all: a power of two at most (1/2/4/8 programs)
      iterations = 1 << (iterations.bit_length() - 1)
    num_steps = iterations if fixed else self.config.decode_steps
    copies: list[tuple[int, int]] = []
    limits = {}
    for seq in running:
      if seq in self._running:
        limits[seq] = self._row_limit(seq, iterations)
        # Blocks for every position the call may write: len(tokens) - 1 onwards.
        self._ensure_blocks(seq, len(seq.tokens) + limits[seq] - 1, copies)
    seqs = sorted(self._running, key=lambda s: s.arrival)
    if not seqs:
      return
    self._run_copies(copies)
    self.metrics.set_blocks(self.allocator.num_used, self.num_blocks)  # the call's peak
    rows, width = self._decode_rows(len(seqs)), self._table_width(seqs, decode=True)
    planned_rows = rows  # (planner: verify vs plain)
    statics = (*self._decode_statics(seqs), num_steps)
    if self._decode_shapes is not None:  # (other statics are other programs: `decode_fits`)
      rows, width, *statics = self._decode_shapes.choose((rows, width, *statics),
                                                          repeats=iterations)
    batch, stop_ids, top_n = self._decode_batch(seqs, rows, width, tuple(statics))
    row_limits = np.zeros(rows, np.int32)
    row_limits[:len(seqs)] = [limits[s] for s in seqs]
    start, traces = self.clock(), self.trace_counts["decode"]
    out, self.cache = self.decode(self.cache, batch, jnp.asarray(row_limits), jnp.asarray(stop_ids),
                                  iterations, top_n, num_steps, fixed)
    dispatched = self.clock()
    out = jax.device_get(out)
    end = self.clock()
    if self._decode_shapes is not None:  # (a prefill chunk dispatched before is in `end -
      # start`: the padding is overestimated, so the plan compiles sooner, not later)
      shape, compiled = (rows, width, *statics), self.trace_counts["decode"] > traces
      if compiled:
        self._decode_shapes.observe_compile(shape, dispatched - start)
    # Steps that took tokens; the device ran `trips` (fixed trips: idle ones too, the
    # call's time is theirs: costs per step divide by them).
    ran = max(int(out.iterations), 1)
    trips = num_steps if fixed else ran
    if self._decode_shapes is not None:
      self._decode_shapes.observe_run(shape, end - (dispatched if compiled else start),
                                      repeats=trips)
    # Per-token times: step j of the call ends at (j + 1) / trips of its wall time.
    if self.budget is not None:
      self.budget.observe_step((end - start) / trips)
    self.metrics.decode_calls += 1
    self.metrics.decode_steps += ran
    self.metrics.decode_seconds += end - start
    times = [start + (end - start) * (j + 1) / trips for j in range(ran)]
    for i, s in enumerate(seqs):
      for j in range(int(out.counts[i])):
        s.n_computed = len(s.tokens)
        self._append(s, int(out.tokens[j, i]), float(out.logprobs[j, i]),
                     out.top_ids[j, i], out.top_logprobs[j, i], times[j])
        if s.finish_reason is not None:
          break  # a stop string: what the row sampled past it is dropped
    if self._planner is not None and sum(self.trace_counts.values()) == call_traces:
      self._planner.observe(planned_rows, 0, (self.clock() - call_start) / trips,  # (not compiling)
                            single=iterations == 1, steps=trips)

  def _decode_statics(self, seqs: Sequence[_Seq]) -> tuple[int, int, str]:
    """The stop-id width, top-K alternatives and draw kind (`steps.DRAW_KINDS`) of a
    decode call over `seqs`."""
    stop_width = pow2_bucket(max(len(s.group.stop_ids) for s in seqs), 8)
    params = [s.group.params for s in seqs]
    want_top = max(p.top_logprobs for p in params)
    kind = steps.draw_kind([p.temperature for p in params], [p.top_k for p in params],
                           [p.top_p for p in params], [p.min_p for p in params],
                           self.model_config.vocab_size)
    return stop_width, self.config.max_top_logprobs if want_top else 0, kind

  def _decode_batch(self, seqs: Sequence[_Seq], rows: int, width: int | None = None,
                    statics: tuple[int, int, str] | None = None):
    """The decode inputs of `seqs` in `rows` slots (`width`: the table's, default its
    bucket; `statics`: `_decode_statics(seqs)` when known): (DecodeBatch, stop ids
    [rows, S] (-1 pads), the top-K alternatives the call computes)."""
    f32, i32 = np.float32, np.int32
    tokens, positions, steps_ = (np.zeros(rows, i32) for _ in range(3))
    active = np.zeros(rows, bool)
    keys = np.zeros((rows, 2), np.uint32)
    temperature, top_p, min_p = np.zeros(rows, f32), np.ones(rows, f32), np.zeros(rows, f32)
    top_k = np.zeros(rows, i32)
    stop_lists = [s.group.stop_ids for s in seqs]
    stop_width, top_n, kind = (statics or self._decode_statics(seqs))[:3]
    stop_ids = np.full((rows, stop_width), -1, i32)
    for i, s in enumerate(seqs):
      p = s.group.params
      tokens[i], positions[i], steps_[i], active[i] = s.tokens[-1], len(s.tokens) - 1, len(s.generated), True
      stop_ids[i, :len(stop_lists[i])] = stop_lists[i]
      keys[i] = s.key
      temperature[i], top_k[i], top_p[i], min_p[i] = p.temperature, p.top_k, p.top_p, p.min_p
    batch = steps.DecodeBatch(
        tokens=jnp.asarray(tokens), positions=jnp.asarray(positions), active=jnp.asarray(active),
        block_tables=jnp.asarray(self._table(seqs, rows, decode=True, width=width)),
        keys=jnp.asarray(keys),
        steps=jnp.asarray(steps_), temperature=jnp.asarray(temperature), top_k=jnp.asarray(top_k),
        top_p=jnp.asarray(top_p), min_p=jnp.asarray(min_p), draw_kind=kind)
    return batch, stop_ids, top_n

  def _speculate_once(self, running: Sequence[_Seq], call_start: float) -> bool:
    """One verify call over drafted tokens, if the planner expects it to pay (see
    engine/speculative.py). False: nothing ran (decode normally).

    1. drafts per row: prompt lookup on the host, or (early exit, draft model) on
       the device, at most the row's budget - 1 and what its context (and the
       draft model's) has room for;
    2. K from the planner (0: no speculation this call);
    3. blocks for the K + 1 positions each row writes; a draft model first catches
       up (`_catch_up_draft`) and drafts; verify (`steps.verify_step`);
    4. append the emitted tokens (stops as in decoding), update each row's
       acceptance, and roll back: blocks past the row's last token are freed
       (the rejected drafts' K/V in its last block is overwritten later).
    The call's time (for the planner) includes the catch-up and drafting."""
    cfg = self.speculative
    call_traces = sum(self.trace_counts.values())
    context = self._draft_context if cfg.drafter == "draft_model" else self.max_context
    room = {s: max(0, min(cfg.max_drafts, s.remaining_budget - 1, context - len(s.tokens)))
            for s in running}
    if cfg.drafter == "prompt_lookup":
      proposals = {s: prompt_lookup(s.tokens, room[s], cfg.ngram_max, cfg.ngram_min)
                   for s in running}
      available = {s: len(proposals[s]) for s in running}
    else:
      proposals, available = None, room
    # Draft-model tokens each row must catch up over before drafting (its prompt, or
    # what plain decoding added): a one-off cost the planner weighs against what the
    # row's remaining budget can win back.
    behind = {s: self._draft_behind(s) if cfg.drafter == "draft_model" else 0 for s in running}
    rows, single = self._decode_rows(len(running)), self._call_iterations(running) == 1
    k = self._planner.choose(rows, [available[s] for s in running],
                             [self._planner.rate(s.acceptance) for s in running],
                             [behind[s] for s in running], [s.remaining_budget for s in running],
                             single=single, draining=not self._waiting,
                             pending=self._prefill_calls_ahead(),
                             optimistic=[self._planner.rate(s.acceptance, optimistic=True)
                                         for s in running])
    drafting = dict(zip(running, self._planner.drafting(rows, k, [behind[s] for s in running],
                                                        single)))
    if k == 0:
      for seq in running:
        seq.acceptance.idle()
      return False
    copies: list[tuple[int, int]] = []
    for seq in running:
      if seq in self._running:
        self._ensure_blocks(seq, len(seq.tokens) + min(k, available[seq]), copies)
    seqs = sorted(self._running, key=lambda s: s.arrival)
    if not seqs:
      return True
    self._run_copies(copies)
    self.metrics.set_blocks(self.allocator.num_used, self.num_blocks)
    rows = self._decode_rows(len(seqs))
    batch, _, top_n = self._decode_batch(seqs, rows)
    num_drafts = np.zeros(rows, np.int32)
    drafts = np.zeros((rows, k), np.int32)
    for i, s in enumerate(seqs):
      num_drafts[i] = min(k, available[s]) if drafting[s] else 0
      if proposals is not None:
        drafts[i, :num_drafts[i]] = proposals[s][:num_drafts[i]]
    start, sunk = self.clock(), 0.0
    drafts_dev = jnp.asarray(drafts)
    draft_batch = batch.replace(draw_kind="any")  # drafts are greedy: one program for every kind
    if cfg.drafter == "early_exit":
      head_t = self._head_t if rows >= 8 else None
      drafts_dev, self.cache = self._draft_jit(self._state_leaves, self.cache, draft_batch,
                                               jnp.asarray(num_drafts), k, self._exit_layer, head_t)
    elif cfg.drafter == "draft_model":
      # A catch-up is a one-off cost (a prompt, or what plain decoding added), timed on
      # its own: the planner charges it per row (`choose`), not to the call's shape.
      caught_up, sunk = self._catch_up_draft([s for i, s in enumerate(seqs) if num_drafts[i]])
      if caught_up and sum(self.trace_counts.values()) == call_traces:
        self._planner.observe_catch_up(caught_up, sunk)
      head_t = self._draft_head_t if rows >= 8 else None
      prev = np.zeros(rows, np.int32)  # the token before each row's last
      prev[:len(seqs)] = [s.tokens[-2] if len(s.tokens) > 1 else 0 for s in seqs]
      drafts_dev, self.draft_cache = self._draft_model_jit(
          self._draft_leaves, self.draft_cache, draft_batch, jnp.asarray(num_drafts), k, None,
          head_t, jnp.asarray(prev))
    head_t = self._head_t if rows * (k + 1) >= 8 else None
    out, self.cache = self._verify_jit(self._state_leaves, self.cache, batch, drafts_dev,
                                       jnp.asarray(num_drafts), top_n, head_t)
    out = jax.device_get(out)
    end = self.clock()
    if self.budget is not None:
      self.budget.observe_step(end - start)
    self.metrics.decode_calls += 1
    self.metrics.decode_steps += 1
    self.metrics.decode_seconds += end - start
    self.metrics.spec_calls += 1
    for i, s in enumerate(seqs):
      count, drafted, last = int(out.counts[i]), int(num_drafts[i]), len(s.tokens) - 1
      # (the planner learns the drafter's matches; a stop ending the sample is no miss)
      self._planner.record(s.acceptance, drafted, count - 1)
      kept = 0
      for j in range(count):
        s.n_computed = len(s.tokens)
        self._append(s, int(out.tokens[i, j]), float(out.logprobs[i, j]), out.top_ids[i, j],
                     out.top_logprobs[i, j], start + (end - start) * (j + 1) / count)
        kept += 1
        if s.finish_reason is not None:
          break
      # Accepted: the drafts the sample kept (matched drafts past its stop are not in it).
      accepted = min(count - 1, kept)
      self.metrics.spec_drafted += drafted
      self.metrics.spec_accepted += accepted
      s.group.metrics.spec_drafted += drafted
      s.group.metrics.spec_accepted += accepted
      if s.finish_reason is None:
        keep = math.ceil(len(s.tokens) / self.config.block_size)
        self.allocator.free_all(s.blocks[keep:])
        del s.blocks[keep:]
      if self.draft_model is not None and drafted:
        # The draft call wrote positions .. last + drafted - 1, for the inputs
        # (.., last token, d1 .. d_{drafted-1}): those up to the accepted ones are right.
        s.draft_computed = min(last + min(count - 1, drafted - 1) + 1, len(s.tokens) - 1)
    if sum(self.trace_counts.values()) == call_traces:  # a call that compiled is not timed
      emitted = sum(int(c) for c in out.counts[:len(seqs)]) / len(seqs)  # per running row
      self._planner.observe(rows, k, self.clock() - call_start - sunk, single=single,
                            one_off=sunk, emitted=emitted)
    return True

  @staticmethod
  def _draft_behind(seq: _Seq) -> int:
    """Tokens the draft model must see before `seq` drafts: the draft call's first
    step feeds the row's last two tokens, so its K/V must reach len(tokens) - 2."""
    return max(0, len(seq.tokens) - 2 - seq.draft_computed)

  def _catch_up_draft(self, seqs: Sequence[_Seq]) -> tuple[int, float]:
    """Draft-model K/V up to (not including) the last two tokens of each of `seqs`:
    draft-model prefill calls over only the rows behind (rows bucketed as decode
    rows), up to prefill_chunk tokens per row a call, lengths bucketed as the
    engine's prefill. Returns (tokens computed, seconds: the calls are awaited, so
    the one-off cost is measured apart from the verify call's)."""
    behind = [s for s in seqs if self._draft_behind(s) > 0]
    if not behind:
      return 0, 0.0
    start, total = self.clock(), 0
    rows = self._decode_rows(len(behind))
    chunk = self._chunk_bucket(min(max(self._draft_behind(s) for s in behind),
                                   self.config.prefill_chunk))
    tables = jnp.asarray(self._table(behind, rows,
                                     width=self._table_width(behind, chunk=chunk)))
    while any(self._draft_behind(s) > 0 for s in behind):
      lens = np.zeros(rows, np.int32)
      lens[:len(behind)] = [min(self._draft_behind(s), self.config.prefill_chunk) for s in behind]
      tokens = np.zeros((rows, self._chunk_bucket(int(lens.max()))), np.int32)
      starts = np.zeros(rows, np.int32)
      for i, s in enumerate(behind):
        n = int(lens[i])
        tokens[i, :n] = s.tokens[s.draft_computed:s.draft_computed + n]
        starts[i] = s.draft_computed
        s.draft_computed += n
      total += int(lens.sum())
      self.draft_cache = self._draft_prefill_jit(self._draft_leaves, self.draft_cache,
                                                 jnp.asarray(tokens), jnp.asarray(starts),
                                                 jnp.asarray(lens), tables)
    jax.block_until_ready(self.draft_cache)
    return total, self.clock() - start

  def _prefill_calls_ahead(self) -> list[int]:
    """Per prefilling sequence (in the order prefill serves them): the calls it has
    ahead, one per prefill chunk until its prompt is in, then one per token of its
    budget (decode steps at the least)."""
    ahead, out = 0, []
    for seq in sorted(self._prefilling, key=lambda s: s.arrival):
      ahead += seq.prefill_target - seq.n_computed
      out.append(-(-ahead // self.config.prefill_chunk) + seq.remaining_budget)
    return out

  def _filling(self) -> bool:
    """Requests are prefilling, or waiting while a slot is free: the batch grows."""
    free = self._slots_in_use() < self.config.max_slots
    return bool(self._prefilling) or bool(self._waiting and free)

  def _call_iterations(self, running: Sequence[_Seq]) -> int:
    """Decode steps for the next call (see the module doc)."""
    if self._filling():
      return 1
    steps_ = self.config.decode_steps
    if self._waiting:  # requests wait for a slot: stop when the first row's budget ends
      steps_ = min([steps_] + [self._row_limit(s, steps_) for s in running])
    return steps_

  def _row_limit(self, seq: _Seq, iterations: int) -> int:
    """Tokens `seq` may sample in a call of `iterations` steps: budget and context."""
    return max(1, min(iterations, seq.remaining_budget, self.max_context - len(seq.tokens)))

  def _append(self, seq: _Seq, token: int, logprob: float, top_ids, top_lps, now: float) -> None:
    """Records a sampled token and finishes the sequence when a stop rule fires."""
    group, p = seq.group, seq.group.params
    group.metrics.record_token(seq.sample, now)
    reason = None
    appended = not ((token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids)
    if not math.isfinite(logprob):
      # NaN/inf logits (weights or activations that overflow) draw an arbitrary token
      # (greedy took the last id over and over): the sample ends here, marked.
      appended, reason = False, "error"
      if not self._warned_nonfinite:
        self._warned_nonfinite = True
        log.warning("engine: the model's logits were not finite (NaN or inf) for request %r "
                    "after %d tokens: its weights or activations overflow; such samples end "
                    "with finish_reason 'error'", group.request_id, len(seq.generated))
    elif not appended:
      reason = "stop"  # eos / stop ids end the sample and are not part of its output
    else:
      seq.generated.append(token)
      seq.tokens.append(token)
      seq.logprob_sum += float(logprob)
      if p.logprobs or p.top_logprobs:
        seq.logprobs.append(logprob)
      if p.top_logprobs:
        seq.top.append([(int(a), float(b)) for a, b in zip(top_ids[:p.top_logprobs],
                                                           top_lps[:p.top_logprobs])])
      if self.thinking is not None:
        self._span(seq).update(seq.generated)
      if p.stop and self._hits_stop(seq):
        reason = "stop"
      elif len(seq.generated) >= group.limit or len(seq.tokens) >= self.max_context:
        reason = "length"
    if group.events is not None:
      self._emit(seq, token if appended else None, logprob, reason)
    if reason is not None:
      self._finish(seq, reason, sampled=True)

  def _span(self, seq: _Seq) -> SpanReader:
    if seq.span is None:
      seq.span = SpanReader(self.thinking, self.tokenizer.decode, seq.group.prompt_ids)
    return seq.span

  def _hits_stop(self, seq: _Seq) -> bool:
    """The last token completes a stop string in the sample's text (`_text`'s text)."""
    return thinking_lib.hits_stop(seq.span, seq.generated, seq.group.params.stop,
                                  self._visible, self.tokenizer.decode,
                                  before=seq.group.prompt_ids[-1])

  def _visible(self, ids: Sequence[int], before: int | None = None) -> str:
    """Text of `ids` without special tokens; with `before`, as the continuation of that
    token (`Tokenizer.continuation`)."""
    return continuation_text(self.tokenizer, ids, before, skip_special=True)

  def _text(self, seq: _Seq, final: bool = True) -> str:
    text = thinking_lib.answer_text(seq.span, seq.generated, self._visible,
                                    before=seq.group.prompt_ids[-1])
    return thinking_lib.cut_at_stop(text, seq.group.params.stop, final)

  def _emit(self, seq: _Seq, token: int | None, logprob: float, reason: str | None) -> None:
    text = self._text(seq, final=reason is not None)
    if reason is None:
      # Hold back what may still change: an unfinished UTF-8 character (decoded as
      # U+FFFD for now), and before it the start of a stop string (cut if it completes:
      # a stop string may go on through that character).
      text = text.rstrip("\ufffd")
      hold = max((_stop_prefix_at_end(text, s) for s in seq.group.params.stop), default=0)
      text = text[:len(text) - hold]
    delta, seq.text_len = text[seq.text_len:], max(len(text), seq.text_len)
    seq.group.events.append(StreamEvent(sample=seq.sample, token_id=token, text=delta,
                                        logprob=logprob if token is not None else None,
                                        finish_reason=reason))

  def _finish(self, seq: _Seq, reason: str, sampled: bool = False) -> None:
    """`sampled`: finished by the token it just recorded; then the request ends when its
    last token was sampled (its latency is the sum of its token times, not that plus the
    host's work on the rows before it), else (stopped from outside a step) now."""
    seq.finish_reason = reason
    if self.thinking is not None:
      self._span(seq).finish(seq.generated)
    # (a preempted sample waits: `_apply_budget` stops it there; _Seq compares by identity)
    next(q for q in (self._running, self._prefilling, self._waiting) if seq in q).remove(seq)
    self.allocator.free_all(seq.blocks)
    seq.blocks = []
    group = seq.group
    group.unfinished -= 1
    if group.unfinished == 0:
      # The latest over its samples: a row processed later may have sampled earlier.
      group.metrics.finish = (max(t[-1] for t in group.metrics.token_times if t) if sampled
                              else self.clock())
      self.metrics.add_request(group.metrics)
      if self.budget is not None:
        self.budget.observe_request(group.metrics.e2e)

  def result(self, group: _Group) -> RequestResult:
    """The result of a finished request queued with `add_request` (the engine forgets it)."""
    with self._lock:
      self._own(group)
      return self._result(group)

  def _result(self, group: _Group) -> RequestResult:
    if group not in self._groups:
      raise ValueError(f"request {group.request_id!r} was cancelled or its result was already "
                       f"collected")
    if group.unfinished:
      raise ValueError(f"request {group.request_id!r} has {group.unfinished} unfinished samples")
    self._groups.remove(group)
    p = group.params
    samples = [SampleResult(index=s.sample, text=self._text(s), token_ids=list(s.generated),
                            finish_reason=s.finish_reason,
                            logprobs=list(s.logprobs) if (p.logprobs or p.top_logprobs) else None,
                            top_logprobs=list(s.top) if p.top_logprobs else None,
                            preemptions=s.preemptions,
                            thinking=None if s.span is None else s.span.thinking_text(s.generated),
                            thinking_tokens=0 if s.span is None else s.span.thinking_tokens(
                                s.generated))
               for s in group.samples]
    return RequestResult(request_id=group.request_id, prompt_token_ids=list(group.prompt_ids),
                         samples=samples, metrics=group.metrics)
