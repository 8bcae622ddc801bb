"""Errors raised while reading (or writing) checkpoints: each names the file/tensor at fault."""

import json
import pathlib


class CheckpointError(ValueError):
  """A checkpoint cannot be read: missing, corrupt or unsupported."""


def read_json_object(path: pathlib.Path) -> dict:
  """A checkpoint's JSON file (config.json, tokenizer_config.json) as a dict; a file that
  does not parse, or holds no object, raises `CheckpointError` naming it."""
  if not path.is_file():  # (a directory raised IsADirectoryError; a FIFO blocked the read)
    raise CheckpointError(f"{path}: not a regular file")
  try:
    value = json.loads(path.read_text())
  except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, deep nesting
    raise CheckpointError(f"{path}: not valid JSON ({e})") from e
  except OSError as e:  # unreadable
    raise CheckpointError(f"{path}: cannot be read ({e.strerror or e})") from e
  if not isinstance(value, dict):
    raise CheckpointError(f"{path}: expected a JSON object, got {type(value).__name__}")
  return value


def new_checkpoint_dir(directory) -> pathlib.Path:
  """The directory a converted checkpoint is written to, created: it must not exist or be
  empty (a save into a model's directory overwrote its config.json and tokenizer files).
  Each problem is a `CheckpointError` naming the path."""
  if not str(directory).strip():  # "" is the current directory
    raise CheckpointError("destination is empty: name the directory to write the checkpoint to")
  path = pathlib.Path(directory).expanduser().absolute()
  if path.exists() and not path.is_dir():
    raise CheckpointError(f"{path}: destination is a file, not a directory")
  if path.is_dir() and any(path.iterdir()):
    raise CheckpointError(f"{path}: destination exists and is not empty")
  try:
    path.mkdir(parents=True, exist_ok=True)
  except OSError as e:  # a file in the way above it, no permission, a read-only place
    raise CheckpointError(f"{path}: cannot create the destination: {e.strerror or e}") from e
  return path
