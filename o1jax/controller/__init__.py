"""Reasoning controller: think / verify / backtrack as one jitted while_loop, and policies.

Public API (see docs/controller.md):

  from o1jax.controller import Controller, ContiguousLlama, get_policy
  ctl = Controller(ContiguousLlama(llama), tokenizer)  # or PagedLlama(llama): shared KV blocks
  results = ctl.run(prompts_or_requests, get_policy("self_consistency", n=8))
  results = ctl.run(requests, {"name": "deepconf", "n": 16, "warmup": 4})  # dict / ConfigDict
  results[0].answer, results[0].tokens.to_dict(), results[0].traces[0].steps

Data flow: request -> Policy.run -> Controller.generate (prefill, share the prompt, jitted
ReasoningLoop.run, decode traces) -> aggregation (vote / best / threshold) ->
ReasoningResult (answer, every trace with its steps, token accounting, wall time).

Policies by name (registry.py) in one namespace: the reasoning policies above
(policies.py) and plain sampling, run one sample at a time by the engine
(sampling_policies.py: `greedy`, `sample_n`).

Extending: a Verifier (verifiers.py, `register_verifier`), a host scorer
(`register_scorer`), or a Policy (policies.py, `@register`); all by name in configs,
once the module defining them is imported (a pipeline config's `imports`).
"""

from o1jax.controller.answers import extract_number, majority_vote, weighted_vote
from o1jax.controller.controller import Batch, Controller, LoopSettings
from o1jax.controller.cache_config import build_decode_model
from o1jax.controller.decode_model import CacheConfig, CachePlan, ContiguousLlama, DecodeModel
from o1jax.controller.loop import ReasoningLoop
from o1jax.controller.paged_model import PagedCache, PagedCacheOverflow, PagedLlama
from o1jax.controller.policies import (BestOfN, BudgetForcing, DeepConf, GreedyCoT, Policy,
                                       SelfConsistency, ThinkVerifyBacktrack)
from o1jax.controller.registry import (POLICIES, BasePolicy, build_policy, get_policy, policy_class,
                                       policy_defaults, policy_names, register)
from o1jax.controller.results import (ReasoningRequest, ReasoningResult, StepRecord, TokenCounts,
                                      Trace)
from o1jax.controller.sampling_policies import Greedy, SampleN, SamplingSpec
from o1jax.controller.state import Knobs, ReasoningState
from o1jax.engine.budget import BudgetConfig, BudgetLoop, allocate_budget
from o1jax.controller.verifiers import (SCORERS, VERIFIERS, GroupConfidence, LowestGroupConfidence,
                                        MeanLogprob, SelfVerify, StepStats, Verifier, get_verifier,
                                        register_scorer, register_verifier)
