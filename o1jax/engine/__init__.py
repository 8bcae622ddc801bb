"""Serving engine: paged KV cache, continuous batching, chunked prefill, metrics."""

from o1jax.engine.allocator import BlockAllocator, OutOfBlocks
from o1jax.engine.budget import (BudgetConfig, BudgetLoop, Decision, LatencyWindow,
                                 allocate_budget, measured_load, token_limit)
from o1jax.engine.engine import (Engine, EngineConfig, GenerationParams, Request, RequestResult,
                                 SampleResult, StreamEvent)
from o1jax.engine.kv_cache import (BlockState, PagedKVCache, copy_blocks,
                                   reserve_for_append, share_rows, truncate_rows)
from o1jax.engine.metrics import LatencyHistogram, MetricsCollector, RequestMetrics
from o1jax.engine.replicas import EngineReplicas, build_engine, replica_meshes
from o1jax.engine.speculative import (DRAFTERS, SpeculationPlanner, SpeculativeConfig,
                                      expected_tokens, prompt_lookup)
from o1jax.engine.steps import (DecodeBatch, Draw, LoopOutput, PlainRows, RowProgram, VerifyOutput,
                                decode_iteration, decode_loop, draft_greedy, draw_tokens,
                                prefill_step, run_rows, verify_step)
