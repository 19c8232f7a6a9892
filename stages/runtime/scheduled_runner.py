"""What the Delay, Realtime and Local-v1.5 talker runners share: the capacity settings, the paged KV
cache and the `RowScheduler` over it, the request bookkeeping that only asks the scheduler, and
the backbone part of a step (`forward_scheduled`) for the runners that sample outside graphs.

A subclass keeps its per-request host state in `_requests` (rid -> an object with a `sched:
RowRequest`) and adds its own `add` and `step`.

`forward_scheduled` runs the scheduled rows through `model(ids, meta, cache, attention)`. With
`backbone_graphs` "off" that is one call over every row. Otherwise the step is split: the decoding
requests (one pending row each) replay the backbone graph of their (batch, KV-blocks) bucket
(`stages.runtime.backbone_graphs`; "eager" runs the same padded inputs without capture, as CPU tests do)
and the prefill chunks run one call over their own rows, eager or, with `prefill_graphs`, replayed
from a graph per token bucket (`stages.runtime.prefill_graphs`, made on the first prefill and
captured ahead at warm-up); the hidden states come back in the one-call path's order (decoders
first, then the chunks that complete a prompt).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, TypeVar

import numpy as np
import torch

from speech.sampling import SamplingParams
from stages.runtime.attention.backends import PaddedBatchAttention, ReferenceAttention
from stages.runtime.attention.metadata import AttentionBackend
from stages.runtime.backbone_graphs import BackboneGraphs
from stages.runtime.batch_invariant import BatchInvariantKernels, batch_invariant_supported, invariant_attention
from stages.runtime.graph_capture import (GRAPH_AHEAD_TOKENS, GRAPH_PATHS, CaptureProgress, batch_buckets,
                                          powers_up_to)
from stages.runtime.kv_cache import BackboneShape, PagedKVCache
from stages.runtime.prefill_graphs import PrefillGraphs
from stages.runtime.row_scheduler import RowRequest, RowScheduler, ScheduledBatch, default_num_blocks
from stages.runtime.talker_runner import FrameEvent

T = TypeVar("T")


def in_kernel_mode(method: Callable[..., T]) -> Callable[..., T]:
    """Run a runner method (steps, graph captures) inside its `kernel_mode()` and inference mode.

    Inference mode for the whole method, not only its model calls: every tensor a step or capture
    makes (packed inputs, graphs' static buffers) is then an inference tensor, so the compiled
    parts always meet one kind. Dynamo guards on a tensor's dispatch keys, and a frame graph's
    static input made outside inference mode beside a decode body's hidden states made inside it
    compiled the local loop (and the row embedding) once for each kind: two compiles more at
    warm-up. Methods called between steps (`add`, `remove`, `feed`) may write only what the runner
    made at construction (or host state): an inference tensor is read-only outside inference mode."""

    @functools.wraps(method)
    def wrapper(self: ScheduledRunner, *args, **kwargs) -> T:
        with self.kernel_mode(), torch.inference_mode():
            return method(self, *args, **kwargs)

    return wrapper


class ScheduledRunner:
    frame_rate = 12.5

    def __init__(
        self,
        model: torch.nn.Module,
        backbone: BackboneShape,
        *,
        max_running: int = 64,
        kv_block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_memory_fraction: float = 0.5,
        prefill_chunk_tokens: int = 512,
        max_prefill_tokens_per_step: int = 2048,
        prefill_interval: int = 1,
        prefix_caching: bool = False,
        max_step_ms: float | None = None,
        attention: AttentionBackend | None = None,
        spare_kv_blocks: int = 0,
        backbone_graphs: str = "off",
        prefill_graphs: bool = False,
        prefill_graph_seqs: int = 32,
        batch_invariant: bool = False,
        kv_cache_dtype: torch.dtype | None = None,
    ) -> None:
        """`backbone` sizes the KV pool (this rank's KV heads); `spare_kv_blocks` are added on top
        of `num_kv_blocks` (or the default count) for the subclass's own use. `prefill_interval`:
        while requests decode, prefill chunks run at most every this many steps (`RowScheduler`).
        `max_step_ms`: a step that decodes prefills no more than fits in this many ms
        (`RowScheduler`'s cost model). `prefix_caching`: requests start with the KV blocks of an
        earlier prompt's identical leading rows (`stages.runtime.prefix_cache`).
        `backbone_graphs`: "off" | "eager" | "cuda", how `forward_scheduled` runs decode rows (a
        resolved `stages.runtime.graph_capture` path; graphs need an attention backend that reads
        tensors only, `PaddedBatchAttention` when none is given). `prefill_graphs`: with backbone
        graphs, prefill chunks replay `PrefillGraphs` too (else one eager call), at most
        `prefill_graph_seqs` chunks a replay and so a step (the scheduler keeps the rest for
        the next step: more would run one eager call, bound by the host's launches). `batch_invariant`:
        every step and graph capture runs inside `stages.runtime.batch_invariant`'s mode
        (`kernel_mode`), with its attention when none is given (a given one must be
        batch-invariant). `kv_cache_dtype`: the KV pool's element type, the model's when None
        (float8 e4m3: half the bytes attention reads; `stages.runtime.kv_cache.store_kv`)."""
        if backbone_graphs not in GRAPH_PATHS:
            raise ValueError(f"backbone_graphs {backbone_graphs!r}: expected one of {GRAPH_PATHS}")
        param = next(model.parameters())
        self.model, self.device, self.dtype = model.eval(), param.device, param.dtype
        if backbone_graphs == "cuda" and self.device.type != "cuda":
            raise ValueError(f"backbone_graphs 'cuda' needs a CUDA device, the model is on {self.device}")
        self.max_running = max_running
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.max_prefill_tokens_per_step = max_prefill_tokens_per_step
        self.prefill_interval = prefill_interval
        self.prefill_graph_seqs = min(max_running, prefill_graph_seqs)
        self.backbone_graph_path = backbone_graphs
        self.kernels: BatchInvariantKernels | None = None
        if batch_invariant:
            if not batch_invariant_supported(self.device):
                raise ValueError(f"batch_invariant needs CUDA and triton (or TRITON_INTERPRET=1), model on {self.device}")
            attention = attention or invariant_attention()
            if not getattr(attention, "batch_invariant", False):
                raise ValueError(f"batch_invariant needs a batch-invariant attention backend, got {attention!r}")
            self.kernels = BatchInvariantKernels()
        if backbone_graphs != "off":
            if isinstance(attention, ReferenceAttention):
                raise ValueError("ReferenceAttention reads host lengths: it cannot run in backbone graphs")
            attention = attention or PaddedBatchAttention()
            spare_kv_blocks += 1  # the padding rows' scratch block
        self.attention = attention or ReferenceAttention()
        kv_dtype = kv_cache_dtype or self.dtype
        if num_kv_blocks is None:
            num_kv_blocks = default_num_blocks(backbone, device=self.device, dtype=kv_dtype,
                                               max_running=max_running, block_size=kv_block_size,
                                               memory_fraction=kv_memory_fraction)
        self._spare_blocks = spare_kv_blocks  # held by the runner itself (graph padding), never a request's
        self.cache = PagedKVCache(backbone.kv_cache_spec(num_kv_blocks + spare_kv_blocks, kv_block_size),
                                  dtype=kv_dtype, device=self.device, prefix_caching=prefix_caching)
        self.scheduler = RowScheduler(self.cache, max_running=max_running, prefill_chunk_tokens=prefill_chunk_tokens,
                                      max_prefill_tokens_per_step=max_prefill_tokens_per_step,
                                      prefill_interval=prefill_interval,
                                      max_step_s=None if max_step_ms is None else max_step_ms / 1e3)
        self._requests: dict[int, Any] = {}
        # [] the value of the runners' index writes: a Python value written through indexing is a
        # blocking host-to-device copy, which waits for every kernel already queued (the step in flight)
        self._true = torch.ones((), dtype=torch.bool, device=self.device)
        self._hidden_size = backbone.hidden_size
        self._query_heads = backbone.num_heads
        self._backbone_graphs: BackboneGraphs | None = None  # made on the first graph decode
        self._want_prefill_graphs = prefill_graphs and backbone_graphs != "off"
        self.prefill_graphs: PrefillGraphs | None = None  # made on the first prefill (its row width)
        if backbone_graphs != "off":
            (self._graph_block,) = self.cache.allocator.allocate(1)

    @property
    def preemptions(self) -> int:
        """Block holders sent back to prefill for lack of KV blocks."""
        return self.scheduler.preemptions

    def can_admit(self, prompt_len: int) -> bool:
        return self.scheduler.can_admit(prompt_len)

    def remove(self, rid: int) -> None:
        if self._requests.pop(rid, None) is not None:
            self.scheduler.remove(rid)

    def max_prompt_rows(self) -> int:
        """The longest prompt the KV cache can take (with room for its first frame)."""
        spec = self.cache.spec
        return (spec.num_blocks - self._spare_blocks) * spec.block_size - 1

    def capture_ahead(self, budget_s: float, progress: CaptureProgress | None = None) -> int:
        """Every graph serving can replay, made now: here the backbone's decode graphs
        (`capture_decode_graphs`) and the prefill graphs (`capture_prefill_graphs`), each counted
        in `progress`; a runner with more overrides this."""
        deadline = time.monotonic() + budget_s
        made = self.capture_decode_graphs(budget_s, progress)
        return made + self.capture_prefill_graphs(deadline - time.monotonic(), progress)

    @in_kernel_mode
    def capture_prefill_graphs(self, budget_s: float, progress: CaptureProgress | None = None) -> int:
        """The prefill graphs of every token bucket (and block-table bucket up to
        `GRAPH_AHEAD_TOKENS` tokens, when widths are bucketed), within `budget_s`: how many were
        made (0 without prefill graphs, or before the first prefill made the set), each counted in
        `progress`."""
        g = self.prefill_graphs
        if g is None:
            return 0
        widest = self.cache.spec.blocks_for(GRAPH_AHEAD_TOKENS)
        return g.capture_ahead(g.token_buckets(), powers_up_to(min(widest, g.max_blocks)), budget_s, progress)

    def graph_table_width(self) -> int | None:
        """The one block-table width of decode graphs (tables of up to `GRAPH_AHEAD_TOKENS` tokens),
        when the attention reads a table only as far as its sequence's length; None: widths are
        bucketed (then each (batch, width) bucket is a graph of its own)."""
        if not getattr(self.attention, "table_width_free", False):
            return None
        return self.cache.spec.blocks_for(GRAPH_AHEAD_TOKENS)

    def warm_attention(self) -> int:
        """Every kernel variant of the attention backend a step can launch, made now
        (`TritonPagedAttention.warm_variants`, for backends that have variants): returns the
        launches made (0 for a backend without)."""
        warm = getattr(self.attention, "warm_variants", None)
        if warm is None:
            return 0
        with torch.inference_mode():
            return warm(self.cache.spec, self.dtype, self._query_heads, self.device, kv_dtype=self.cache.dtype)

    @in_kernel_mode
    def capture_decode_graphs(self, budget_s: float, progress: CaptureProgress | None = None) -> int:
        """With one table width (`graph_table_width`), the backbone decode graph of every batch
        bucket not made yet, largest first, within `budget_s` (a capture while serving stalls
        every stream; one width makes them few). Needs a decode step run first (warm-up), which
        makes the graph set. Returns how many were made, each counted in `progress`."""
        graphs, width = self._backbone_graphs, self.graph_table_width()
        if graphs is None or width is None:
            return 0
        return graphs.capture_ahead(batch_buckets(self.max_running), [width], budget_s, progress)

    def num_running(self) -> int:
        return len(self._requests)

    def graph_sets(self) -> list[Any]:
        """Every set of recorded graphs made so far (each has `keys`: its buckets made); a runner
        with more sets extends this."""
        return [g for g in (self._backbone_graphs, self.prefill_graphs) if g is not None]

    def graphs_made(self) -> int:
        """How many graphs (buckets) the runner holds: one more after a step means that step
        recorded a graph, which stalls every stream for the capture."""
        return sum(len(g.keys) for g in self.graph_sets())

    def close(self) -> None:
        """Nothing to release besides memory (a tensor-parallel runner stops its ranks here)."""

    def _checked_prompt(self, rid: int, prompt: np.ndarray, params: SamplingParams) -> np.ndarray:
        """`prompt` as int64 `[S >= 1, 1 + n_vq]`; ValueError naming the request when its shape or
        its frame budget is wrong. (`n_vq`: the subclass's codebooks per frame.)"""
        prompt = np.asarray(prompt, dtype=np.int64)
        if prompt.ndim != 2 or prompt.shape[1] != 1 + self.n_vq or len(prompt) == 0:
            raise ValueError(f"request {rid}: prompt shape {prompt.shape}, expected [S >= 1, {1 + self.n_vq}]")
        if params.max_new_frames < 1:
            raise ValueError(f"request {rid}: max_new_frames {params.max_new_frames} < 1")
        return prompt

    def kernel_mode(self) -> AbstractContextManager:
        """The context a step's model work runs in: the batch-invariant mode, or nothing."""
        return self.kernels.mode() if self.kernels is not None else nullcontext()

    # ---- a step of the runners that sample outside graphs ----------------------------------------

    @in_kernel_mode
    def step(self) -> list[FrameEvent]:
        """One scheduler step: the scheduled rows through the backbone (`forward_scheduled`), then
        the subclass samples the requests whose rows are all in (`_sample`: one row of tokens each,
        one host copy for all) and advances each (`_advance`: its event, if any)."""
        if not self._requests:
            return []
        done, hidden = self.forward_scheduled(self.scheduler.schedule())  # hidden [B, H]
        if not done:
            return []
        ready = [self._requests[r.rid] for r in done]
        with torch.inference_mode():
            rows = self._sample(ready, hidden).cpu().numpy()  # [B, W], the one host copy
        return [event for req, row in zip(ready, rows) if (event := self._advance(req, row)) is not None]

    def _sample(self, ready: list[Any], hidden: torch.Tensor) -> torch.Tensor:
        """The tokens of each ready request's next row `[B, W]` from its hidden state `[B, H]`."""
        raise NotImplementedError

    def _advance(self, req: Any, row: np.ndarray) -> FrameEvent | None:
        """Take a request's sampled row; the event it makes (a frame, the end), if any."""
        raise NotImplementedError

    def rows(self, rid: int) -> np.ndarray:
        """All backbone rows of a running request so far (prompt, then one per generated step)."""
        return self._requests[rid].sched.rows.view().copy()

    # ---- the backbone part of a step -----------------------------------------------------------

    def forward_scheduled(self, scheduled: list[tuple[RowRequest, int]]) -> tuple[list[RowRequest], torch.Tensor]:
        """Run this step's scheduled rows through the backbone: the requests whose rows are all in
        the cache now (schedule order) and their last rows' hidden states [len(ready), H]."""
        with torch.inference_mode():
            if self.backbone_graph_path == "off":
                batch = self._pack(scheduled)
                hidden = self.model(batch.ids, batch.meta, self.cache, self.attention)  # [N, H]
                return batch.ready, hidden[batch.ready_rows]
            decode = [r for r, _ in scheduled if r.pending == 1]  # before anything is packed
            chunks = [(r, n) for r, n in scheduled if r.pending != 1]
            ready, states = list(decode), [self._graph_decode(decode)] if decode else []
            if chunks:
                done, hidden = self._prefill(chunks)
                ready += done
                states.append(hidden)
            if not states:
                return [], torch.empty(0, self._hidden_size, dtype=self.dtype, device=self.device)
            return ready, states[0] if len(states) == 1 else torch.cat(states)

    def _prefill(self, chunks: list[tuple[RowRequest, int]]) -> tuple[list[RowRequest], torch.Tensor]:
        """The prompt chunks through the backbone (a prefill-graph replay when they fit one, else
        one eager call): the requests they complete and those requests' last hidden states [n, H]."""
        if self._want_prefill_graphs and self.prefill_graphs is None:
            self._make_prefill_graphs(width=chunks[0][0].rows.view().shape[1])
        g, blocks_for = self.prefill_graphs, self.cache.spec.blocks_for
        if g is not None and g.fits([n for _, n in chunks], [blocks_for(r.prefilled + n) for r, n in chunks]):
            packed, done, index = self.scheduler.reserve(chunks)
            hidden, last = g.run(packed)  # [T, H], [len(chunks)]
            return done, hidden[last[torch.tensor(index, dtype=torch.long).to(self.device, non_blocking=True)]]
        batch = self.scheduler.pack(chunks, self.device)
        hidden = self.model(batch.ids, batch.meta, self.cache, self.attention)  # [N, H]
        return batch.ready, hidden[batch.ready_rows]

    def _make_prefill_graphs(self, width: int) -> None:
        model, cache, attention = self.model, self.cache, self.attention
        capture = self.backbone_graph_path == "cuda"
        self.prefill_graphs = PrefillGraphs(
            lambda ids, meta: model(ids, meta, cache, attention), width=width, hidden_size=self._hidden_size,
            dtype=self.dtype, max_tokens=self.max_prefill_tokens_per_step,
            max_seqs=self.prefill_graph_seqs, max_chunk=self.prefill_chunk_tokens,
            max_blocks=cache.spec.num_blocks - 1, scratch_block=self._graph_block, block_size=cache.spec.block_size,
            device=self.device, capture=capture, pool=torch.cuda.graph_pool_handle() if capture else None,
            table_width=self.graph_table_width())
        self.scheduler.max_prefill_chunks = self.prefill_graph_seqs  # a step's chunks fit one replay

    def _pack(self, scheduled: list[tuple[RowRequest, int]]) -> ScheduledBatch:
        """The one-call path's backbone inputs (the tensor-parallel runner also sends them to its ranks)."""
        return self.scheduler.pack(scheduled, self.device)

    def _graph_decode(self, decode: list[RowRequest]) -> torch.Tensor:
        """Reserve one KV slot per decoding request and replay its bucket's backbone graph:
        hidden [len(decode), H] (a view of the graph's output)."""
        cache = self.cache
        rows, positions, kv_slots = [], [], []
        for r in decode:
            start, (slot,) = cache.append_slots(r.rid, 1)
            rows.append(r.rows.view()[r.prefilled])
            r.prefilled += 1
            positions.append(start)
            kv_slots.append(slot)
        if self._backbone_graphs is None:
            model, attention = self.model, self.attention
            self._backbone_graphs = BackboneGraphs(
                lambda ids, meta: model(ids, meta, cache, attention), width=len(rows[0]),
                hidden_size=self._hidden_size, dtype=self.dtype, max_batch=self.max_running,
                max_blocks=cache.spec.num_blocks - 1, scratch_block=self._graph_block,
                block_size=cache.spec.block_size, device=self.device, capture=self.backbone_graph_path == "cuda",
                table_width=self.graph_table_width())
        return self._backbone_graphs.run(np.stack(rows), positions, kv_slots, [cache.block_table(r.rid) for r in decode])
