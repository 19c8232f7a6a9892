"""Continuous-batching talker runner of Local-v1.5 (`TalkerRunner`, docs/interfaces.md).

One `step()`:
1. schedule: every decoding request feeds its last frame's row (1 token); requests still in
   their prompt get prefill chunks (at most `prefill_chunk_tokens` each, `max_prefill_tokens_per_step`
   in all, admission order first) as far as free KV blocks allow;
2. ONE backbone call over the packed tokens and the paged KV cache;
3. the local loop (stop head + 12 codebooks) batched over every request whose prompt is now
   complete, sampled per request slot (`stages.sampling`: own seed, own frame counter, own
   repetition history);
4. one device-to-host copy of (stop, codes) to build the `FrameEvent`s.

Request state that the model path reads (sampling settings, repetition history, the next input
row) lives in slot-indexed device tensors; the host keeps lengths and counters, so scheduling
never waits on the device. When decoding requests need KV blocks the pool does not have, the
newest ones are preempted: their blocks are freed and their prompt plus generated rows are
prefilled again later (recompute), which continues them exactly where they were.

With `cuda_graphs` (CUDA only), a step with no prefill chunk (steps 2-3 for decoding requests)
is replayed from a graph captured per (batch, KV-blocks) bucket (`stages.local_v15.graphs`);
steps with prefill run their backbone call eagerly and replay the local loop + sampling from a
graph per batch bucket.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from stages.attention import AttentionBackend, PaddedBatchAttention, ReferenceAttention, build_attention_metadata
from stages.kv_cache import KVCacheExhausted, PagedKVCache
from stages.local_v15.graphs import DecodeGraphs, FrameGraphs
from stages.local_v15.loader import load_talker
from stages.local_v15.model import LocalV15Talker
from stages.runner import FrameEvent
from stages.sampling import SamplingParams, SamplingSlots, sample_tokens

DEFAULT_CPU_TOKENS_PER_REQUEST = 2048  # KV sizing when neither blocks nor a device budget is given


@dataclass(slots=True, eq=False)
class _Request:
    rid: int
    slot: int
    order: int  # admission sequence: prefill priority, preemption picks the largest
    prompt: np.ndarray  # [S, 1 + n_vq] as added
    params: SamplingParams
    rows: np.ndarray  # [R, 1 + n_vq] rows to prefill (prompt, or prompt + generated after preemption)
    prefilled: int = 0
    frames: int = 0  # frames emitted
    generated: list[np.ndarray] = field(default_factory=list)  # codes [n_vq] per emitted frame

    @property
    def decoding(self) -> bool:
        return self.prefilled == len(self.rows)


class _SlotSampler:
    """`FrameSampler` over request slots: settings, repetition history and noise per request."""

    def __init__(self, runner: LocalV15Runner, slots: torch.Tensor, frames: torch.Tensor) -> None:
        self.slots, self.frames, self.n_vq = slots, frames, runner.n_vq
        self.seen = runner.seen
        self.audio = runner.sampling.rows(slots)
        self.text = runner.sampling.rows(slots, text=True)

    def stop(self, logits: torch.Tensor) -> torch.Tensor:  # [B, 2] -> [B] bool
        return sample_tokens(logits, self.text, self.frames, stream=self.n_vq) == 1

    def code(self, codebook: int, logits: torch.Tensor) -> torch.Tensor:  # [B, V] -> [B]
        return sample_tokens(logits, self.audio, self.frames, codebook, self.seen[self.slots, codebook])


class LocalV15Runner:
    """The v1.5 talker with a paged KV cache, serving many requests at once."""

    frame_rate = 12.5

    def __init__(
        self,
        model: LocalV15Talker,
        *,
        max_running: int = 64,
        kv_block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_memory_fraction: float = 0.5,
        prefill_chunk_tokens: int = 512,
        max_prefill_tokens_per_step: int = 2048,
        attention: AttentionBackend | None = None,
        cuda_graphs: bool = False,
    ) -> None:
        param = next(model.parameters())
        self.model, self.device, self.dtype = model.eval(), param.device, param.dtype
        cfg = model.config
        self.n_vq = cfg.n_vq
        self.max_running = max_running
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.max_prefill_tokens_per_step = max_prefill_tokens_per_step
        use_graphs = cuda_graphs and self.device.type == "cuda"
        if use_graphs:
            attention = attention or PaddedBatchAttention()
        self.attention = attention or ReferenceAttention()
        if num_kv_blocks is None:
            num_kv_blocks = self._derive_kv_blocks(kv_block_size, kv_memory_fraction)
        # with graphs, one extra slot and one extra block take the padding rows of a bucket
        extra = 1 if use_graphs else 0
        self.cache = PagedKVCache(cfg.backbone.kv_cache_spec(num_kv_blocks + extra, kv_block_size),
                                  dtype=self.dtype, device=self.device)
        self.sampling = SamplingSlots(max_running + extra, self.device)
        self.seen = torch.zeros(max_running + extra, cfg.n_vq, cfg.codebook_size, dtype=torch.bool,
                                device=self.device)
        self.next_row = torch.full((max_running + extra, 1 + cfg.n_vq), cfg.audio_pad_code, dtype=torch.long,
                                   device=self.device)  # [slots, 1 + n_vq]: the row each request feeds next
        self.graphs: DecodeGraphs | None = None
        self.frame_graphs: FrameGraphs | None = None
        if use_graphs:
            (scratch_block,) = self.cache.allocator.allocate(1)
            self.next_row[max_running, 0] = cfg.gen_slot
            self.graphs = DecodeGraphs(self._decode_body, max_batch=max_running, max_blocks=num_kv_blocks,
                                       scratch_slot=max_running, scratch_block=scratch_block,
                                       block_size=kv_block_size, n_vq=cfg.n_vq, device=self.device)
            self.frame_graphs = FrameGraphs(self._frame_body, max_batch=max_running, hidden_size=cfg.hidden_size,
                                            dtype=self.dtype, scratch_slot=max_running, n_vq=cfg.n_vq,
                                            pool=self.graphs.pool, device=self.device)
        self._codebooks = torch.arange(cfg.n_vq, device=self.device)
        self._free_slots = list(range(max_running - 1, -1, -1))
        self._requests: dict[int, _Request] = {}
        self._next_order = 0
        self.preemptions = 0  # decoding requests sent back to prefill for lack of KV blocks

    @classmethod
    def from_dir(cls, model_dir: str | Path, *, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 **capacity) -> LocalV15Runner:
        return cls(load_talker(model_dir, device=device, dtype=dtype), **capacity)

    def _derive_kv_blocks(self, block_size: int, fraction: float) -> int:
        spec = self.model.config.backbone.kv_cache_spec(1, block_size)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return max(1, int(free * fraction) // spec.bytes_per_block(self.dtype))
        return self.max_running * spec.blocks_for(DEFAULT_CPU_TOKENS_PER_REQUEST)

    # ---- admission -----------------------------------------------------------------------------

    def _promised_blocks(self) -> int:
        """Blocks that requests still in their prompt will take before their first frame."""
        spec = self.cache.spec
        return sum(spec.blocks_for(len(r.rows) + 1) - len(self.cache.block_table(r.rid))
                   for r in self._requests.values() if not r.decoding)

    def can_admit(self, prompt_len: int) -> bool:
        if not self._free_slots:
            return False
        need = self.cache.spec.blocks_for(prompt_len + 1)
        return self.cache.num_free_blocks - self._promised_blocks() >= need

    def add(self, rid: int, prompt: np.ndarray, params: SamplingParams) -> None:
        if rid in self._requests:
            raise ValueError(f"request {rid} is already running")
        prompt = np.asarray(prompt, dtype=np.int64)
        if prompt.ndim != 2 or prompt.shape[1] != 1 + self.n_vq or len(prompt) == 0:
            raise ValueError(f"request {rid}: prompt shape {prompt.shape}, expected [S >= 1, {1 + self.n_vq}]")
        if params.max_new_frames < 1:
            raise ValueError(f"request {rid}: max_new_frames {params.max_new_frames} < 1")
        if self.cache.spec.blocks_for(len(prompt) + 1) > self.cache.spec.num_blocks:
            raise ValueError(f"request {rid}: prompt of {len(prompt)} rows exceeds the whole KV cache")
        if not self._free_slots:
            raise RuntimeError(f"request {rid}: all {self.max_running} slots are taken (check can_admit)")
        slot = self._free_slots.pop()
        self._requests[rid] = _Request(rid, slot, self._next_order, prompt, params, rows=prompt)
        self._next_order += 1
        self.sampling.write(slot, params)
        self.seen[slot] = False
        self.next_row[slot, 0] = self.model.config.gen_slot

    def remove(self, rid: int) -> None:
        request = self._requests.pop(rid, None)
        if request is not None:
            self.cache.free(rid)
            self._free_slots.append(request.slot)

    def num_running(self) -> int:
        return len(self._requests)

    # ---- one step ------------------------------------------------------------------------------

    def step(self) -> list[FrameEvent]:
        if not self._requests:
            return []
        decode, prefill = self._schedule()
        if self.graphs is not None and not prefill:
            return self._graph_decode(decode)
        batch = [(r.rid, 1) for r in decode] + [(r.rid, n) for r, n in prefill]
        parts = []
        if decode:
            slots = torch.tensor([r.slot for r in decode]).to(self.device, non_blocking=True)
            parts.append(self.next_row[slots])
        for r, n in prefill:
            parts.append(torch.from_numpy(r.rows[r.prefilled : r.prefilled + n]).to(self.device, non_blocking=True))
        rows = torch.cat(parts)  # [N, 1 + n_vq]
        meta = build_attention_metadata(self.cache, batch, self.device)
        with torch.inference_mode():
            hidden = self.model.transformer(self.model.embed_rows(rows), meta, self.cache, self.attention)  # [N, H]
        for r, n in prefill:
            r.prefilled += n
        ready_index = list(range(len(decode)))
        ready = list(decode)
        for j, (r, _) in enumerate(prefill):
            if r.decoding:
                ready_index.append(len(decode) + j)
                ready.append(r)
        if not ready:
            return []
        index = torch.tensor(ready_index).to(self.device, non_blocking=True)
        return self._decode_frames(ready, hidden[meta.last_token_index[index]])

    def _ordered(self) -> list[_Request]:
        return sorted(self._requests.values(), key=lambda r: r.order)

    def _schedule(self) -> tuple[list[_Request], list[tuple[_Request, int]]]:
        decode = [r for r in self._ordered() if r.decoding]
        cache = self.cache
        need = sum(cache.blocks_needed(r.rid, 1) for r in decode)
        while need > cache.num_free_blocks:
            # newest first; the oldest decoding request is never preempted, so it always advances
            holders = [r for r in reversed(self._ordered()) if r.rid in cache and r is not decode[0]]
            if not holders:
                raise KVCacheExhausted(f"request {decode[0].rid} alone outgrows the KV cache")
            victim = holders[0]
            if victim in decode:
                decode.remove(victim)
                need -= cache.blocks_needed(victim.rid, 1)
            self._preempt(victim)
        free = cache.num_free_blocks - need
        budget = self.max_prefill_tokens_per_step
        prefill = []
        for r in self._ordered():
            if r.decoding or budget <= 0:
                continue
            spare = len(cache.block_table(r.rid)) * cache.spec.block_size - cache.length(r.rid)
            take = min(self.prefill_chunk_tokens, len(r.rows) - r.prefilled, budget, spare + free * cache.spec.block_size)
            if take <= 0:
                break  # first come, first served: a later prompt does not overtake a blocked one
            free -= cache.blocks_needed(r.rid, take)
            budget -= take
            prefill.append((r, take))
        if not decode and not prefill:
            raise KVCacheExhausted("no request can make progress: the KV cache is full of prompts")
        return decode, prefill

    def _preempt(self, r: _Request) -> None:
        """Free `r`'s KV blocks; it will prefill its prompt and generated rows again."""
        self.cache.free(r.rid)
        self.preemptions += 1
        gen = np.empty((len(r.generated), 1 + self.n_vq), dtype=np.int64)
        gen[:, 0] = self.model.config.gen_slot
        if r.generated:
            gen[:, 1:] = np.stack(r.generated)
        r.rows = np.concatenate([r.prompt, gen])
        r.prefilled = 0

    def _decode_frames(self, ready: list[_Request], h: torch.Tensor) -> list[FrameEvent]:
        """Local loop for the requests whose prompt is complete; h [B, H]."""
        dev = self.device
        slots = torch.tensor([r.slot for r in ready]).to(dev, non_blocking=True)
        if self.frame_graphs is not None:
            stop, codes = self.frame_graphs.run(h, [r.slot for r in ready], [r.frames for r in ready])
            return self._finish_frames(ready, slots, stop, codes)
        frames = torch.tensor([r.frames for r in ready]).to(dev, non_blocking=True)
        with torch.inference_mode():
            stop, codes = self._frame_body(h, slots, frames)  # [B], [B, n_vq]
        return self._finish_frames(ready, slots, stop, codes)

    def _frame_body(self, h: torch.Tensor, slots: torch.Tensor, frames: torch.Tensor):
        """The local loop + sampling of a frame (what `FrameGraphs` records)."""
        return self.model.decode_frame(h, _SlotSampler(self, slots, frames))

    def _decode_body(self, slots: torch.Tensor, frames: torch.Tensor, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode-only step as pure device work (what `DecodeGraphs` records)."""
        hidden = self.model.transformer(self.model.embed_rows(self.next_row[slots]), meta, self.cache,
                                        self.attention)  # [B, H]: one new token per request
        return self.model.decode_frame(hidden, _SlotSampler(self, slots, frames))

    def _graph_decode(self, decode: list[_Request]) -> list[FrameEvent]:
        cache = self.cache
        positions, kv_slots = [], []
        for r in decode:
            start, (slot,) = cache.append_slots(r.rid, 1)
            positions.append(start)
            kv_slots.append(slot)
        packed, key = self.graphs.pack([r.slot for r in decode], [r.frames for r in decode], positions, kv_slots,
                                       [p + 1 for p in positions], [cache.block_table(r.rid) for r in decode])
        stop, codes = self.graphs.run(packed, key, len(decode))
        slots = torch.tensor([r.slot for r in decode]).to(self.device, non_blocking=True)
        return self._finish_frames(decode, slots, stop, codes)

    def _finish_frames(self, ready: list[_Request], slots: torch.Tensor, stop: torch.Tensor,
                       codes: torch.Tensor) -> list[FrameEvent]:
        """Apply forced lengths, record the frame in the request's state, build the events."""
        dev = self.device
        forced = [r.params.forced_frames for r in ready]
        model_decides = torch.tensor([f is None for f in forced]).to(dev, non_blocking=True)
        forced_stop = torch.tensor([f is not None and r.frames >= f for f, r in zip(forced, ready)]).to(dev)
        with torch.inference_mode():
            stop = torch.where(model_decides, stop, forced_stop)
            self.seen[slots[:, None], self._codebooks[None, :], codes] = True
            self.next_row[slots, 1:] = codes
            out = torch.cat([stop[:, None].long(), codes], dim=1).cpu().numpy()  # the step's one host copy
        events = []
        for r, row in zip(ready, out):
            if row[0]:
                events.append(FrameEvent(r.rid, None, finished=True, reason="stop"))
                self.remove(r.rid)
                continue
            codes_r = row[1:].copy()
            r.frames += 1
            r.generated.append(codes_r)
            reason = None
            if r.params.forced_frames is not None and r.frames >= r.params.forced_frames:
                reason = "stop"
            elif r.frames >= r.params.max_new_frames:
                reason = "length"
            events.append(FrameEvent(r.rid, codes_r, finished=reason is not None, reason=reason))
            if reason is not None:
                self.remove(r.rid)
        return events
