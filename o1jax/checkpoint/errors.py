"""Errors raised while reading checkpoints: each names the file/tensor at fault."""

import json
import pathlib


class CheckpointError(ValueError):
  """A checkpoint cannot be read: missing, corrupt or unsupported."""


def read_json_object(path: pathlib.Path) -> dict:
  """A checkpoint's JSON file (config.json, tokenizer_config.json) as a dict; a file that
  does not parse, or holds no object, raises `CheckpointError` naming it."""
  try:
    value = json.loads(path.read_text())
  except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, deep nesting
    raise CheckpointError(f"{path}: not valid JSON ({e})") from e
  if not isinstance(value, dict):
    raise CheckpointError(f"{path}: expected a JSON object, got {type(value).__name__}")
  return value
