"""Continuous-batching talker runner of the Delay family (`TalkerRunner`, docs/interfaces.md).

One `step()`:
1. schedule rows (`RowScheduler`): one row per decoding request, prefill chunks for new ones,
   through the backbone over the paged KV cache (`ScheduledRunner.forward_scheduled`: one call,
   or the decoding rows replayed from CUDA graphs and the chunks in one call);
2. for every request whose rows are all in the cache: text and audio heads on its last hidden
   state, upstream's step rules (`DelayState`: text masks / forced drain, which channels are
   sampled), temperature, then repetition penalty, top-k, top-p and a per-request seeded draw
   (`stages.runtime.sampling`), all batched on the device;
3. one device-to-host copy of the new rows; the host advances each state machine and feeds the
   audio channels to the request's incremental de-delayer.

Streaming: frame t leaves as soon as the row carrying its last codebook is sampled, i.e. n_vq
rows after its first codebook, never at the end of the utterance. A request finishes right after
the last forced delay slot (every frame of its audio block is out; the deterministic audio_end
row is not computed), on im_end, or at its row budget. `finish_on_audio_end=False` keeps
upstream's behaviour of generating until im_end (used to reproduce upstream runs exactly).

Repetition history as upstream: all rows of the request (prompt included); codebook 0 has its own
set, codebooks 1..n_vq-1 share one set (upstream flattens them into one call). Per request, never
across the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from speech.sampling import SamplingParams
from stages.models.delay.config import DelayConfig
from stages.models.delay.delay_pattern import IncrementalDeDelayer
from stages.models.delay.model import DelayModel
from stages.models.delay.state import INSIDE_AUDIO, DelayState, TextRule
from stages.runtime.graph_capture import resolve_graph_path
from stages.runtime.row_scheduler import RowRequest
from stages.runtime.sampling import RowSampling, sample_tokens
from stages.runtime.scheduled_runner import ScheduledRunner
from stages.runtime.talker_runner import FrameEvent


@dataclass(eq=False)
class _Delay:
    """Per-request generation state (host side)."""

    sched: RowRequest
    params: SamplingParams
    state: DelayState
    dedelay: IncrementalDeDelayer | None  # the open audio block's de-delayer
    skip_frames: int  # frames of the open block that belong to the prompt (continuation)
    rows_generated: int = 0
    frames_emitted: int = 0
    length_forced: bool = False  # the drain was forced by the frame budget


class DelayRunner(ScheduledRunner):
    def __init__(self, model: DelayModel, *, finish_on_audio_end: bool = True, cuda_graphs: bool = False,
                 graph_path: str | None = None, **capacity) -> None:
        """`capacity`: `ScheduledRunner`'s KV, batching and attention settings. `graph_path`:
        "off" | "eager" | "cuda" for the backbone's decode rows (None = "cuda" with `cuda_graphs`
        on a CUDA device, else "off"; `stages.runtime.graph_capture.resolve_graph_path`)."""
        on_cuda = next(model.parameters()).device.type == "cuda"
        # rank_config: this rank's KV heads
        super().__init__(model, model.language_model.rank_config,
                         backbone_graphs=resolve_graph_path(graph_path, cuda_graphs, on_cuda), **capacity)
        self.config: DelayConfig = model.config
        cfg = self.config
        self.n_vq = cfg.n_vq
        self.finish_on_audio_end = finish_on_audio_end
        dev = self.device
        # repetition history per slot: [slot, 0] codebook 0, [slot, 1] codebooks 1..n_vq-1
        self.seen = torch.zeros(self.max_running, 2, cfg.audio_rows, dtype=torch.bool, device=dev)
        vocab = cfg.vocab_size
        outside = torch.zeros(vocab, dtype=torch.bool)
        outside[[cfg.pad_token_id, cfg.gen_slot, cfg.delay_slot, cfg.audio_end]] = True
        inside = torch.ones(vocab, dtype=torch.bool)
        inside[[cfg.gen_slot, cfg.delay_slot]] = False
        self._text_bans = torch.stack([outside, inside]).to(dev)  # [2, V]: banned ids per mode
        self._inside_ids = torch.tensor(sorted((cfg.gen_slot, cfg.delay_slot)), device=dev)  # the 2 ids allowed in audio
        self._codebooks = torch.arange(cfg.n_vq, device=dev)
        self._history_rows = torch.arange(2, device=dev)  # [2] the rows of `seen`, as index tensors
        self._requests: dict[int, _Delay] = {}

    @classmethod
    def from_dir(cls, model_dir: str | Path, *, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 **options) -> DelayRunner:
        return cls(DelayModel.from_dir(model_dir, device=device, dtype=dtype), **options)

    # ---- requests ------------------------------------------------------------------------------

    def add(self, rid: int, prompt: np.ndarray, params: SamplingParams) -> None:
        cfg = self.config
        prompt = self._checked_prompt(rid, prompt, params)
        sched = self.scheduler.add(rid, prompt)
        text = prompt[:, 0].tolist()
        state = DelayState.for_prompt(text, cfg)
        dedelay, skip = None, 0
        if state.is_audio:  # continuation: replay the prompt's open audio block into a de-delayer
            start = len(text) - state.audio_len
            dedelay = IncrementalDeDelayer(self.n_vq)
            for row in prompt[start + 1 :, 1:]:
                dedelay.push(row)
            skip = dedelay.rows_fed
        self._requests[rid] = _Delay(sched, params, state, dedelay, skip)
        codes = torch.from_numpy(prompt[:, 1:]).to(self.device, non_blocking=True)
        seen = self.seen[sched.slot]  # [2, audio_rows]; no write waits for the step in flight:
        seen.zero_()  # fills and device values, no host-to-device copy of a Python value
        seen[0].index_put_((codes[:, 0],), self._true)
        seen[1].index_put_((codes[:, 1:].flatten(),), self._true)

    # ---- one step (`ScheduledRunner.step`) ------------------------------------------------------

    def _frame_limit(self, req: _Delay) -> int:
        forced = req.params.forced_frames
        return min(forced, req.params.max_new_frames) if forced is not None else req.params.max_new_frames

    def _sample(self, ready: list[_Delay], h: torch.Tensor) -> torch.Tensor:
        """h [B, H] -> new rows [B, 1 + n_vq] (device)."""
        cfg, dev, n_vq = self.config, self.device, self.n_vq
        rules, forced, lo, hi = [], [], [], []
        for req in ready:
            rule = req.state.text_rule(cfg)
            override = req.state.length_override(cfg, self._frame_limit(req), req.params.forced_frames is not None)
            if override == cfg.delay_slot:
                req.length_forced = req.params.forced_frames is None
            rules.append(rule)
            forced.append(override if override is not None else rule.forced)
            a, b = req.state.audio_channels()
            lo.append(a)
            hi.append(b)
        p = [req.params for req in ready]
        slots = torch.tensor([req.sched.slot for req in ready]).to(dev, non_blocking=True)
        steps = torch.tensor([req.state.step for req in ready], dtype=torch.long).to(dev, non_blocking=True)

        def per_row(values, dtype):
            return torch.tensor(values, dtype=dtype).to(dev, non_blocking=True)

        seed = per_row([x.seed for x in p], torch.long)
        text = self._sample_text(h, p, rules, forced, steps, seed)  # [B]
        # ---- audio channels: temperature, then repetition penalty, top-k, top-p, draw (all codebooks at once)
        audio_t = per_row([x.temperature if x.temperature > 0 else 1.0 for x in p], torch.float32)
        audio_logits = self.model.audio_logits(h).float() / audio_t[:, None, None]  # [B, n_vq, R]
        B, R = len(ready), cfg.audio_rows
        seen = self.seen[slots]  # [B, 2, R]
        seen = torch.cat([seen[:, :1], seen[:, 1:].expand(B, n_vq - 1, R)], dim=1)  # [B, n_vq, R]

        def each_codebook(t):
            return t.repeat_interleave(n_vq)

        audio_rows = RowSampling(
            temperature=torch.ones(B * n_vq, device=dev),
            top_k=each_codebook(per_row([x.top_k for x in p], torch.long)),
            top_p=each_codebook(per_row([x.top_p for x in p], torch.float32)),
            repetition_penalty=each_codebook(per_row([x.repetition_penalty for x in p], torch.float32)),
            greedy=each_codebook(per_row([x.greedy or x.temperature <= 0 for x in p], torch.bool)),
            seed=each_codebook(seed))
        counters = (steps[:, None] * (n_vq + 1) + 1 + self._codebooks[None, :]).flatten()  # [B * n_vq]
        codes = sample_tokens(audio_logits.flatten(0, 1), audio_rows, counters, stream=0,
                              seen=seen.flatten(0, 1)).view(B, n_vq)
        k = self._codebooks[None, :]
        sampled = (k >= per_row(lo, torch.long)[:, None]) & (k < per_row(hi, torch.long)[:, None])
        codes = torch.where(sampled, codes, torch.full_like(codes, cfg.audio_pad_code))  # [B, n_vq]
        self.seen.index_put_((slots, self._history_rows[:1], codes[:, 0]), self._true)
        self.seen.index_put_((slots[:, None], self._history_rows[1:], codes[:, 1:]), self._true)
        return torch.cat([text[:, None], codes], dim=1)

    def _sample_text(self, h: torch.Tensor, p: list[SamplingParams], rules: list[TextRule],
                     forced: list[int | None], steps: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
        """The text channel of every ready row: h [B, H] -> ids [B].

        Forced rows need no head. Rows sampled inside audio may only be gen_slot or delay_slot,
        so their head is those 2 rows of `lm_heads.0` (exact: every other logit is -inf there);
        only rows outside audio compute the full vocabulary. Temperature first, then the state's
        masks, then top-k / top-p / the seeded draw, as upstream.
        """
        cfg, dev, n_vq = self.config, self.device, self.n_vq
        text = torch.tensor([-1 if f is None else f for f in forced], dtype=torch.long).to(dev, non_blocking=True)
        inside = [i for i, (r, f) in enumerate(zip(rules, forced)) if f is None and r.mode == INSIDE_AUDIO]
        outside = [i for i, (r, f) in enumerate(zip(rules, forced)) if f is None and r.mode != INSIDE_AUDIO]
        head = self.model.lm_heads[0]  # [V, H]
        for rows, is_inside in ((inside, True), (outside, False)):
            if not rows:
                continue
            index = torch.tensor(rows, dtype=torch.long).to(dev, non_blocking=True)
            sub = [p[i] for i in rows]
            temp = torch.tensor([x.text_temperature if x.text_temperature > 0 else 1.0 for x in sub]).to(dev)
            ban_delay = torch.tensor([rules[i].ban_delay_slot for i in rows]).to(dev, non_blocking=True)
            if is_inside:
                ids = self._inside_ids  # [2]: gen_slot, delay_slot in id order
                bias = head.bias[ids] if head.bias is not None else None
                logits = F.linear(h[index], head.weight[ids], bias).float() / temp[:, None]  # [b, 2]
                bans = (ids == cfg.delay_slot)[None, :] & ban_delay[:, None]
            else:
                logits = self.model.text_logits(h[index]).float() / temp[:, None]  # [b, V]
                bans = self._text_bans[0].expand_as(logits).clone()
                bans[:, cfg.delay_slot] |= ban_delay
                bans[:, cfg.im_end] |= torch.tensor([rules[i].ban_im_end for i in rows]).to(dev, non_blocking=True)
            sampling = RowSampling(
                temperature=torch.ones_like(temp),
                top_k=torch.tensor([x.text_top_k for x in sub], dtype=torch.long).to(dev, non_blocking=True),
                top_p=torch.tensor([x.text_top_p for x in sub], dtype=torch.float32).to(dev, non_blocking=True),
                repetition_penalty=torch.ones_like(temp),
                greedy=torch.tensor([x.greedy or x.text_temperature <= 0 for x in sub]).to(dev, non_blocking=True),
                seed=seed[index])
            choice = sample_tokens(logits.masked_fill(bans, float("-inf")), sampling, steps[index] * (n_vq + 1),
                                   stream=0)
            text[index] = self._inside_ids[choice] if is_inside else choice
        return text

    def _advance(self, req: _Delay, row: np.ndarray) -> FrameEvent | None:
        """Apply one sampled row on the host: state machine, de-delay, finish rules."""
        cfg, state = self.config, req.state
        text = int(row[0])
        state.advance(text, cfg)
        req.sched.rows.append(row)
        req.rows_generated += 1
        codes = None
        if text == cfg.audio_start:
            req.dedelay, req.skip_frames = IncrementalDeDelayer(self.n_vq), 0
        elif text in (cfg.gen_slot, cfg.delay_slot) and req.dedelay is not None:
            frame = req.dedelay.push(row[1:])
            index = req.dedelay.rows_fed - self.n_vq  # the frame just released
            if frame is not None and index >= req.skip_frames:
                codes = frame
                req.frames_emitted += 1
        reason = None
        if state.stopping:
            reason = "stop"
        elif state.block_complete and self.finish_on_audio_end:
            reason = "length" if req.length_forced else "stop"
        elif req.rows_generated >= req.params.max_new_frames + self.n_vq + 2:
            reason = "length"  # the model never opened or closed audio within its budget
        if reason is not None:
            self.remove(req.sched.rid)
            return FrameEvent(req.sched.rid, codes, finished=True, reason=reason)
        return FrameEvent(req.sched.rid, codes) if codes is not None else None
