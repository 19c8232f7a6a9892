"""Continuous batching over the paged KV cache for talkers whose every step appends one row.

Shared by the Delay, Realtime and Local-v1.5 runners. A request is its `rows` (prompt, then one row per
generated step) and how many of them are already in the KV cache (`prefilled`). A step feeds
each request the rows it still lacks: one row for a decoding request, a prefill chunk for a new
one. When a request has all its rows in the cache, the backbone's hidden state of its last row
is what the runner samples the next row from.

Scheduling: decoding requests first (each needs at most one block); then prefill chunks in
admission order within a per-step token budget, as far as free blocks allow. If decoding
requests need more blocks than are free, the newest requests holding blocks (decoding or half
prefilled) are preempted until they fit; the oldest decoding request never is, so it always
progresses. A preempted request's blocks are freed and its rows (prompt + generated) are
prefilled again later, which resumes it exactly (recompute; host-side generation state is
untouched). With `max_prefill_chunks`, a step takes at most that many prompt chunks (the
runners set it to what one prefill-graph replay holds: a step with more would run one eager
backbone call, bound by the host's launches; a first wave of prompts mostly taken from the
prefix cache is then prefilled over a few short steps, not one long one that holds every
decoding stream). With `prefill_interval` N > 1, while some request is decoding, prefill chunks are
scheduled at most every N-th step (after a step that prefilled, the next N - 1 steps only
decode); with nothing decoding, prefill runs every step. N = 1: every step.

With `max_step_s`, a step that decodes also keeps its prefill tokens to what fits in that many
seconds (at least `MIN_STEP_PREFILL_TOKENS`), by a cost model the caller feeds with each step's
wall time (`observe_step`): the mean time of a decode-only step, and the time a prefill token adds
to a step (moving averages). A long prompt, or many, is then prefilled over several steps instead
of one step that stalls every stream (an eager 8B prefill of a few thousand tokens holds every
stream for a few hundred ms).

With a prefix-caching KV cache (`PagedKVCache(prefix_caching=True)`), a request that holds no
block when a step is scheduled (new, or preempted) first takes the longest run of its leading
prompt blocks the cache knows (`attach_prefix`) and counts them as prefilled; the prompt blocks
it fills itself are named as each prefill chunk is reserved, for the requests scheduled in later
steps (never in the same step: their rows are written by this step's work).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from stages.runtime.attention.metadata import AttentionMetadata, build_attention_metadata
from stages.runtime.kv_cache import BackboneShape, KVCacheExhausted, PagedKVCache
from stages.runtime.prefill_graphs import PrefillChunk
from stages.runtime.prefix_cache import BlockKey, block_keys

DEFAULT_CPU_TOKENS_PER_REQUEST = 2048  # KV sizing on CPU when no block count is given
MIN_STEP_PREFILL_TOKENS = 64  # a step under `max_step_s` still prefills this many tokens (progress)
STEP_COST_SMOOTHING = 0.2  # weight of the newest step in the cost model's moving averages


def make_paged_cache(backbone: BackboneShape, *, device: torch.device, dtype: torch.dtype, max_running: int,
                     block_size: int = 16, num_blocks: int | None = None,
                     memory_fraction: float = 0.5) -> PagedKVCache:
    """A KV pool of `num_blocks`, or sized by `default_num_blocks`."""
    if num_blocks is None:
        num_blocks = default_num_blocks(backbone, device=device, dtype=dtype, max_running=max_running,
                                        block_size=block_size, memory_fraction=memory_fraction)
    return PagedKVCache(backbone.kv_cache_spec(num_blocks, block_size), dtype=dtype, device=device)


def default_num_blocks(backbone: BackboneShape, *, device: torch.device, dtype: torch.dtype, max_running: int,
                       block_size: int = 16, memory_fraction: float = 0.5) -> int:
    """KV blocks that fit in `memory_fraction` of free GPU memory (CUDA) / a fixed per-request budget (CPU)."""
    spec = backbone.kv_cache_spec(1, block_size)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return max(1, int(free * memory_fraction) // spec.bytes_per_block(dtype))
    return max_running * spec.blocks_for(DEFAULT_CPU_TOKENS_PER_REQUEST)


def _moving_average(mean: float | None, value: float) -> float:
    return value if mean is None else (1 - STEP_COST_SMOOTHING) * mean + STEP_COST_SMOOTHING * value


class RowBuffer:
    """A growable `[R, C]` int64 row array (amortised O(1) append)."""

    def __init__(self, rows: np.ndarray) -> None:
        self._data = np.array(rows, dtype=np.int64, copy=True)
        self._len = len(rows)

    def __len__(self) -> int:
        return self._len

    def append(self, row: np.ndarray) -> None:
        if self._len == len(self._data):
            grown = np.empty((max(16, 2 * len(self._data)), self._data.shape[1]), dtype=np.int64)
            grown[: self._len] = self._data[: self._len]
            self._data = grown
        self._data[self._len] = row
        self._len += 1

    def view(self) -> np.ndarray:
        return self._data[: self._len]


@dataclass(eq=False)
class RowRequest:
    """Scheduling view of one request: its rows and how many sit in the KV cache."""

    rid: int
    slot: int
    order: int
    rows: RowBuffer
    prefilled: int = 0
    keys: list[BlockKey] = field(default_factory=list)  # its prompt's full blocks' content keys
    named: int = 0  # blocks of its table from which naming resumes
    prompt_len: int = 0  # rows of its prompt (the rows past them are generated)

    @property
    def pending(self) -> int:
        return len(self.rows) - self.prefilled

    @property
    def in_prompt(self) -> bool:
        """No row generated yet: what it feeds is its prompt's (its last row, with the others
        cached, is a prompt chunk of one row)."""
        return len(self.rows) <= self.prompt_len


@dataclass(frozen=True)
class ScheduledBatch:
    """One packed backbone call: ids [N, C], metadata, and which requests get a hidden state."""

    ids: torch.Tensor
    meta: AttentionMetadata
    ready: list[RowRequest]  # requests whose rows are all in the cache after this call
    ready_rows: torch.Tensor  # [len(ready)] int64: their last new token's row in the packed batch


class RowScheduler:
    def __init__(self, cache: PagedKVCache, *, max_running: int, prefill_chunk_tokens: int = 512,
                 max_prefill_tokens_per_step: int = 2048, prefill_interval: int = 1,
                 max_step_s: float | None = None, max_prefill_chunks: int | None = None) -> None:
        if prefill_interval < 1:
            raise ValueError(f"prefill_interval {prefill_interval} < 1")
        if max_step_s is not None and max_step_s <= 0:
            raise ValueError(f"max_step_s {max_step_s} <= 0")
        if max_prefill_chunks is not None and max_prefill_chunks < 1:
            raise ValueError(f"max_prefill_chunks {max_prefill_chunks} < 1")
        self.cache = cache
        self.max_running = max_running
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.max_prefill_tokens_per_step = max_prefill_tokens_per_step
        self.prefill_interval = prefill_interval
        self.max_step_s = max_step_s
        self.max_prefill_chunks = max_prefill_chunks  # prompt chunks a step takes at most (None: any)
        self.decode_step_s: float | None = None  # cost model: a decode-only step (moving average)
        self.prefill_token_s: float | None = None  # ... and what one prefill token adds to a step
        self._prefill_wait = 0  # decode-only steps still due before prefill may run next to decoders
        self.requests: dict[int, RowRequest] = {}
        self._free_slots = list(range(max_running - 1, -1, -1))
        self._next_order = 0
        self.preemptions = 0  # block holders sent back to prefill for lack of KV blocks
        self.last_batch = (0, 0)  # (decode rows, prefill tokens) of the last schedule()
        self.prompt_tokens = 0  # rows of every prompt added (counter)
        self.cached_tokens = 0  # prompt rows taken from the prefix cache instead of computed (counter)
        self.last_cached = 0  # ... by the last schedule()

    # ---- admission -----------------------------------------------------------------------------

    def _promised_blocks(self) -> int:
        """Blocks that requests still in their prompt take before their first sample."""
        spec = self.cache.spec
        return sum(max(0, spec.blocks_for(len(r.rows) + 1) - len(self.cache.block_table(r.rid)))
                   for r in self.requests.values() if r.pending > 1)

    def can_admit(self, prompt_len: int) -> bool:
        if not self._free_slots:
            return False
        need = self.cache.spec.blocks_for(prompt_len + 1)
        return self.cache.num_free_blocks - self._promised_blocks() >= need

    def add(self, rid: int, prompt: np.ndarray) -> RowRequest:
        if rid in self.requests:
            raise ValueError(f"request {rid} is already running")
        if self.cache.spec.blocks_for(len(prompt) + 1) > self.cache.spec.num_blocks:
            raise ValueError(f"request {rid}: prompt of {len(prompt)} rows exceeds the whole KV cache")
        if not self._free_slots:
            raise RuntimeError(f"request {rid}: all {self.max_running} slots are taken (check can_admit)")
        keys = block_keys(prompt, self.cache.spec.block_size) if self.cache.prefix is not None else []
        request = RowRequest(rid, self._free_slots.pop(), self._next_order, RowBuffer(prompt), keys=keys,
                             prompt_len=len(prompt))
        self._next_order += 1
        self.prompt_tokens += len(prompt)
        self.requests[rid] = request
        return request

    def remove(self, rid: int) -> RowRequest | None:
        request = self.requests.pop(rid, None)
        if request is not None:
            self.cache.free(rid)
            self._free_slots.append(request.slot)
        return request

    # ---- one step ------------------------------------------------------------------------------

    def _ordered(self) -> list[RowRequest]:
        return sorted(self.requests.values(), key=lambda r: r.order)

    def schedule(self) -> list[tuple[RowRequest, int]]:
        """(request, rows to feed) for this step; preempts the newest decoders when blocks run out."""
        cache = self.cache
        ordered = self._ordered()
        self.last_cached = 0
        if cache.prefix is not None:
            self._attach_prefixes(ordered)
        decode = [r for r in ordered if r.pending == 1]
        chunks_left = self.max_prefill_chunks if self.max_prefill_chunks is not None else len(ordered)
        if self.max_prefill_chunks is not None:  # a prompt's last row alone is a prompt chunk too
            last_rows = [r for r in decode if r.in_prompt]
            later = set(last_rows[chunks_left:])  # beyond the cap: the next step
            decode = [r for r in decode if r not in later]
            chunks_left -= len(last_rows) - len(later)
        need = sum(cache.blocks_needed(r.rid, 1) for r in decode)
        # newest first; the oldest decoding request is never a victim, so it always progresses
        victims = [r for r in reversed(ordered) if not decode or r is not decode[0]]
        while need > cache.num_free_blocks and victims:
            victim = victims.pop(0)
            if not cache.block_table(victim.rid):
                continue
            if victim in decode:
                decode.remove(victim)
                need -= cache.blocks_needed(victim.rid, 1)
            cache.free(victim.rid)
            victim.prefilled = victim.named = 0
            self.preemptions += 1
        if need > cache.num_free_blocks:
            raise KVCacheExhausted(f"request {decode[0].rid} alone outgrows the KV cache")
        free = cache.num_free_blocks - need
        budget = self.max_prefill_tokens_per_step
        if decode and self._prefill_wait > 0:
            budget = 0  # prefill_interval: this step only decodes
            self._prefill_wait -= 1
        elif decode:
            budget = min(budget, self.step_prefill_budget())
        batch = [(r, 1) for r in decode]
        for r in self._ordered():
            if r.pending <= 1 or budget <= 0:
                continue
            if chunks_left <= 0:
                break  # first come, first served: the next step takes the rest
            spare = len(cache.block_table(r.rid)) * cache.spec.block_size - cache.length(r.rid)
            take = min(self.prefill_chunk_tokens, r.pending, budget, spare + free * cache.spec.block_size)
            if take <= 0:
                break  # first come, first served
            free -= cache.blocks_needed(r.rid, take)
            budget -= take
            chunks_left -= 1
            batch.append((r, take))
        if not batch:
            raise KVCacheExhausted("no request can make progress: the KV cache is full of prompts")
        if len(batch) > len(decode):
            self._prefill_wait = self.prefill_interval - 1
        self.last_batch = (len(decode), sum(n for _, n in batch[len(decode):]))
        return batch

    @contextmanager
    def chunks_uncapped(self) -> Iterator[None]:
        """Steps scheduled inside take any number of prompt chunks (the talker's warm-up: the
        eager call that a chunk no replay fits still needs is compiled there, not under load)."""
        cap, self.max_prefill_chunks = self.max_prefill_chunks, None
        try:
            yield
        finally:
            self.max_prefill_chunks = cap

    def step_prefill_budget(self) -> int:
        """Prefill tokens a step that decodes may take under `max_step_s` (by the cost model; no
        limit before it has seen a decode-only step and a prefill step)."""
        if self.max_step_s is None or self.decode_step_s is None or not self.prefill_token_s:
            return self.max_prefill_tokens_per_step
        fits = int((self.max_step_s - self.decode_step_s) / self.prefill_token_s)
        return max(MIN_STEP_PREFILL_TOKENS, fits)

    def observe_step(self, seconds: float) -> None:
        """The wall time of the step `schedule()` last planned (its device work included: the
        runners read its results back before returning), for the cost model."""
        decode, prefill = self.last_batch
        if prefill == 0:
            if decode:
                self.decode_step_s = _moving_average(self.decode_step_s, seconds)
        elif decode and self.decode_step_s is not None and prefill >= MIN_STEP_PREFILL_TOKENS:
            # (with decoders only: a step that completes no prompt returns before its device work)
            per_token = max(0.0, seconds - self.decode_step_s) / prefill
            self.prefill_token_s = _moving_average(self.prefill_token_s, per_token)

    def _attach_prefixes(self, ordered: list[RowRequest]) -> None:
        """Requests holding no block start with their cached leading prompt blocks (at least one
        row left to compute: the step needs the last row's hidden state)."""
        bs = self.cache.spec.block_size
        for r in ordered:
            if r.prefilled or not r.keys or self.cache.block_table(r.rid):
                continue
            got = self.cache.attach_prefix(r.rid, r.keys, (len(r.rows) - 1) // bs)
            r.prefilled, r.named = got, got // bs
            self.cached_tokens += got
            self.last_cached += got

    def pack(self, batch: list[tuple[RowRequest, int]], device: torch.device) -> ScheduledBatch:
        """Reserve KV slots, copy the rows to the device and mark what becomes ready."""
        rows = np.concatenate([r.rows.view()[r.prefilled : r.prefilled + n] for r, n in batch])  # [N, C]
        meta = build_attention_metadata(self.cache, [(r.rid, n) for r, n in batch], device)
        ready, ready_index = self._advance(batch)
        ids = torch.from_numpy(rows).to(device, non_blocking=True)
        index = torch.tensor(ready_index, dtype=torch.long).to(device, non_blocking=True)
        return ScheduledBatch(ids, meta, ready, meta.last_token_index[index])

    def reserve(self, batch: list[tuple[RowRequest, int]]) -> tuple[list[PrefillChunk], list[RowRequest], list[int]]:
        """Reserve KV slots for `batch` without building its metadata (the prefill graphs pack
        their own): each item as a `PrefillChunk`, the requests that become ready and their
        indices in `batch`."""
        chunks = []
        for r, n in batch:
            start, slots = self.cache.append_slots(r.rid, n)
            chunks.append(PrefillChunk(r.rows.view()[r.prefilled: r.prefilled + n], start, slots,
                                       self.cache.block_table(r.rid)))
        ready, ready_index = self._advance(batch)
        return chunks, ready, ready_index

    def _advance(self, batch: list[tuple[RowRequest, int]]) -> tuple[list[RowRequest], list[int]]:
        """Count the fed rows as prefilled; the requests whose rows are all in the cache now."""
        ready, ready_index = [], []
        for i, (r, n) in enumerate(batch):
            r.prefilled += n
            if r.keys and r.named < len(r.keys):
                r.named = self.cache.name_blocks(r.rid, r.keys, r.named)
            if r.pending == 0:
                ready.append(r)
                ready_index.append(i)
        return ready, ready_index
