"""CUDA graphs of reference encoding, keyed by (batch bucket B, length bucket S samples).

`CodecModel.encode(wav [B, channels, S], lengths [B], n_vq)` has fixed shapes for a given (B, S)
and reads nothing from the host, so a recorded call replays it. A batch of n waveforms whose
longest has at most S samples (S = the smallest of `lengths_s` seconds that fits) is padded
with silence to S and with rows of silence to B; each row's `lengths` entry is its own length,
so the quantizer leaves the padding frames out, and the encoder is causal (patch folding and
windowed attention over earlier positions only), so the frames of the real samples are the
frames an unpadded encode gives (the encoder's blocked attention for long inputs may round
differently; the codes are argmax picks, so a near tie could in principle flip).

With `max_samples` (`codec.encode_batch_seconds`) only the buckets whose B x S fit the bound are
recorded; a batch whose bucket does not encodes eagerly.

Eager mode (`capture=False`) runs the same padded static inputs without recording (CPU tests).
Reference encoding happens only on reference-cache misses, between decode dispatches, outside
any decode capture; these graphs share no memory pool with the decode graphs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stages.models.codec.model import CodecModel
from stages.runtime.graph_capture import CaptureProgress, StaticCall, bucket, make_missing

DEFAULT_LENGTHS_S = (4.0, 8.0, 12.0, 16.0, 24.0, 32.0)  # reference clips are 3-10 s as a rule


@dataclass
class _Entry:
    wav: torch.Tensor  # [B, channels, S] fp32 static input
    lengths: torch.Tensor  # [B] int64 static input (samples per channel)
    codes: torch.Tensor  # [n_vq, B, T] int64 static output
    frames: torch.Tensor  # [B] int64 static output (valid frames)
    call: StaticCall | None = None  # encode(wav, lengths) -> (codes, frames), set once made


class EncodeGraphs:
    """Bucketed, padded replays of `CodecModel.encode` (see the module docstring)."""

    def __init__(self, model: CodecModel, *, n_vq: int, max_batch: int, lengths_s=DEFAULT_LENGTHS_S,
                 capture: bool = True, max_samples: int | None = None) -> None:
        """`max_samples`: buckets (B, S) with B x S at most this many samples a channel only (the
        batches `codec.encode_batch_seconds` allows; a batch whose bucket is larger encodes
        eagerly); None: every batch bucket at every length."""
        self.model, self.n_vq, self.max_batch, self.capture = model, n_vq, max_batch, capture
        self.max_samples = max_samples
        cfg = model.cfg
        self.channels, self.hop = cfg.channels, cfg.downsample_rate
        # bucket lengths in samples, whole frames
        self.lengths = sorted({max(1, round(s * cfg.sampling_rate / self.hop)) * self.hop for s in lengths_s})
        self.device = next(model.parameters()).device
        if capture and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the codec is on {self.device}")
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self._entries: dict[tuple[int, int], _Entry] = {}

    @property
    def keys(self) -> list[tuple[int, int]]:
        """(B, S) of the entries made so far."""
        return list(self._entries)

    def fits(self, n: int, longest: int) -> bool:
        """Whether n waveforms, the longest of `longest` samples, encode here (else eagerly)."""
        if not (1 <= n <= self.max_batch and 0 < longest <= self.lengths[-1]):
            return False
        return self._within((bucket(n, self.max_batch), self.length_bucket(longest)))

    def _within(self, key: tuple[int, int]) -> bool:
        return self.max_samples is None or key[0] * key[1] <= self.max_samples

    def length_bucket(self, longest: int) -> int:
        return next(s for s in self.lengths if s >= longest)

    @torch.no_grad()
    def encode(self, wavs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Host waveforms fp32 [channels, samples_i] -> (codes [n_vq, n, T] int64, frames [n] int64),
        views of the static outputs on the device, valid until the next call."""
        n, longest = len(wavs), max(w.shape[1] for w in wavs)
        if not self.fits(n, longest):
            raise ValueError(f"{n} waveforms of up to {longest} samples do not fit the encode graphs")
        key = (bucket(n, self.max_batch), self.length_bucket(longest))
        batch = torch.zeros(key[0], self.channels, key[1], dtype=torch.float32)  # [B, C, S] host
        lengths = torch.full((key[0],), self.hop, dtype=torch.long)  # padding rows: one frame of silence
        for i, w in enumerate(wavs):
            batch[i, :, : w.shape[1]] = w
            lengths[i] = w.shape[1]
        entry = self._entries.get(key) or self._make(key)
        entry.wav.copy_(batch, non_blocking=True)
        entry.lengths.copy_(lengths, non_blocking=True)
        entry.call()
        return entry.codes[:, :n], entry.frames[:n]

    def capture_ahead(self, batches, budget_s: float | None = None, progress: CaptureProgress | None = None) -> int:
        """Make the entries of every (bucket(b), S) not made yet, largest first, within `budget_s`;
        returns how many were made (each counted in `progress`)."""
        keys = {(bucket(min(b, self.max_batch), self.max_batch), s) for b in batches for s in self.lengths}
        keys = {key for key in keys if self._within(key)}
        return make_missing(keys, self._entries, self._make, budget_s, progress)

    def _make(self, key: tuple[int, int]) -> _Entry:
        """The bucket's static tensors (silence, full lengths) and its first call (recorded with capture)."""
        B, S = key
        dev = self.device
        entry = _Entry(torch.zeros(B, self.channels, S, dtype=torch.float32, device=dev),
                       torch.full((B,), S, dtype=torch.long, device=dev),
                       torch.zeros(self.n_vq, B, S // self.hop, dtype=torch.long, device=dev),
                       torch.zeros(B, dtype=torch.long, device=dev))

        def body():
            result = self.model.encode(entry.wav, entry.lengths, self.n_vq)
            return result.codes, result.lengths

        entry.call = StaticCall.first(body, (entry.codes, entry.frames), capture=self.capture, pool=self.pool,
                                      device=dev)
        self._entries[key] = entry
        return entry
