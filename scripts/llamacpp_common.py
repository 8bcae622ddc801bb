"""What the scripts that run llama.cpp (llama-cpp-python: the `reference` extra) share.

Imported by name from the scripts beside it (a script's own directory is on sys.path
when it runs as `python scripts/NAME.py`).
"""

from __future__ import annotations

import sys


def disable_extra_buffer_types() -> None:
  """Make Llama() load weights without ggml's CPU "extra" buffer types.

  Extra buffer types (AMX tiles, weight repacking) change the kernel used for the
  quantized matmuls, and the AMX one crashes where the OS does not grant AMX tile
  state (seen in sandboxes). Llama() has no argument for this, so the function it gets
  its default model params from is wrapped (once; later calls change nothing)."""
  import llama_cpp.llama_cpp as low
  defaults = low.llama_model_default_params
  if getattr(defaults, "without_extra_buffers", False):
    return

  def without_extra_buffers():
    params = defaults()
    params.use_extra_bufts = False
    return params

  without_extra_buffers.without_extra_buffers = True
  low.llama_model_default_params = without_extra_buffers


def require_llama_cpp() -> bool:
  """True when llama_cpp imports; else says which extra installs it (stderr)."""
  try:
    import llama_cpp  # noqa: F401
  except ImportError as e:
    print(f"needs llama-cpp-python (pip install -e '.[reference]'): {e}", file=sys.stderr)
    return False
  return True
