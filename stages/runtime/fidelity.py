"""How far one way of computing a talker's logits lands from another's, and the bound a precision
change must keep (`mossvox check-precision`).

Two ways see the same inputs (prompts and the codes sampled so far), so their logits
`[R, C, V]` (R rows of C heads over V entries) compare code by code:

* `kl`: the mean KL divergence of the way's sampled distribution from the reference's, at the
  sampling temperature, nats a code;
* `top1`: the share of codes whose most likely entry is the reference's;
* `sampled`: the share of codes the serving sampler (`stages.runtime.sampling.sample_tokens`:
  temperature, top-k, top-p, the same seed, frame and head, so the same random numbers) draws
  the same from both.

The bound (`FidelityBound`): a precision change (the candidate) passes when its mean KL from
bf16 at the sampling temperature is at most 1e-3 nats a code: many times what bf16's own
rounding costs against fp32 (1e-5 to 5e-5 on the random checkpoints of docs/model_facts.md),
and what an 8-bit quantization of an LLM counted near lossless costs a token. A second of audio
is 150 codes (12 heads at 12.5 Hz): at 1e-3, even a test holding both models' likelihoods gathers
one nat of evidence from about seven seconds of audio. The two agreements are reported, not
judged: how often a code flips depends on how flat its distribution is (random weights'
near-uniform codes flip on changes a peaked released model would not notice), not only on the
change.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speech.sampling import SamplingParams
from stages.runtime.sampling import RowSampling, sample_tokens


@dataclass(frozen=True)
class Distance:
    """How far one way's logits are from a reference's over the same codes."""

    kl: float  # mean KL(reference || way) at the sampling temperature, nats a code
    top1: float  # share of codes with the reference's most likely entry
    sampled: float  # share of codes the serving sampler draws the same, same seed


@dataclass(frozen=True)
class FidelityBound:
    """What a precision change may cost against bf16 (module docstring)."""

    max_kl: float = 1e-3  # nats a code at the sampling temperature

    def failures(self, candidate: Distance) -> list[str]:
        """What `candidate` (against bf16) exceeds; empty: it passes."""
        if candidate.kl > self.max_kl:
            return [f"KL {candidate.kl:.3g} nats a code > {self.max_kl:g}"]
        return []

    def describe(self) -> str:
        return f"candidate vs bf16: mean KL at the sampling temperature <= {self.max_kl:g} nats a code"


def sampling_rows(params: SamplingParams, seeds: torch.Tensor) -> RowSampling:
    """The audio heads' settings of `params` for rows of request seeds [R] int64 (on their device);
    no repetition penalty."""
    rows, like = seeds.shape[0], dict(device=seeds.device)
    return RowSampling(
        temperature=torch.full((rows,), params.temperature, dtype=torch.float32, **like),
        top_k=torch.full((rows,), params.top_k, dtype=torch.int64, **like),
        top_p=torch.full((rows,), params.top_p, dtype=torch.float32, **like),
        repetition_penalty=torch.ones(rows, dtype=torch.float32, **like),
        greedy=torch.full((rows,), params.greedy, dtype=torch.bool, **like),
        seed=seeds.long())


def sampled_codes(logits: torch.Tensor, params: SamplingParams, seeds: torch.Tensor,
                  frames: torch.Tensor) -> torch.Tensor:
    """The codes the serving sampler draws: logits [R, C, V], seeds [R] and frames [R] int64 (each
    row's request seed and frame index) -> [R, C] int64, head c drawn as stream c."""
    settings = sampling_rows(params, seeds.to(logits.device))
    frames = frames.to(logits.device)
    return torch.stack([sample_tokens(logits[:, c], settings, frames, c) for c in range(logits.shape[1])], dim=1)


def distance(ref_logits: torch.Tensor, logits: torch.Tensor, ref_codes: torch.Tensor, codes: torch.Tensor,
             temperature: float) -> Distance:
    """ref_logits, logits [R, C, V]; ref_codes, codes [R, C] (`sampled_codes` of each) -> `Distance`."""
    p_log = torch.log_softmax(ref_logits.float() / temperature, dim=-1)
    q_log = torch.log_softmax(logits.float() / temperature, dim=-1)
    kl = (p_log.exp() * (p_log - q_log)).sum(-1).mean().item()
    top1 = (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item()
    sampled = (codes == ref_codes).float().mean().item()
    return Distance(kl=max(kl, 0.0), top1=top1, sampled=sampled)
