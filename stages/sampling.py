"""Per-request sampling parameters and batched, batch-invariant token sampling.

The order of operations is upstream MOSS-TTS-Local v1.5 `_sample_next_token`: repetition penalty
(over this request's own generated tokens of that codebook), then greedy argmax if asked, else
temperature, top-k (keep scores >= the k-th largest), top-p (sorted cumulative softmax, the top
token always kept), and a draw from the softmax.

The draw is `argmax(probs / E)` with `E ~ Exp(1)` i.i.d. per vocabulary entry (the exponential
race, equal in distribution to `torch.multinomial`). `E` comes from a counter-based hash of
(seed, frame index, stream, vocabulary index) computed with integer tensor ops, so a request's
random numbers depend only on its own seed and position, never on its batch neighbours or on
call order; no generator state, no host sync, graph-capturable.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import torch


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How one request samples. Defaults: MOSS-TTS-Local-v1.5 model card (audio T 1.7, top-p 0.8,
    top-k 25, repetition penalty 1.0; stop head T 1.0, top-k 50, top-p 1.0).

    `greedy`: argmax everywhere (after the repetition penalty), as upstream `do_sample=False`.
    `seed`: the request's random stream. `max_new_frames`: frame budget (finish reason "length").
    `forced_frames`: stop after exactly this many frames regardless of the stop head (random
    weights never stop by themselves); None leaves the decision to the model.
    """

    temperature: float = 1.7
    top_p: float = 0.8
    top_k: int = 25
    repetition_penalty: float = 1.0
    text_temperature: float = 1.0
    text_top_p: float = 1.0
    text_top_k: int = 50
    greedy: bool = False
    seed: int = 0
    max_new_frames: int = 4096
    forced_frames: int | None = None


# ---------------------------------------------------------------- filters (batched, per-row params)


def apply_repetition_penalty(scores: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """scores [B, V]; seen [B, V] bool (tokens generated before); penalty [B].
    Seen tokens: score * p when negative, score / p otherwise. p == 1 is exact identity."""
    p = penalty.to(scores.dtype)[:, None]
    penalised = torch.where(scores < 0, scores * p, scores / p)
    return torch.where(seen, penalised, scores)


def top_k_filter(scores: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Mask scores below the k-th largest of each row; rows with k <= 0 or k >= V are untouched."""
    vocab = scores.shape[-1]
    active = (top_k > 0) & (top_k < vocab)  # [B]
    k = top_k.clamp(1, vocab).long()
    kth = scores.sort(dim=-1, descending=True).values.gather(-1, (k - 1)[:, None])  # [B, 1]
    kth = torch.where(active[:, None], kth, torch.full_like(kth, -torch.inf))
    return scores.masked_fill(scores < kth, -torch.inf)


def top_p_filter(scores: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Nucleus filter of each row; rows with p <= 0 or p >= 1 are untouched."""
    active = (top_p > 0) & (top_p < 1)  # [B]
    sorted_scores, order = scores.sort(dim=-1, descending=True)
    cumulative = sorted_scores.softmax(-1).cumsum(-1)  # [B, V]
    remove_sorted = cumulative > top_p.to(cumulative.dtype)[:, None]
    remove_sorted = torch.cat([torch.zeros_like(remove_sorted[:, :1]), remove_sorted[:, :-1]], dim=-1)
    remove_sorted &= active[:, None]
    remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
    return scores.masked_fill(remove, -torch.inf)


# ---------------------------------------------------------------- counter-based noise

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32), split so no int64 product overflows."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (lowbias32): every input bit affects every output bit."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def exponential_noise(seed: torch.Tensor, frame: torch.Tensor, stream: int, vocab: int) -> torch.Tensor:
    """Exp(1) noise [B, vocab] that is a pure function of (seed [B], frame [B], stream, index)."""
    seed = seed.long()
    key = _mix32(seed & _MASK32)
    key = _mix32(key ^ ((seed >> 32) & _MASK32))
    key = _mix32(key ^ (frame.long() & _MASK32))
    key = _mix32(key ^ (stream & _MASK32))  # [B]
    index = torch.arange(vocab, device=seed.device, dtype=torch.long)
    h = _mix32(_mix32(key[:, None] ^ index[None, :]))  # [B, V]
    uniform = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # (0, 1), 24 exact bits
    return -torch.log(uniform)


# ---------------------------------------------------------------- the sampler


@dataclass(frozen=True)
class RowSampling:
    """Per-row sampling settings for one head call (all [B] tensors on the logits' device)."""

    temperature: torch.Tensor  # float32
    top_k: torch.Tensor  # int64
    top_p: torch.Tensor  # float32
    repetition_penalty: torch.Tensor  # float32
    greedy: torch.Tensor  # bool
    seed: torch.Tensor  # int64


def sample_tokens(
    logits: torch.Tensor,  # [B, V]
    rows: RowSampling,
    frame: torch.Tensor,  # [B] int64: the request's frame index (noise counter)
    stream: int,  # which head of the frame (codebook index, or n_vq for the stop head)
    seen: torch.Tensor | None = None,  # [B, V] bool: this request's earlier tokens of this stream
) -> torch.Tensor:  # [B] int64
    scores = logits.float()
    if seen is not None:
        scores = apply_repetition_penalty(scores, seen, rows.repetition_penalty)
    greedy_tokens = scores.argmax(-1)
    greedy = rows.greedy | (rows.temperature <= 0)  # T <= 0 means greedy, as in HF generate
    scores = scores / rows.temperature.clamp_min(1e-6)[:, None]
    scores = top_p_filter(top_k_filter(scores, rows.top_k), rows.top_p)
    probs = scores.softmax(-1)
    noise = exponential_noise(rows.seed, frame, stream, scores.shape[-1])
    sampled = (probs / noise).argmax(-1)
    return torch.where(greedy, greedy_tokens, sampled)


class SamplingSlots:
    """Sampling settings of every request slot, kept on the device and gathered per step."""

    def __init__(self, num_slots: int, device: torch.device | str) -> None:
        def f32():
            return torch.ones(num_slots, dtype=torch.float32, device=device)

        def i64():
            return torch.zeros(num_slots, dtype=torch.int64, device=device)

        self.audio = {"temperature": f32(), "top_k": i64(), "top_p": f32(), "repetition_penalty": f32()}
        self.text = {"temperature": f32(), "top_k": i64(), "top_p": f32(), "repetition_penalty": f32()}
        self.greedy = torch.zeros(num_slots, dtype=torch.bool, device=device)
        self.seed = i64()

    def write(self, slot: int, p: SamplingParams) -> None:
        for table, values in (
            (self.audio, (p.temperature, p.top_k, p.top_p, p.repetition_penalty)),
            (self.text, (p.text_temperature, p.text_top_k, p.text_top_p, 1.0)),
        ):
            for name, value in zip(("temperature", "top_k", "top_p", "repetition_penalty"), values):
                table[name][slot] = value
        self.greedy[slot] = p.greedy
        self.seed[slot] = p.seed

    def rows(self, slots: torch.Tensor, *, text: bool = False) -> RowSampling:
        """The settings of `slots [B]` for the audio heads (or the stop/text head)."""
        table = self.text if text else self.audio
        return RowSampling(**{k: v[slots] for k, v in table.items()}, greedy=self.greedy[slots], seed=self.seed[slots])
