"""Residual LFQ quantizer (docs/model_facts.md, "Codec"), always fp32, conv layout `[B, D, T]` as upstream.

Encode: `res = input_proj(z)`; per stage `z_e = in_proj(res)`, L2-normalise z_e and the codebook,
take the nearest code, `z_q = out_proj(codebook[idx])` (the *un-normalised* row), `res -= z_q`;
frames at or beyond a row's length are quantized from a zeroed residual and leave it unchanged.
Decode: `output_proj(sum_q out_proj_q(codebook_q[code_q]))` over the first nq stages.

Projections are 1x1 weight-normed convs in the checkpoint; `stages.runtime.checkpoint` folds them into a
plain `weight` [out, in, 1] + `bias`, which is what `PointwiseConv` holds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stages.models.codec.config import QuantizerConfig


class PointwiseConv(nn.Module):
    """A kernel-1 Conv1d with bias: weight [out, in, 1], applied to x [B, in, T]."""

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_dim, in_dim, 1))
        self.bias = nn.Parameter(torch.zeros(out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv1d(x, self.weight, self.bias)


def _proj(in_dim: int, out_dim: int) -> nn.Module:
    return PointwiseConv(in_dim, out_dim) if in_dim != out_dim else nn.Identity()


class LFQStage(nn.Module):
    """One residual stage: in_proj (rvq -> codebook_dim), codebook [K, codebook_dim], out_proj back."""

    def __init__(self, rvq_dim: int, codebook_size: int, codebook_dim: int):
        super().__init__()
        self.in_proj = _proj(rvq_dim, codebook_dim)
        self.out_proj = _proj(codebook_dim, rvq_dim)
        self.codebook = nn.Embedding(codebook_size, codebook_dim)
        self._book: tuple[tuple, torch.Tensor, torch.Tensor] | None = None  # (weights' identity, 2 * book, |book|^2)

    def normalized_book(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(2 x the L2-normalised codebook [K, cd], its rows' squared norms [1, K]): functions of
        the weights alone, so made once (and again only when the weights change), not in every
        encode: five of a stage's ~25 small launches, 160 of the encoder's ~1400 a batch. Doubling
        is exact, so `enc @ (2 book)^T` is upstream's `(2 enc) @ book^T` to the bit."""
        weight = self.codebook.weight
        version = None if weight.is_inference() else weight._version  # (an inference tensor keeps none)
        key = (weight.data_ptr(), version, weight.device, weight.dtype)
        if self._book is None or self._book[0] != key:
            book = F.normalize(weight.float())  # [K, cd]
            self._book = (key, 2 * book, book.pow(2).sum(1, keepdim=True).t())
        return self._book[1], self._book[2]

    def quantize(self, residual: torch.Tensor, fused: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """residual [B, rvq, T] -> (z_q [B, rvq, T], codes [B, T]); `fused`: the nearest code and
        the straight-through rows in one kernel (`lfq_nearest`) instead of twelve small operations."""
        z_e = self.in_proj(residual)  # [B, cd, T]
        if fused:
            from stages.models.codec.lfq_nearest import lfq_nearest

            book2, book_sq = self.normalized_book()
            z_st, codes = lfq_nearest(z_e.float().contiguous(), book2, book_sq, self.codebook.weight.float())
            return self.out_proj(z_st), codes
        enc = F.normalize(z_e.transpose(1, 2).reshape(-1, z_e.shape[1]))  # [B*T, cd]
        book2, book_sq = self.normalized_book()  # [K, cd], [1, K]
        # upstream's -(|enc|^2 - 2 enc.book + |book|^2) as (2 enc.book - |enc|^2) - |book|^2: the
        # same bits (rounding is symmetric under negation), one launch fewer
        closeness = enc @ book2.t() - enc.pow(2).sum(1, keepdim=True) - book_sq  # [B*T, K]
        codes = closeness.max(1)[1].view(residual.shape[0], -1)  # [B, T]
        chosen = self.codebook(codes).transpose(1, 2).float()  # [B, cd, T]
        # upstream's straight-through form z_e + (z_q - z_e): not bit-equal to z_q, and later stages see it
        return self.out_proj(z_e + (chosen - z_e)), codes

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, T] -> [B, rvq, T]."""
        return self.out_proj(self.codebook(codes).transpose(1, 2).float())


class ResidualLFQ(nn.Module):
    """`quantizer.*` of the checkpoint: input_proj, quantizers.{i}, output_proj."""

    def __init__(self, cfg: QuantizerConfig):
        super().__init__()
        self.cfg = cfg
        self.input_proj = _proj(cfg.input_dim, cfg.rvq_dim)
        self.output_proj = _proj(cfg.rvq_dim, cfg.output_dim)
        self.quantizers = nn.ModuleList(
            LFQStage(cfg.rvq_dim, cfg.codebook_size, cfg.codebook_dim) for _ in range(cfg.num_quantizers)
        )

    @torch.no_grad()
    def encode(self, z: torch.Tensor, lengths: torch.Tensor, num_quantizers: int | None = None,
               fused: bool = False) -> torch.Tensor:
        """z [B, input_dim, T], lengths [B] -> codes [nq, B, T] int64 (`fused`: each stage's
        nearest code in one kernel, `LFQStage.quantize`)."""
        nq = num_quantizers or self.cfg.num_quantizers
        residual = self.input_proj(z.float()).float()  # [B, rvq, T]
        B, _, T = residual.shape
        valid = (torch.arange(T, device=z.device)[None, :] < lengths[:, None])[:, None].float()  # [B, 1, T]
        # upstream masks each stage's input and update; a frame past its length stays zero from
        # the first mask on (minus z_q * 0), so one mask first and `residual - z_q * valid` as one
        # addcmul give the same bits with two launches fewer a stage
        residual = residual * valid
        all_codes = []
        for stage in self.quantizers[:nq]:
            z_q, codes = stage.quantize(residual, fused)
            residual = torch.addcmul(residual, z_q, valid, value=-1)
            all_codes.append(codes)
        return torch.stack(all_codes)

    @torch.no_grad()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [nq, B, T] (a prefix of the stages) -> [B, output_dim, T] fp32."""
        nq, B, T = codes.shape
        if nq > self.cfg.num_quantizers:
            raise ValueError(f"{nq} codebooks given, the quantizer has {self.cfg.num_quantizers}")
        emb = torch.zeros(B, self.cfg.rvq_dim, T, device=codes.device, dtype=torch.float32)
        for i in range(nq):
            emb = emb + self.quantizers[i].decode(codes[i])
        return self.output_proj(emb)
