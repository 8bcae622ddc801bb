"""Flax Llama-family model, sampling and simple generation."""

from o1jax.checkpoint.model_config import ModelConfig
from o1jax.model.generation import GenerationOutput, Generator
from o1jax.model.llama import KVCache, Llama
from o1jax.model.sampling import SamplingParams
from o1jax.model import thinking
from o1jax.model.thinking import SpanReader, ThinkingSpan
