"""Errors raised while reading checkpoints: each names the file/tensor at fault."""


class CheckpointError(ValueError):
  """A checkpoint cannot be read: missing, corrupt or unsupported."""
