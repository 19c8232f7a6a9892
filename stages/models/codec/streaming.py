"""Exact streaming decode: a fixed pool of per-request slots with ring KV caches.

Every decoder attention layer gets keys and values `[slots, context + headroom, H, Dh]` where
headroom = `max_chunk_frames * tokens_per_frame` of its stage, and the pool keeps one decoded-frame
counter per slot. Positions are absolute (frame count x tokens per frame), so a chunk's earliest
query still sees every key of its window: decoding a request in chunks of any schedule equals
decoding the whole sequence, also beyond the attention context (upstream rings of exactly
`context` slots evict keys their own chunk still needs).

A batch of slots with the same chunk length decodes in one call; the state tensors are allocated
once, indexed by slot, and never reallocated (ready for CUDA graphs).
"""

from __future__ import annotations

import torch

from stages.models.codec.config import CodecConfig, TransformerStage
from stages.models.codec.model import CodecModel, StreamChunk
from stages.models.codec.transformer import LayerCache


def ring_capacity(stage: TransformerStage, max_chunk_frames: int) -> int:
    """context + the largest chunk in positions, rounded up to 16 (aligned rows for attention kernels)."""
    need = stage.context + max_chunk_frames * stage.tokens_per_frame
    return -(-need // 16) * 16


def slot_state_bytes(cfg: CodecConfig, max_chunk_frames: int, element_size: int) -> int:
    """Bytes of ring KV state one slot needs (to size `max_slots` against device memory)."""
    total = 0
    for stage in cfg.decoder:
        if isinstance(stage, TransformerStage):
            capacity = ring_capacity(stage, max_chunk_frames)
            total += 2 * stage.num_layers * capacity * stage.d_model * element_size
    return total


class StreamingDecoder:
    """Streaming decode of up to `num_slots` concurrent requests with one `CodecModel`."""

    def __init__(self, model: CodecModel, num_slots: int, max_chunk_frames: int = 15,
                 headroom_frames: int | None = None):
        """`headroom_frames` (default `max_chunk_frames`): how far one call's rows of a slot may
        reach past its counter, padding included (a chunk cut into rows of T frames reaches
        ceil(n / T) * T); the rings hold the context and that much more."""
        headroom_frames = max_chunk_frames if headroom_frames is None else headroom_frames
        if num_slots < 1 or max_chunk_frames < 1 or headroom_frames < max_chunk_frames:
            raise ValueError(f"num_slots ({num_slots}) and max_chunk_frames ({max_chunk_frames}) must be >= 1, "
                             f"headroom_frames ({headroom_frames}) >= max_chunk_frames")
        self.model = model
        self.num_slots = num_slots
        self.max_chunk_frames = max_chunk_frames
        self.headroom_frames = headroom_frames
        device = next(model.decoder.parameters()).device
        dtype = model.compute_dtype
        self.caches: list[list[LayerCache]] = []
        for stage in model.decoder_stages():
            capacity = ring_capacity(stage, headroom_frames)
            shape = (num_slots, capacity, stage.num_heads, stage.head_dim)
            self.caches.append([
                LayerCache(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))
                for _ in range(stage.num_layers)
            ])
        self.frames = torch.zeros(num_slots, dtype=torch.long, device=device)  # [S] frames decoded per slot

    def reset(self, slots: torch.Tensor) -> None:
        """Start slots [n] afresh: zero their frame counters. The rings keep the previous
        request's keys and values, which no query can see: a ring index holds absolute position
        `last - (last - index) % capacity`, negative until the new stream has written it, and the
        window mask hides negative positions (`WindowPlan.chunk`); every query sees its own key,
        so no row is fully masked. (Zeroing every layer's rings was two index writes per layer,
        twice per request, on the codec's critical path.)"""
        self.frames.index_fill_(0, slots.to(self.frames.device, non_blocking=True), 0)  # no wait for the GPU

    @torch.no_grad()
    def decode(self, codes: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor | None = None,
               offset: torch.Tensor | None = None) -> torch.Tensor:
        """The next codes [nq, B, T] of slots [B] -> audio [B, channels, T * hop].

        `valid` [B] (default T for every row): row b's real frames, the first `valid[b]`; the rest is
        padding. A padded row's audio past `valid[b] * hop` is garbage and its frame counter
        advances by `valid[b]` only, so its next chunk continues right after the real frames: the
        padding's keys land in ring rows that the next chunk overwrites before any query can see
        them (a query never sees a later position, and the ring's headroom of a whole chunk keeps
        every key a later query needs). So chunks of different lengths can share one call.

        `offset` [B] (default 0): row b starts `offset[b]` frames after its slot's counter, so one
        chunk can come as several rows of one slot, its pieces in order (offsets 0, T, 2T, ...:
        every row but the last of a slot holds T real frames). Each layer writes every row's keys
        to the rings before any row attends, and a ring holds a whole chunk of headroom, so a
        piece's queries see the earlier pieces' keys as if the chunk were one row; the counter
        ends at the slot's furthest row end. A slot's pieces must come in one call, and reach at
        most `headroom_frames` past its counter, the last one's padding included (further, its
        padding would overwrite keys the first piece's queries still read).
        Chunks longer than `max_chunk_frames` (no `valid`, no `offset`) are decoded in pieces,
        one call each (the result is the same).
        """
        slots = slots.to(self.frames.device)
        if codes.shape[-1] == 0:
            return torch.zeros(len(slots), self.model.cfg.channels, 0, device=self.frames.device)
        if (valid is not None or offset is not None) and codes.shape[-1] > self.max_chunk_frames:
            raise ValueError(f"valid lengths and offsets need a chunk of at most {self.max_chunk_frames} frames")
        pieces = []
        for begin in range(0, codes.shape[-1], self.max_chunk_frames):
            piece = codes[:, :, begin: begin + self.max_chunk_frames]
            start = self.frames[slots]  # [B]
            if offset is not None:
                start = start + offset.to(self.frames.device)
            pieces.append(self.model.decode(piece, StreamChunk(slots, start, self.caches)))
            advance = piece.shape[-1] if valid is None else valid.to(self.frames.device)
            # a slot's counter: the furthest end of its rows (one row: start + advance)
            self.frames.scatter_reduce_(0, slots, start + advance, reduce="amax")
        return torch.cat(pieces, dim=-1) if len(pieces) > 1 else pieces[0]
