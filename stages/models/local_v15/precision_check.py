"""The fidelity check of a profile's precision changes on a Local-v1.5 checkpoint
(`mossvox check-precision`).

A precision change is a setting that rounds what the talker computes more coarsely than the
model's dtype: float8 weights and rows (`talker.fp8_weights`, `fp8_scheme` and the float8
kernels' flags) and a float8 KV cache (`talker.kv_cache_dtype: fp8`). The check runs the same
prompts three ways, each through the serving path the profile builds (`load_served_model`: its
fused projections, kernels and, on CUDA, torch.compile; the paged KV cache and the profile's
attention kernel, prompts prefilled, then one row a step):

* fp32: the profile without its precision changes, float32 weights and activations;
* bf16: the same in bfloat16, as served without the changes;
* candidate: the profile as it is, in bfloat16.

fp32 samples the trajectory: each prompt's frames, `frames` steps, drawn by the serving sampler
with the variant's sampling defaults and a seed a prompt (the stop head ignored). bf16 and the
candidate read the same rows, so every way's backbone sees the same history, and the local
block runs over the same codes (teacher forcing): logits `[prompts * frames, n_vq, codebook]`
each. `stages.runtime.fidelity` compares them and holds the bound (`FidelityBound`): the
candidate passes when its mean KL from bf16 at the sampling temperature is at most 1e-3 nats a
code; bf16 against fp32 is printed beside it for scale.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np
import torch

from profiles import Profile
from speech.job import SpeechJob
from speech.sampling import SamplingParams
from stages.models.local_v15.model import LocalV15Talker
from stages.models.local_v15.runner import load_served_model
from stages.models.local_v15.variant import LocalV15Variant
from stages.runtime.attention.backends import ReferenceAttention
from stages.runtime.attention.metadata import build_attention_metadata
from stages.runtime.batch_invariant import triton_runs_on
from stages.runtime.fidelity import Distance, FidelityBound, distance, sampled_codes, sampling_rows
from stages.runtime.fp8_linear import has_fp8_matmuls
from stages.runtime.kv_cache import PagedKVCache
from stages.runtime.runner_options import talker_runner_options
from stages.runtime.sampling import RowSampling, sample_tokens

# the talker settings that change precision, and their values without the change
PRECISION_OFF = {"fp8_weights": "none", "fp8_fused_swiglu": False, "fp8_fused_scales": False,
                 "fp8_fused_norms": False, "kv_cache_dtype": "auto"}
TEXTS = (
    "The quick brown fox jumps over the lazy dog, and then it runs back into the woods.",
    "Please hold the line; your call is important to us and will be answered shortly.",
    "今天天气很好，我们一起去公园散步吧。",
    "In 1969, two astronauts walked on the Moon while millions watched on television.",
    "Could you read the last paragraph again, a little more slowly this time?",
    "语音合成系统需要在低延迟的同时保持高质量的输出。",
    "Numbers like 3.14159 and dates like March 5th are hard for a speech model.",
    "She said, \"I'll be there by eight,\" but the train was already forty minutes late.",
)


@dataclass(frozen=True)
class PrecisionReport:
    """What `check_precision` found: the distances, the bound and the verdict."""

    changes: tuple[str, ...]  # the profile's precision settings, "talker.fp8_weights=backbone", ...
    bf16: Distance  # bf16 against fp32: what serving in bf16 already costs
    candidate: Distance  # the profile against bf16: what its changes cost (judged)
    candidate_fp32: Distance  # the profile against fp32
    bound: FidelityBound
    prompts: int
    frames: int
    device: str

    @property
    def failures(self) -> list[str]:
        return self.bound.failures(self.candidate)

    @property
    def passed(self) -> bool:
        return not self.failures

    def lines(self) -> list[str]:
        """The report as printed: settings, the table, the bound and PASS or FAIL."""
        out = [f"precision changes: {', '.join(self.changes) or 'none'}",
               f"{self.prompts} prompts x {self.frames} frames on {self.device}, each way reading fp32's sampled codes",
               f"{'':18s} {'KL (nats/code)':>14s} {'top-1 agree':>11s} {'sampled agree':>13s}"]
        for name, d in (("bf16 vs fp32", self.bf16), ("candidate vs bf16", self.candidate),
                        ("candidate vs fp32", self.candidate_fp32)):
            out.append(f"{name:18s} {d.kl:14.3e} {d.top1:11.4f} {d.sampled:13.4f}")
        out.append(f"bound: {self.bound.describe()}")
        out.extend(f"  exceeded: {f}" for f in self.failures)
        out.append("PASS" if self.passed else "FAIL")
        return out


def precision_changes(profile: Profile) -> tuple[str, ...]:
    """The profile's talker settings that change precision ("talker.NAME=value"; the float8
    scheme with float8 weights)."""
    t = profile.talker
    changed = [name for name, off in PRECISION_OFF.items() if getattr(t, name) != off]
    if t.fp8_weights != "none":
        changed.insert(1, "fp8_scheme")
    return tuple(f"talker.{name}={_value(getattr(t, name))}" for name in changed)


def check_precision(model_dir: str | Path, profile: Profile, device: str, *, prompts: int = 8, frames: int = 256,
                    seed: int = 0, bound: FidelityBound = FidelityBound(),
                    log: Callable[[str], None] = lambda line: None) -> PrecisionReport:
    """Run the check (module docstring) of `profile`'s precision changes on the Local-v1.5
    checkpoint `model_dir` on `device`; `log` gets a line as each way is done. ValueError where
    the device cannot run the changes (float8 matmuls before CUDA sm89)."""
    if profile.talker.fp8_weights != "none" and not has_fp8_matmuls(device):
        raise ValueError(f"talker.fp8_weights {profile.talker.fp8_weights}: {device} has no float8 matmuls "
                         "(CUDA sm89 and later, or the CPU); nothing to check here")
    variant = LocalV15Variant(model_dir, profile)
    params = variant.sampling_defaults
    rows = [variant.build_request(SpeechJob(text=TEXTS[i % len(TEXTS)])).prompt for i in range(prompts)]
    seeds = torch.arange(seed, seed + prompts, dtype=torch.int64)
    logits, codes = {}, None
    for name, dtype, precise in (("fp32", "float32", True), ("bf16", "bfloat16", True),
                                 ("candidate", "bfloat16", False)):
        start = time.perf_counter()
        way = _way(profile, dtype, device, precise=precise)
        logits[name], codes = way_logits(load_served_model(model_dir, way, device), way, device, rows, frames,
                                         params, seeds, codes)
        _release(device)
        log(f"{name}: {time.perf_counter() - start:.1f} s")
    row_seeds = seeds.repeat_interleave(frames)  # [prompts * frames]: rows are prompt-major
    row_frames = torch.arange(frames).repeat(prompts)
    drawn = {k: sampled_codes(v, params, row_seeds, row_frames) for k, v in logits.items()}

    def between(ref: str, way: str) -> Distance:
        return distance(logits[ref], logits[way], drawn[ref], drawn[way], params.temperature)

    return PrecisionReport(precision_changes(profile), between("fp32", "bf16"), between("bf16", "candidate"),
                           between("fp32", "candidate"), bound, prompts, frames, str(device))


@torch.inference_mode()  # as the runners' steps: the compiled parts meet inference tensors alone
def way_logits(model: LocalV15Talker, profile: Profile, device: str, prompts: list[np.ndarray], frames: int,
               params: SamplingParams, seeds: torch.Tensor,
               codes: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One way's audio logits over `frames` frames of each prompt [S_b, 1 + n_vq], through the
    serving path (paged KV cache, the profile's attention kernel and cache dtype): the prompts
    prefilled in one step, then one row a step. `codes` [B, frames, n_vq]: the frames to read
    (teacher forcing); None: drawn here by the serving sampler (seed per prompt, frame index)
    from the model's own local loop. Returns (logits [B * frames, n_vq, codebook] float32 on the
    CPU, codes [B, frames, n_vq])."""
    cfg = model.config
    b = len(prompts)
    dtype = model.transformer.norm.weight.dtype  # the way's
    block = profile.talker.kv_block_size
    blocks = sum(math.ceil((len(p) + frames) / block) for p in prompts)
    kv_dtype = torch.float8_e4m3fn if profile.talker.kv_cache_dtype == "fp8" else dtype
    cache = PagedKVCache(cfg.backbone.kv_cache_spec(blocks, block), dtype=kv_dtype, device=device)
    attention = talker_runner_options(profile, device)["attention"] or ReferenceAttention()

    def backbone(ids: torch.Tensor, lengths: list[int]) -> torch.Tensor:  # ids [N, 1 + n_vq] -> [N, H]
        meta = build_attention_metadata(cache, list(enumerate(lengths)), device)
        return model.transformer(model.embed_rows(ids), meta, cache, attention)

    lengths = [len(p) for p in prompts]
    h = backbone(torch.as_tensor(np.concatenate(prompts), device=device), lengths)  # [sum S, H]
    h = h[torch.tensor(lengths, device=device).cumsum(0) - 1]  # [B, H]: each prompt's last row
    drawn = codes is None
    codes = torch.empty((b, frames, cfg.n_vq), dtype=torch.int64) if drawn else codes
    settings = sampling_rows(params, seeds.to(device))
    hidden = []
    for t in range(frames):
        hidden.append(h)
        if drawn:  # the local loop as the class defines it (not a compiled copy: it takes the sampler)
            _, frame = LocalV15Talker.decode_frame(model, h, _FrameDraw(settings, t))
            codes[:, t] = frame.cpu()
        if t + 1 < frames:
            row = torch.cat([torch.full((b, 1), cfg.gen_slot, dtype=torch.int64), codes[:, t]], dim=1)
            h = backbone(row.to(device), [1] * b)  # [B, H]
    flat = torch.stack(hidden, dim=1).reshape(b * frames, -1).to(dtype)  # [B * frames, H], as the local block takes it
    _, audio = model.teacher_forced_logits(flat, codes.reshape(b * frames, -1).to(device))
    return audio.float().cpu(), codes


class _FrameDraw:
    """The serving sampler for one frame of every prompt (`FrameSampler`): codes drawn with the
    prompts' seeds at frame `t`; never a stop (the check runs a fixed number of frames)."""

    def __init__(self, settings: RowSampling, t: int) -> None:
        self.settings = settings
        self.frames = torch.full_like(settings.seed, t)

    def stop(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)

    def code(self, codebook: int, logits: torch.Tensor) -> torch.Tensor:
        return sample_tokens(logits, self.settings, self.frames, codebook)


def _way(profile: Profile, dtype: str, device: str, *, precise: bool) -> Profile:
    """The profile at `dtype`, without its precision changes when `precise`. Where Triton cannot
    run (the CPU), the local steps attend plainly instead of by kernel (the same arithmetic)."""
    t = profile.talker
    if precise:
        t = msgspec.structs.replace(t, **PRECISION_OFF)
    if t.local_attention == "kernel" and not triton_runs_on(device):
        t = msgspec.structs.replace(t, local_attention="plain")
    return msgspec.structs.replace(profile, model=msgspec.structs.replace(profile.model, dtype=dtype), talker=t)


def _release(device: str) -> None:
    """Free a way's model before the next is loaded (its compiled graphs too)."""
    gc.collect()
    if str(device).startswith("cuda"):
        torch._dynamo.reset()
        torch.cuda.empty_cache()


def _value(v: object) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)
