"""Host-side block allocator: free list, reference counts, prefix cache.

The engine's scheduler owns one `BlockAllocator`. A sequence holds a list of
physical block ids (its block table); sharing a block = raising its count.

Prefix cache: a full block is keyed by its whole token prefix (the key of the
block before it plus its own tokens), so two prompts that start with the same
few-shot text map to the same blocks. A cached block whose count drops to 0 is
not freed but parked in an LRU list; `allocate` reuses free blocks first and
evicts the least recently used parked block only when none are left.
"""

from __future__ import annotations

import collections
from typing import Hashable, Sequence

import numpy as np

ROOT_KEY: Hashable = ()


class OutOfBlocks(Exception):
  """No free or evictable block: the scheduler must preempt a sequence."""


class BlockAllocator:
  """Reference-counted pool of `num_blocks` blocks of `block_size` tokens."""

  def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = True):
    if num_blocks < 1 or block_size < 1:
      raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be >= 1")
    self.num_blocks = num_blocks
    self.block_size = block_size
    self.prefix_caching = prefix_caching
    self.refcounts = np.zeros(num_blocks, np.int32)
    self._free = collections.deque(range(num_blocks))
    self._parked: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU, count 0
    self._key_of: dict[int, Hashable] = {}
    self._block_of: dict[Hashable, int] = {}

  # -- counts ---------------------------------------------------------------------

  @property
  def num_free(self) -> int:
    """Blocks `allocate` can hand out (free + parked prefix blocks)."""
    return len(self._free) + len(self._parked)

  @property
  def num_used(self) -> int:
    return self.num_blocks - self.num_free

  def allocate(self) -> int:
    """A block with count 1. Raises OutOfBlocks when none is free or evictable."""
    if self._free:
      block = self._free.popleft()
    elif self._parked:
      block, _ = self._parked.popitem(last=False)
      self._forget(block)
    else:
      raise OutOfBlocks(f"all {self.num_blocks} KV blocks are in use")
    self.refcounts[block] = 1
    return block

  def incref(self, block: int) -> None:
    if self.refcounts[block] == 0:
      self._parked.pop(block, None)
    self.refcounts[block] += 1

  def decref(self, block: int) -> None:
    if self.refcounts[block] <= 0:
      raise AssertionError(f"block {block} freed twice")
    self.refcounts[block] -= 1
    if self.refcounts[block] == 0:
      if block in self._key_of:
        self._parked[block] = None
      else:
        self._free.append(block)

  def free_all(self, blocks: Sequence[int]) -> None:
    for b in blocks:
      self.decref(b)

  def is_shared(self, block: int) -> bool:
    """Writing into this block needs a private copy (shared or in the prefix cache)."""
    return self.refcounts[block] > 1 or block in self._key_of

  # -- prefix cache ---------------------------------------------------------------

  def _forget(self, block: int) -> None:
    key = self._key_of.pop(block, None)
    if key is not None and self._block_of.get(key) == block:
      del self._block_of[key]

  def block_keys(self, tokens: Sequence[int], n_full: int) -> list[Hashable]:
    """Keys of the first n_full full blocks of `tokens` (each covers the whole prefix)."""
    keys, key, bs = [], ROOT_KEY, self.block_size
    for i in range(n_full):
      key = (hash(key), tuple(tokens[i * bs:(i + 1) * bs]))
      keys.append(key)
    return keys

  def _cached_blocks(self, tokens: Sequence[int], limit: int) -> list[int]:
    """Cached blocks for the longest run of full blocks within tokens[:limit]."""
    blocks = []
    if self.prefix_caching:
      for key in self.block_keys(tokens, limit // self.block_size):
        block = self._block_of.get(key)
        if block is None or self._key_of.get(block) != key:
          break
        blocks.append(block)
    return blocks

  def cached_prefix(self, tokens: Sequence[int], limit: int) -> int:
    """How many blocks `match_prefix` would return (no counts taken)."""
    return len(self._cached_blocks(tokens, limit))

  def match_prefix(self, tokens: Sequence[int], limit: int) -> list[int]:
    """Cached blocks for the longest run of full blocks within tokens[:limit].

    The returned blocks are counted (incref'd) for the caller."""
    blocks = self._cached_blocks(tokens, limit)
    for block in blocks:
      self.incref(block)
    return blocks

  def register_prefix(self, tokens: Sequence[int], blocks: Sequence[int], n_computed: int) -> None:
    """Offers the full, computed blocks of a sequence to the prefix cache."""
    if not self.prefix_caching:
      return
    n_full = min(n_computed // self.block_size, len(blocks))
    for key, block in zip(self.block_keys(tokens, n_full), blocks):
      if key in self._block_of or block in self._key_of:
        continue  # already cached (maybe under another block): keep the first
      self._key_of[block] = key
      self._block_of[key] = block

  def unregister(self, block: int) -> None:
    """Drops a block from the prefix cache (before its contents change)."""
    if block in self._key_of:
      self._forget(block)
      self._parked.pop(block, None)
      if self.refcounts[block] == 0:
        self._free.append(block)
