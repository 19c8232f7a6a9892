"""Paged KV cache for continuous batching: a pool of fixed-size blocks shared by all requests.

Every attention layer owns two pool tensors `[num_blocks, block_size, n_kv, head_dim]` (keys and
values). A request holds a *block table*: the ids of the blocks that store its tokens, in order;
token `i` of a request lives in block `table[i // block_size]`, row `i % block_size`, i.e. flat slot
`table[i // block_size] * block_size + i % block_size` of the pool viewed as
`[num_blocks * block_size, n_kv, head_dim]`.

Blocks are taken from the free list only when a request's length crosses a block boundary and go
back on `free`, so the KV memory in use follows what the running requests hold. The pool tensors
themselves are allocated once (their size is the capacity the profile grants).

With `prefix_caching`, full prompt blocks are kept by content (`stages.runtime.prefix_cache`): a
request can start with blocks another request computed (`attach_prefix`), a block named once its
rows are in (`name_blocks`) outlives its request as an idle block, reused for new tokens only when
the free list is empty. Idle blocks count as free.

This module is model-agnostic: the Qwen3 backbone of every variant uses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from stages.runtime.prefix_cache import BlockKey, PrefixBlocks


class KVCacheExhausted(RuntimeError):
    """No free block left for a request that needs one; admission should have prevented it."""


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of a paged KV pool."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_blocks: int
    block_size: int = 16

    def bytes_per_block(self, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


class BackboneShape(Protocol):
    """What sizes a KV pool: a backbone's configuration (`stages.models.qwen3.Qwen3Config`, or one
    tensor-parallel rank's share of it)."""

    hidden_size: int

    def kv_cache_spec(self, num_blocks: int, block_size: int = 16) -> KVCacheSpec:
        """The pool of `num_blocks` blocks of `block_size` tokens for every layer and KV head."""


class BlockAllocator:
    """A free list of block ids. Lowest ids are handed out first (deterministic layouts)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() yields 0, 1, 2, ...

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise KVCacheExhausted(f"need {n} KV blocks, {len(self._free)} free of {self.num_blocks}")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


class PagedKVCache:
    """The block pool of all layers plus the block table and length of every request (by id)."""

    def __init__(self, spec: KVCacheSpec, *, dtype: torch.dtype, device: torch.device | str,
                 prefix_caching: bool = False) -> None:
        self.spec = spec
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (spec.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(spec.num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(spec.num_layers)]
        self.allocator = BlockAllocator(spec.num_blocks)
        self._tables: dict[int, list[int]] = {}
        self._lengths: dict[int, int] = {}
        self.prefix: PrefixBlocks | None = PrefixBlocks() if prefix_caching else None

    # ---- per-request bookkeeping (host side, no device work) ----

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._tables

    def length(self, seq_id: int) -> int:
        """Tokens of `seq_id` stored in the cache."""
        return self._lengths.get(seq_id, 0)

    def block_table(self, seq_id: int) -> list[int]:
        return self._tables.get(seq_id, [])

    @property
    def num_free_blocks(self) -> int:
        """Blocks a request can take: the free list and the idle prefix blocks."""
        return self.allocator.num_free + (self.prefix.num_idle if self.prefix is not None else 0)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by requests (or by their owners outside the allocator)."""
        return self.spec.num_blocks - self.num_free_blocks

    def blocks_needed(self, seq_id: int, num_new_tokens: int) -> int:
        """Extra blocks `seq_id` needs to append `num_new_tokens` tokens."""
        have = len(self._tables.get(seq_id, ()))
        return max(0, self.spec.blocks_for(self.length(seq_id) + num_new_tokens) - have)

    def append_slots(self, seq_id: int, num_new_tokens: int) -> tuple[int, list[int]]:
        """Grow `seq_id` by `num_new_tokens`; returns (tokens before, flat slots of the new tokens).

        Blocks are allocated here, on demand. Raises `KVCacheExhausted` when the pool is empty.
        """
        extra = self.blocks_needed(seq_id, num_new_tokens)
        new_blocks = self._allocate(extra) if extra else []
        table = self._tables.setdefault(seq_id, [])
        table.extend(new_blocks)
        start = self._lengths.get(seq_id, 0)
        bs = self.spec.block_size
        slots = [table[i // bs] * bs + i % bs for i in range(start, start + num_new_tokens)]
        self._lengths[seq_id] = start + num_new_tokens
        return start, slots

    def free(self, seq_id: int) -> None:
        """Return all blocks of `seq_id` to the pool (no-op for an unknown id); its named prefix
        blocks stay, idle once no request holds them (the last ones first to be reused)."""
        table = self._tables.pop(seq_id, None)
        self._lengths.pop(seq_id, None)
        if not table:
            return
        if self.prefix is not None:
            kept = {block for block in reversed(table) if self.prefix.release(block)}
            table = [block for block in table if block not in kept]
        self.allocator.free(table)

    def _allocate(self, n: int) -> list[int]:
        """`n` blocks off the free list, reusing the least recently idle prefix blocks when it
        runs short."""
        short = n - self.allocator.num_free
        if short > 0 and self.prefix is not None:
            self.allocator.free(self.prefix.evict(short))
        return self.allocator.allocate(n)

    # ---- prompt prefixes (with `prefix_caching`) ----

    def attach_prefix(self, seq_id: int, keys: list[BlockKey], max_blocks: int) -> int:
        """Start `seq_id` (holding no block yet) with the longest known run of its first
        `max_blocks` prompt blocks, `keys` from `block_keys`: how many tokens it got (0 without
        `prefix_caching`)."""
        if self.prefix is None or max_blocks <= 0 or self._tables.get(seq_id):
            return 0
        blocks = self.prefix.match(keys[:max_blocks])
        if not blocks:
            return 0
        self.prefix.take(blocks, self.spec.block_size)
        self._tables[seq_id] = list(blocks)
        self._lengths[seq_id] = len(blocks) * self.spec.block_size
        return self._lengths[seq_id]

    def name_blocks(self, seq_id: int, keys: list[BlockKey], first: int) -> int:
        """Name the blocks of `seq_id` from index `first` that its stored tokens fill and `keys`
        covers (its rows are all written: call after the step that writes them is issued, before
        any later step that could read them); returns the index to start from next time."""
        if self.prefix is None:
            return first
        table = self._tables.get(seq_id, [])
        end = min(len(keys), self.length(seq_id) // self.spec.block_size, len(table))
        for i in range(first, end):
            self.prefix.register(keys[i], table[i])
        return max(first, end)

    # ---- device side ----

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new keys/values `[N, n_kv, head_dim]` at flat slots `slot_mapping [N]`."""
        store_kv(self.keys[layer], self.values[layer], slot_mapping, k, v)


def store_kv(keys: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """One layer's new keys/values `[N, n_kv, head_dim]` into its cache `keys`, `values`
    `[blocks, block_size, n_kv, head_dim]` at flat slots `slot_mapping [N]` (eager callers and
    graph captures; compiled callers use `scatter_kv`)."""
    for pool, x in ((keys, k), (values, v)):
        pool, x = _as_stored(pool, x)
        pool.view(-1, *pool.shape[2:]).index_copy_(0, slot_mapping, x)


def scatter_kv(keys: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> None:
    """`store_kv` for compiled callers: the same stores as an `index_put_` into the pools
    themselves at (block, row) pairs, which inductor lowers to a scatter in place. (Compiled for
    CUDA, `index_copy_` into a flat view of the pool became a kernel over the whole pool and a
    copy back: 5.4 ms more kernels a step at 88 rows.) Traced for compilation, a float8 pool is
    written as float8: inductor makes the store itself, and an in-place write through a byte view
    of a graph input is likely lowered the same way as the flat view was (a float8 cache with
    these stores took 11.8 ms a step at 88 rows against 8.4 in bf16, 4 more kernels a layer);
    eager calls store bytes."""
    block_size = keys.shape[1]
    where = (slot_mapping // block_size, slot_mapping % block_size)  # [N] each
    for pool, x in ((keys, k), (values, v)):
        if torch.compiler.is_compiling():
            pool.index_put_(where, to_cache_dtype(x, pool.dtype))
        else:
            pool, x = _as_stored(pool, x)
            pool.index_put_(where, x)


def _as_stored(pool: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(pool, x in the pool's element type) to store with; a float8 pool and its rows as uint8
    (the same bytes: `index_copy_` and `index_put_` have no float8 kernels)."""
    x = to_cache_dtype(x, pool.dtype)
    if pool.dtype in FLOAT8_TYPES:
        return pool.view(torch.uint8), x.view(torch.uint8)
    return pool, x


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in the cache's element type; a float8 cache (no scale: keys after their RMSNorm and values
    of a normalised hidden state sit well inside its range) saturates at its largest finite value
    instead of the cast's NaN."""
    if dtype in FLOAT8_TYPES:
        limit = torch.finfo(dtype).max
        x = x.clamp(-limit, limit)
    return x.to(dtype)


FLOAT8_TYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
