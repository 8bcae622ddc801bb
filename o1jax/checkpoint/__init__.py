"""Checkpoint import: GGUF, HF safetensors, orbax; tokenizer and chat template."""

from o1jax.checkpoint.embedded import embedded_model_path
from o1jax.checkpoint.errors import CheckpointError
from o1jax.checkpoint.loader import (EMBEDDED, LoadedCheckpoint, check_checkpoint,
                                     load_checkpoint, load_tokenizer)
from o1jax.checkpoint.model_config import ModelConfig
from o1jax.checkpoint.tokenizer import Tokenizer
