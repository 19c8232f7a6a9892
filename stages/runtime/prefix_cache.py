"""Prompt prefix caching: full KV blocks of prompts kept by content, shared by later requests.

Requests of one voice begin with the same rows (the template's prefix and the reference's frames),
so their first blocks of keys and values are the same. A full block of a prompt is named by a
chained content key: key i digests key i - 1 and the block's rows, so it names everything from
row 0 to the block's end (the keys and values of a row depend on every row before it). A request
entering the scheduler takes the longest run of its leading blocks already known (`match`), and
its prefill starts after them; the blocks it computes itself are named once their rows are in
the cache (`register`).

Blocks are counted by reference: the requests whose tables hold a block, plus none for the cache
itself. A named block whose last holder leaves goes *idle*: it keeps its keys and values, may be
matched again, and is reused for new tokens only when the free list is empty (least recently idle
first, `evict`). So the cache costs no capacity: idle blocks count as free for admission.

Only prompt rows are named, never generated ones, and a match always leaves at least one prompt
row to compute (the step needs the last row's hidden state). Host-side bookkeeping only: no
device work, nothing here runs inside a CUDA graph.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

BlockKey = bytes  # 16-byte chained digest of a full block's rows and every row before it


def block_keys(rows: np.ndarray, block_size: int) -> list[BlockKey]:
    """The chained keys of the full blocks of `rows` [S, C] (int64): len S // block_size."""
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    keys: list[BlockKey] = []
    parent = rows.shape[1].to_bytes(8, "little")  # the row width: layouts of other widths never match
    for start in range(0, len(rows) - block_size + 1, block_size):
        parent = hashlib.blake2b(parent + rows[start:start + block_size].tobytes(), digest_size=16).digest()
        keys.append(parent)
    return keys


class PrefixBlocks:
    """Named blocks (key <-> block id), their reference counts and the idle ones, in the order
    they went idle. The owner (`PagedKVCache`) keeps the free list and asks here first when a
    request's table changes."""

    def __init__(self) -> None:
        self._block_of: dict[BlockKey, int] = {}
        self._key_of: dict[int, BlockKey] = {}
        self._refs: dict[int, int] = {}  # named block -> requests holding it
        self._idle: OrderedDict[int, None] = OrderedDict()  # named, held by none: oldest first
        self.matched_tokens = 0  # tokens handed out by `match` (counter)

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    @property
    def num_named(self) -> int:
        return len(self._key_of)

    def is_named(self, block: int) -> bool:
        return block in self._key_of

    def match(self, keys: Sequence[BlockKey]) -> list[int]:
        """The blocks of the longest run of `keys` from the first that are all known (none taken)."""
        found: list[int] = []
        for key in keys:
            block = self._block_of.get(key)
            if block is None:
                break
            found.append(block)
        return found

    def take(self, blocks: Sequence[int], block_size: int) -> None:
        """A request now holds `blocks` (from `match`)."""
        for block in blocks:
            self._refs[block] += 1
            self._idle.pop(block, None)
        self.matched_tokens += len(blocks) * block_size

    def register(self, key: BlockKey, block: int) -> bool:
        """Name `block` (held by one request, its rows all in the cache) `key`; False when the key
        already names another block (two requests computed the same rows) or the block is named."""
        if key in self._block_of or block in self._key_of:
            return False
        self._block_of[key] = block
        self._key_of[block] = key
        self._refs[block] = 1
        return True

    def release(self, block: int) -> bool:
        """A request let go of `block`: True when it is named (it stays here, idle once no request
        holds it), False when it is not (the caller frees it)."""
        if block not in self._key_of:
            return False
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._idle[block] = None
        return True

    def evict(self, n: int) -> list[int]:
        """Up to `n` idle blocks, least recently idle first, unnamed: theirs to reuse."""
        out = []
        while self._idle and len(out) < n:
            block, _ = self._idle.popitem(last=False)
            del self._block_of[self._key_of.pop(block)]
            del self._refs[block]
            out.append(block)
        return out
