"""Continuous-batching talker runner of MOSS-TTS-Realtime (`TalkerRunner`, docs/interfaces.md).

The prompt array (`RealtimeProcessor.build_prompt`) holds the prefill rows (up to the audio BOS
row) and, after them, the text tokens still to stream. One `step()`:
1. schedule rows (`RowScheduler`) through the backbone over the paged KV cache
   (`ScheduledRunner.forward_scheduled`: one call, or decoding rows replayed from CUDA graphs);
2. for every request whose rows are all cached: the 16-codebook depth loop, batched, each
   codebook sampled per request (repetition penalty over that request's last 50 generated frames
   of the codebook, not at the prefill frame; then temperature, top-k, top-p, seeded draw);
3. one device-to-host copy of the codes; the frame is emitted at once (streaming starts with the
   prefill step), and the next row is `[next text token, or <|text_pad|> once they run out | codes]`.
The request stops when codebook 0 is the audio EOS (1026; that frame is not emitted), at
`max_new_frames` ("length"), or after `forced_frames` ("stop"; random weights never emit EOS, and in
that mode the non-code ids 1024..1026 are banned so every frame is decodable).

Text while it speaks (`open_input`, then `feed`): the request's text arrives in pieces. When a
frame is sampled and no text token is left while more may come, the frame is emitted with
`paused` and its next row waits (`held`); the request takes no part in steps until `feed` brings
text (or says none will come, then `<|text_pad|>` follows). Each row is the same as with the
whole text up front, and sampling depends only on (seed, frame index), so the frames are too.
A forced length ends the request only once its input is final.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from speech.sampling import SamplingParams
from stages.models.realtime.model import RealtimeModel
from stages.models.realtime.processor import split_prompt
from stages.runtime.graph_capture import resolve_graph_path
from stages.runtime.row_scheduler import RowRequest
from stages.runtime.sampling import SamplingSlots, sample_tokens
from stages.runtime.scheduled_runner import ScheduledRunner
from stages.runtime.talker_runner import FrameEvent

REPETITION_WINDOW = 50  # frames of history the repetition penalty looks at (upstream default)


@dataclass(eq=False)
class _Realtime:
    sched: RowRequest
    params: SamplingParams
    text: list[int]  # text ids still to feed, one per frame
    frames: int = 0
    forced: int | None = None  # forced length: params.forced_frames, or the final feed's
    open_input: bool = False  # more text may come (`feed`)
    held: np.ndarray | None = None  # paused: the last frame's codes, its next row waiting for text


class RealtimeRunner(ScheduledRunner):
    def __init__(self, model: RealtimeModel, *, cuda_graphs: bool = False, graph_path: str | None = None,
                 **capacity) -> None:
        """`capacity`: `ScheduledRunner`'s KV, batching and attention settings. `graph_path`:
        "off" | "eager" | "cuda" for the backbone's decode rows (None = "cuda" with `cuda_graphs`
        on a CUDA device, else "off"); the depth loop runs eagerly."""
        on_cuda = next(model.parameters()).device.type == "cuda"
        super().__init__(model, model.language_model.config,
                         backbone_graphs=resolve_graph_path(graph_path, cuda_graphs, on_cuda), **capacity)
        self.config = model.config
        self.n_vq = self.config.rvq
        max_running = self.max_running
        self.sampling = SamplingSlots(max_running, self.device)
        # last REPETITION_WINDOW frames per slot; unused entries hold `vocab` (a dummy column)
        self.history = torch.full((max_running, REPETITION_WINDOW, self.n_vq), self.config.audio_vocab_size,
                                  dtype=torch.long, device=self.device)
        self.forced_bans = torch.zeros(max_running, dtype=torch.bool, device=self.device)
        self._requests: dict[int, _Realtime] = {}

    @classmethod
    def from_dir(cls, model_dir: str | Path, *, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 **options) -> RealtimeRunner:
        return cls(RealtimeModel.from_dir(model_dir, device=device, dtype=dtype), **options)

    # ---- requests ------------------------------------------------------------------------------

    def add(self, rid: int, prompt: np.ndarray, params: SamplingParams) -> None:
        prompt = self._checked_prompt(rid, prompt, params)
        prefill, text = split_prompt(prompt, self.config.audio_bos)
        sched = self.scheduler.add(rid, prefill)
        self._requests[rid] = _Realtime(sched, params, text, forced=params.forced_frames)
        self.sampling.write(sched.slot, params)
        self.history[sched.slot] = self.config.audio_vocab_size
        self.forced_bans[sched.slot] = params.forced_frames is not None

    def open_input(self, rid: int) -> None:
        """More text comes later (`feed`): pause when it runs out instead of padding."""
        self._requests[rid].open_input = True

    def feed(self, rid: int, rows: np.ndarray, *, final: bool, forced_frames: int | None = None) -> None:
        """Text rows `[n, 1 + n_vq]` (the id in column 0) appended to the request's text; `final`:
        no more comes (`forced_frames` then replaces a forced length). Unknown rids are ignored."""
        req = self._requests.get(rid)
        if req is None:
            return
        req.text.extend(int(t) for t in np.asarray(rows).reshape(-1, 1 + self.n_vq)[:, 0])
        if final:
            req.open_input = False
            if req.forced is not None and forced_frames is not None:
                req.forced = forced_frames
        if req.held is not None and (req.text or not req.open_input):
            held, req.held = req.held, None
            self._next_row(req, held)

    # ---- one step (`ScheduledRunner.step`) ------------------------------------------------------

    def step(self) -> list[FrameEvent]:
        if all(req.held is not None for req in self._requests.values()):
            return []  # every request waits for text (none at all: nothing to do either)
        return super().step()

    def _sample(self, ready: list[_Realtime], h: torch.Tensor) -> torch.Tensor:
        """Depth loop: h [B, H] -> codes [B, 16] (device)."""
        dev, vocab, local = self.device, self.config.audio_vocab_size, self.model.local_transformer
        slots = torch.tensor([r.sched.slot for r in ready]).to(dev, non_blocking=True)
        frames = torch.tensor([r.frames for r in ready], dtype=torch.long).to(dev, non_blocking=True)
        rows = self.sampling.rows(slots)
        history = self.history[slots]  # [B, W, 16]
        seen = torch.zeros(len(ready), self.n_vq, vocab + 1, dtype=torch.bool, device=dev)
        seen.scatter_(2, history.transpose(1, 2), True)  # [B, 16, vocab + 1]; column `vocab` = empty entry
        bans = self.forced_bans[slots][:, None] & (torch.arange(vocab, device=dev) >= self.config.audio_pad)[None]
        kv = local.new_kv(len(ready), h.dtype, dev)
        x, out = h, []
        for i in range(self.n_vq):
            logits = local.step(x, i, kv).float().masked_fill(bans, float("-inf"))  # [B, vocab]
            token = sample_tokens(logits, rows, frames, stream=i, seen=seen[:, i, :vocab])
            out.append(token)
            if i < self.n_vq - 1:
                x = local.embed_code(i, token)
        codes = torch.stack(out, dim=1)  # [B, 16]
        fresh = [i for i, r in enumerate(ready) if r.held is None]  # (see `_advance`)
        if len(fresh) < len(ready):
            keep = torch.tensor(fresh, dtype=torch.long).to(dev, non_blocking=True)
            self.history[slots[keep], frames[keep] % REPETITION_WINDOW] = codes[keep]
        else:
            self.history[slots, frames % REPETITION_WINDOW] = codes
        return codes

    def _advance(self, req: _Realtime, codes: np.ndarray) -> FrameEvent | None:
        if req.held is not None:  # paused and prefilled again after a preemption: no new frame
            return None
        rid, p = req.sched.rid, req.params
        if req.forced is None and codes[0] == self.config.audio_eos:
            self.remove(rid)
            return FrameEvent(rid, None, finished=True, reason="stop")
        req.frames += 1
        reason = None
        if req.forced is not None and req.frames >= req.forced and not req.open_input:
            reason = "stop"
        elif req.frames >= p.max_new_frames:
            reason = "length"
        if reason is not None:
            self.remove(rid)
            return FrameEvent(rid, codes.copy(), finished=True, reason=reason)
        if req.open_input and not req.text:
            req.held = codes.copy()
            return FrameEvent(rid, codes.copy(), paused=True)
        self._next_row(req, codes)
        return FrameEvent(rid, codes.copy())

    def _next_row(self, req: _Realtime, codes: np.ndarray) -> None:
        """The row after a frame: the next text token (or the text pad) beside its codes."""
        row = np.empty(1 + self.n_vq, dtype=np.int64)
        row[0] = req.text.pop(0) if req.text else self.config.text_pad
        row[1:] = codes
        req.sched.rows.append(row)
