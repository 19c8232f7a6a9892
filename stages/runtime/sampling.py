"""Batched, batch-invariant token sampling over per-request settings (`speech.sampling.SamplingParams`).

The order of operations is upstream MOSS-TTS-Local v1.5 `_sample_next_token`: repetition penalty
(over this request's own generated tokens of that codebook), then greedy argmax if asked, else
temperature, top-k (keep scores >= the k-th largest), top-p (sorted cumulative softmax, the top
token always kept), and a draw from the softmax.

The draw is `argmax(probs / E)` with `E ~ Exp(1)` i.i.d. per vocabulary entry (the exponential
race, equal in distribution to `torch.multinomial`). `E` comes from a counter-based hash of
(seed, frame index, stream, vocabulary index) computed with integer tensor ops, so a request's
random numbers depend only on its own seed and position, never on its batch neighbours or on
call order; no generator state, no host sync, graph-capturable.

Everything happens in rank order: the scores are ranked once (value descending, vocabulary index
ascending on ties), top-k is a threshold on the ranked values, top-p a prefix of their cumulative
mass, and the race runs over ranked entries with the noise of each entry's vocabulary index
(`exponential_noise` takes an index tensor). Against the previous implementation (two full sorts,
a scatter, noise for the whole vocabulary; kept as `bench.kernels.sampling.legacy_sample_tokens`)
the tokens are the same except where float rounding decides (the race and the top-p sum skip the
softmax normaliser) and where the noise is 0 (U rounds to 1, 2**-24 of the entries): such an
entry is never drawn, where the previous code drew it even when filtered out (0 / -0.0 = NaN won).

Candidate path (`sample_tokens(..., candidates=True)`): when a row's top-k is in [1, K_CAP] (or
the head has at most K_CAP entries, like the 2-entry stop head), only the K_CAP best scores can be
drawn, so `topk` replaces the full sort and the noise is hashed for K_CAP entries, not the whole
vocabulary. The full path splits its ranking at K_CAP and does the head's arithmetic on a tensor
of the same shape, so both paths draw bit-identical tokens for such rows. The one exception is a
tie reaching past the cap: the k-th largest score equal to the (K_CAP + 1)-th (the full path keeps
every tied entry), or, for greedy rows, more than K_CAP entries sharing the maximum. A row outside
the cap on the candidate path is sampled from its K_CAP best entries only: the caller (which knows
every request's parameters on the host) picks the path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from speech.sampling import SamplingParams

K_CAP = 64  # candidates of `sample_tokens(..., candidates=True)`; the full path splits its ranking here


# ---------------------------------------------------------------- repetition penalty


def apply_repetition_penalty(scores: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """scores [B, V]; seen [B, V] bool (tokens generated before); penalty [B].
    Seen tokens: score * p when negative, score / p otherwise. p == 1 is exact identity."""
    p = penalty.to(scores.dtype)[:, None]
    penalised = torch.where(scores < 0, scores * p, scores / p)
    return torch.where(seen, penalised, scores)


# ---------------------------------------------------------------- counter-based noise

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (lowbias32) on int64 holding values in [0, 2**32): every input
    bit affects every output bit. An int64 product wraps modulo 2**64, so its low 32 bits are
    exactly (x * c) mod 2**32, whatever the overflow."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def noise_key(seed: torch.Tensor, frame: torch.Tensor, stream: int | torch.Tensor) -> torch.Tensor:
    """The noise key of (seed [B], frame [B], stream): [B] for an int stream, [B, S] for streams [S].
    A caller sampling several streams of one frame computes their keys once (`sample_tokens(key=)`)."""
    seed = seed.long()
    key = _mix32(seed & _MASK32)
    key = _mix32(key ^ ((seed >> 32) & _MASK32))
    key = _mix32(key ^ (frame.long() & _MASK32))
    if isinstance(stream, torch.Tensor):
        key, stream = key[:, None], stream.long()[None, :]
    return _mix32(key ^ (stream & _MASK32))


def _log_uniform(key: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """log U (<= 0) of key [B] at vocabulary indices [V] or [B, K]; U in (0, 1], 24 hashed bits."""
    h = _mix32(_mix32(key[:, None] ^ index))
    return (((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))).log()


def exponential_noise(seed: torch.Tensor, frame: torch.Tensor, stream: int, vocab: int | torch.Tensor,
                      *, key: torch.Tensor | None = None) -> torch.Tensor:
    """Exp(1) noise, a pure function of (seed [B], frame [B], stream, vocabulary index): [B, vocab]
    for an int `vocab`, or [B, K] at the indices of an int64 tensor `vocab` [B, K]."""
    key = noise_key(seed, frame, stream) if key is None else key
    index = torch.arange(vocab, device=key.device) if isinstance(vocab, int) else vocab.long()
    return -_log_uniform(key, index)


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


_EXACT_IN_FLOAT32 = (torch.float32, torch.bfloat16, torch.float16)


def _ranked(scores: torch.Tensor, candidates: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Values and vocabulary indices [B, W] in rank order (value descending, index ascending):
    all V entries, or the K_CAP best when `candidates` (W = min(K_CAP, V))."""
    if not candidates or K_CAP >= scores.shape[-1]:
        return scores.sort(dim=-1, descending=True, stable=True)
    values, index = scores.topk(K_CAP, dim=-1, sorted=False)
    index, order = index.sort(dim=-1)
    values, order = values.gather(-1, order).sort(dim=-1, descending=True, stable=True)
    return values, index.gather(-1, order)


def _race(values: torch.Tensor, index: torch.Tensor, rows: RowSampling, key: torch.Tensor,
          vocab: int) -> torch.Tensor:
    """Temperature, top-k, top-p and the exponential race on ranked entries -> tokens [B].
    Scans and transcendental ops run on the first K_CAP columns alone, so a full ranking and a
    K_CAP ranking do the same arithmetic wherever the row's kept set lies within K_CAP."""
    s = values.float() / rows.temperature.clamp_min(1e-6)[:, None]
    width = s.shape[-1]
    k = rows.top_k
    # k <= 0 or k >= V keeps everything: the threshold is then the last ranked value
    kth = s.gather(-1, torch.where(k > 0, k, vocab).clamp(max=width)[:, None] - 1)  # [B, 1]
    top = s[:, :1]
    sizes = [K_CAP, width - K_CAP] if width > K_CAP else [width]
    mass, log_u = [], []
    for part, ids in zip(s.split(sizes, dim=-1), index.split(sizes, dim=-1)):
        part = part.contiguous()
        mass.append(torch.where(part >= kth, (part - top).exp(), 0.0))  # unnormalised top-k softmax
        log_u.append(_log_uniform(key, ids.contiguous()))
    cum = mass[0].cumsum(-1)
    if len(sizes) > 1:
        cum = torch.cat([cum, cum[:, -1:] + mass[1].cumsum(-1)], dim=-1)
        mass, log_u = torch.cat(mass, dim=-1), torch.cat(log_u, dim=-1)
    else:
        mass, log_u = mass[0], log_u[0]
    p = rows.top_p
    # p >= 1 keeps everything as it is (before <= total <= p * total); p <= 0 is off: no limit
    limit = torch.where(p > 0, p, float("inf"))[:, None] * cum[:, -1:]
    before = F.pad(cum[:, :-1], (1, 0))  # mass ranked strictly before each entry
    keep = (before <= limit) & (mass > 0)
    race = torch.where(keep, mass / log_u, float("inf"))  # -(mass / E): the draw is its argmin
    return index.gather(-1, race.argmin(-1, keepdim=True))[:, 0]


def sample_tokens(
    logits: torch.Tensor,  # [B, V]
    rows: RowSampling,
    frame: torch.Tensor,  # [B] int64: the request's frame index (noise counter)
    stream: int,  # which head of the frame (codebook index, or n_vq for the stop head)
    seen: torch.Tensor | None = None,  # [B, V] bool: this request's earlier tokens of this stream
    *,
    candidates: bool = False,  # every row has 1 <= top_k <= K_CAP (or V <= K_CAP): see the module doc
    key: torch.Tensor | None = None,  # [B] noise_key(rows.seed, frame, stream), when precomputed
) -> torch.Tensor:  # [B] int64
    if seen is not None:
        scores = apply_repetition_penalty(logits.float(), seen, rows.repetition_penalty)
    else:  # ranking before the (exact) float32 cast skips a cast of the whole vocabulary
        scores = logits if logits.dtype in _EXACT_IN_FLOAT32 else logits.float()
    values, index = _ranked(scores, candidates)
    key = noise_key(rows.seed, frame, stream) if key is None else key
    sampled = _race(values, index, rows, key, scores.shape[-1])
    greedy = rows.greedy | (rows.temperature <= 0)  # T <= 0 means greedy, as in HF generate
    return torch.where(greedy, index[:, 0], sampled)  # rank 0: the first argmax


class SamplingSlots:
    """Sampling settings of every request slot, kept on the device and gathered per step. New
    requests' settings are staged on the host (`write`) and applied together before a step
    (`flush`): a burst of admissions costs a dozen kernels, not a dozen each."""

    def __init__(self, num_slots: int, device: torch.device | str) -> None:
        def f32():
            return torch.ones(num_slots, dtype=torch.float32, device=device)

        def i64():
            return torch.zeros(num_slots, dtype=torch.int64, device=device)

        self.audio = {"temperature": f32(), "top_k": i64(), "top_p": f32(), "repetition_penalty": f32()}
        self.text = {"temperature": f32(), "top_k": i64(), "top_p": f32(), "repetition_penalty": f32()}
        self.greedy = torch.zeros(num_slots, dtype=torch.bool, device=device)
        self.seed = i64()
        self._staged: dict[int, SamplingParams] = {}  # slot -> settings written since the last flush

    def write(self, slot: int, p: SamplingParams) -> None:
        """Slot `slot` takes `p`'s settings at the next `flush` (a later write of the slot wins)."""
        self._staged[slot] = p

    def flush(self) -> torch.Tensor | None:
        """Apply the staged writes, before the step that reads them: their values go to the device
        in one copy from pinned memory (asynchronous: it waits for no kernel already queued, as a
        Python value assigned through indexing would, with `overlap_steps` for the step in
        flight) and are scattered by one kernel a setting, however many requests came. Returns
        the written slots on the device (`[n]` int64, for the runner's own per-slot resets), None
        when nothing was staged."""
        if not self._staged:
            return None
        staged, self._staged = self._staged, {}
        floats = torch.tensor([(p.temperature, p.top_p, p.repetition_penalty, p.text_temperature, p.text_top_p)
                               for p in staged.values()], dtype=torch.float32)  # [n, 5]
        ints = torch.tensor([(slot, p.top_k, p.text_top_k, p.greedy, p.seed) for slot, p in staged.items()],
                            dtype=torch.int64)  # [n, 5]
        if self.greedy.device.type == "cuda":
            floats, ints = floats.pin_memory(), ints.pin_memory()
        floats = floats.to(self.greedy.device, non_blocking=True)
        ints = ints.to(self.greedy.device, non_blocking=True)
        slots = ints[:, 0]
        a, t = self.audio, self.text
        for table, column in ((a["temperature"], floats[:, 0]), (a["top_p"], floats[:, 1]),
                              (a["repetition_penalty"], floats[:, 2]), (t["temperature"], floats[:, 3]),
                              (t["top_p"], floats[:, 4]), (a["top_k"], ints[:, 1]), (t["top_k"], ints[:, 2]),
                              (self.greedy, ints[:, 3].bool()), (self.seed, ints[:, 4])):
            table.index_copy_(0, slots, column)
        t["repetition_penalty"].index_fill_(0, slots, 1.0)
        return slots

    def rows(self, slots: torch.Tensor, *, text: bool = False) -> RowSampling:
        """The settings of `slots [B]` for the audio heads (or the stop/text head)."""
        if self._staged:  # a step would sample new requests with their slots' old settings
            raise RuntimeError(f"sampling settings of slots {sorted(self._staged)} written but not flushed")
        table = self.text if text else self.audio
        return RowSampling(**{k: v[slots] for k, v in table.items()}, greedy=self.greedy[slots], seed=self.seed[slots])
