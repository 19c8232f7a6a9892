"""Continuous-batching talker runner of MOSS-TTS-Realtime (`TalkerRunner`, docs/interfaces.md).

The prompt array (`RealtimeProcessor.build_prompt`) holds the prefill rows (up to the audio BOS
row) and, after them, the text tokens still to stream. One `step()`:
1. schedule rows (`RowScheduler`) through the backbone over the paged KV cache
   (`ScheduledRunner.forward_scheduled`: one call, or decoding rows replayed from CUDA graphs);
2. for every request whose rows are all cached: the 16-codebook depth loop, batched, each
   codebook sampled per request (repetition penalty over that request's last 50 generated frames
   of the codebook, not at the prefill frame; then temperature, top-k, top-p, seeded draw). With
   graphs the ready requests are padded to a batch bucket and the whole loop (embeddings, local
   transformer, bans, penalty, sampling, history write) replays that bucket's graph
   (`stages.models.realtime.graphs.DepthGraphs`); padding rows use the scratch slot;
3. one device-to-host copy of the codes; the frame is emitted at once (streaming starts with the
   prefill step), and the next row is `[next text token, or <|text_pad|> once they run out | codes]`.
The request stops when codebook 0 is the audio EOS (1026; that frame is not emitted), at
`max_new_frames` ("length"), or after `forced_frames` ("stop"; random weights never emit EOS, and in
that mode EOS is banned too). The other non-code ids (pad 1024, BOS 1025, and EOS outside
codebook 0) are never sampled: the heads cover the whole 1027-id vocabulary, but a frame holding
one of them cannot be decoded (upstream samples them, as `upstream_sampling` does for the
comparisons with its outputs; a trained model all but never does, a random-weight one does
within a few frames).

Text while it speaks (`open_input`, then `feed`): the request's text arrives in pieces. When a
frame is sampled and no text token is left while more may come, the frame is emitted with
`paused` and its next row waits (`held`); the request takes no part in steps until `feed` brings
text (or says none will come, then `<|text_pad|>` follows). Each row is the same as with the
whole text up front, and sampling depends only on (seed, frame index), so the frames are too.
A forced length ends the request only once its input is final.

`graph_path` ("off" | "eager" | "cuda", `stages.runtime.graph_capture`) covers both the backbone's
decode rows and the depth loop: "off" runs the loop eagerly on the ready requests alone, "eager"
runs the graphs' body on the same padded static inputs without capture (the CPU tests), "cuda"
records one graph per batch bucket, every bucket at warm-up (`capture_decode_graphs`).
Per-request state the loop reads lives in slot-indexed device tensors (sampling settings,
repetition history ring, forced-length bans), one slot more than `max_running`: the scratch slot.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from speech.sampling import SamplingParams
from stages.models.realtime.graphs import DepthGraphs
from stages.models.realtime.model import RealtimeModel
from stages.models.realtime.processor import split_prompt
from stages.runtime.graph_capture import CaptureProgress, batch_buckets, resolve_graph_path
from stages.runtime.row_scheduler import RowRequest
from stages.runtime.sampling import SamplingSlots, sample_tokens
from stages.runtime.scheduled_runner import ScheduledRunner
from stages.runtime.talker_runner import FrameEvent

REPETITION_WINDOW = 50  # frames of history the repetition penalty looks at (upstream default)
HISTORY_RING = REPETITION_WINDOW + 1  # the window and the entry this frame writes (see `_depth`)


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
                 upstream_sampling: bool = False, **capacity) -> None:
        """`capacity`: `ScheduledRunner`'s KV, batching and attention settings. `graph_path`:
        "off" | "eager" | "cuda" for the backbone's decode rows and the depth loop (None = "cuda"
        with `cuda_graphs` on a CUDA device, else "off"; "cuda" off CUDA runs "eager").
        `upstream_sampling`: every codebook samples the heads' whole vocabulary as upstream does
        (pad, BOS and EOS anywhere, so a frame may not decode; unless the length is forced), for
        comparisons with upstream's outputs; off, only codes and codebook 0's EOS are drawn."""
        on_cuda = next(model.parameters()).device.type == "cuda"
        graph_path = resolve_graph_path(graph_path, cuda_graphs, on_cuda)
        super().__init__(model, model.language_model.config, backbone_graphs=graph_path, **capacity)
        self.config = model.config
        self.n_vq = self.config.rvq
        vocab = self.config.audio_vocab_size
        # one slot past the requests' (`scratch`): graph padding rows and held rows' replayed frames use it
        self.scratch = self.max_running
        self.sampling = SamplingSlots(self.scratch + 1, self.device)
        # ring of the last HISTORY_RING frames per slot (frame f at f % HISTORY_RING); unused entries hold
        # `vocab` (a dummy column)
        self.history = torch.full((self.scratch + 1, HISTORY_RING, self.n_vq), vocab, dtype=torch.long,
                                  device=self.device)
        self.forced_bans = torch.zeros(self.scratch + 1, dtype=torch.bool, device=self.device)
        ids = torch.arange(vocab, device=self.device)
        self._non_codes = ids >= self.config.audio_pad  # [vocab]: pad, BOS, EOS
        nothing = torch.zeros_like(self._non_codes)  # [vocab]
        # [vocab] each: what codebook 0 and the others may never draw (more when the length is forced)
        self._first_bans = nothing if upstream_sampling else self._non_codes & (ids != self.config.audio_eos)
        self._rest_bans = nothing if upstream_sampling else self._non_codes
        self._ring = torch.arange(HISTORY_RING, device=self.device)  # [HISTORY_RING]
        self._requests: dict[int, _Realtime] = {}
        self.depth_graphs: DepthGraphs | None = None
        if graph_path != "off":
            self.depth_graphs = DepthGraphs(self._depth, max_batch=self.max_running,
                                            hidden_size=self.config.hidden_size, dtype=self.dtype,
                                            scratch_slot=self.scratch, n_vq=self.n_vq, device=self.device,
                                            capture=graph_path == "cuda")

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
        self.history[sched.slot].fill_(self.config.audio_vocab_size)  # fills: no copy that waits for the GPU
        self.forced_bans[sched.slot].fill_(params.forced_frames is not None)

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
        self.sampling.flush()  # the settings of the requests added since the last step
        return super().step()

    def capture_decode_graphs(self, budget_s: float, progress: CaptureProgress | None = None) -> int:
        """The backbone's decode graphs of every batch bucket (with one table width,
        `ScheduledRunner.capture_decode_graphs`), then the depth-loop graphs of every batch bucket
        not made yet (one per bucket: always few), largest first, within `budget_s`; how many
        were made (0 without graphs), each counted in `progress`."""
        deadline = time.monotonic() + budget_s
        made = super().capture_decode_graphs(budget_s, progress)
        if self.depth_graphs is not None:
            with self.kernel_mode(), torch.inference_mode():
                made += self.depth_graphs.capture_ahead(batch_buckets(self.max_running), deadline - time.monotonic(),
                                                        progress)
        return made

    def _sample(self, ready: list[_Realtime], h: torch.Tensor) -> torch.Tensor:
        """Depth loop: h [B, H] -> codes [B, 16] (device), replayed from the batch bucket's graph
        with graphs. A held request (prefilled again after a preemption, no new frame) writes its
        history entry to the scratch slot instead of its own (see `_advance`)."""
        slots = [r.sched.slot for r in ready]
        frames = [r.frames for r in ready]
        writes = [s if r.held is None else self.scratch for s, r in zip(slots, ready)]
        if self.depth_graphs is not None:
            return self.depth_graphs.run(h, slots, frames, writes)
        packed = torch.tensor([slots, frames, writes], dtype=torch.long).to(self.device, non_blocking=True)  # [3, B]
        (codes,) = self._depth(h, packed[0], packed[1], packed[2])
        return codes

    def _depth(self, h: torch.Tensor, slots: torch.Tensor, frames: torch.Tensor,
               writes: torch.Tensor) -> tuple[torch.Tensor]:
        """The depth loop of one frame as pure device work (what `DepthGraphs` records): h [B, H],
        slots / frames / writes [B] (request slot, frame index, history slot written) -> (codes
        [B, 16],). Re-running it on the same inputs gives the same codes (capture runs it twice):
        the history entry it writes (frame f at f % HISTORY_RING) is left out of the penalty's
        window, which is the REPETITION_WINDOW frames before f."""
        vocab, local = self.config.audio_vocab_size, self.model.local_transformer
        entry = frames % HISTORY_RING  # [B]: this frame's ring entry
        history = self.history[slots]  # [B, HISTORY_RING, 16]
        history = history.masked_fill((self._ring[None, :] == entry[:, None])[:, :, None], vocab)
        seen = torch.zeros(len(slots), self.n_vq, vocab + 1, dtype=torch.bool, device=h.device)
        seen.scatter_(2, history.transpose(1, 2), True)  # [B, 16, vocab + 1]; column `vocab` = empty entry
        rows = self.sampling.rows(slots)
        # codebook 0 may end the request with EOS unless its length is forced; no codebook may
        # draw pad or BOS, nor codebooks 1.. EOS: a frame holding one cannot be decoded
        forced = self.forced_bans[slots][:, None] & self._non_codes[None]  # [B, vocab]
        first_bans, rest_bans = self._first_bans[None] | forced, self._rest_bans[None] | forced  # [B, vocab]
        kv = local.new_kv(len(slots), h.dtype, h.device)
        x, out = h, []
        for i in range(self.n_vq):
            bans = first_bans if i == 0 else rest_bans  # [B, vocab]
            logits = local.step(x, i, kv).float().masked_fill(bans, float("-inf"))  # [B, vocab]
            token = sample_tokens(logits, rows, frames, stream=i, seen=seen[:, i, :vocab])  # [B]
            out.append(token)
            if i < self.n_vq - 1:
                x = local.embed_code(i, token)
        codes = torch.stack(out, dim=1)  # [B, 16]
        self.history[writes, entry] = codes
        return (codes,)

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
