"""MOSS-Audio-Tokenizer v1/v2: encoder stack, RLFQ quantizer, decoder stack (docs/model_facts.md, "Codec").

Module names follow the checkpoint: `encoder.{i}` / `decoder.{i}` index ModuleLists that include
the weightless patch stages, `quantizer.*` is the `ResidualLFQ`.

Waveforms are `[B, channels, samples]`; v2 interleaves stereo L,R,L,R into one stream of
`samples * channels` before the encoder and de-interleaves the decoder output. Inside the stacks
activations are channel-last `[B, T, D]`; the encoder hidden states and the quantizer use
upstream's conv layout `[B, D, T]`. Transformers run in the model's dtype; the quantizer in fp32.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from stages.models.codec.config import CodecConfig, PatchStage, Stage, TransformerStage
from stages.models.codec.quantizer import ResidualLFQ
from stages.models.codec.transformer import (LayerCache, ProjectedTransformer, layer_inputs, layer_outputs,
                                             patch_down, patch_up)


class Patch(nn.Module):
    """Weightless `PatchedPretransform`: folds `patch_size` time steps into channels (or back)."""

    def __init__(self, patch_size: int, down: bool):
        super().__init__()
        self.patch_size = patch_size
        self.down = down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return patch_down(x, self.patch_size) if self.down else patch_up(x, self.patch_size)


@dataclass
class EncodeResult:
    """codes [nq, B, T] int64 (all computed frames), lengths [B] valid frames (floor rule),
    hidden [B, D, T] encoder output before quantization."""

    codes: torch.Tensor
    lengths: torch.Tensor
    hidden: torch.Tensor


@dataclass
class StreamChunk:
    """Where a streaming chunk decodes: slots [B], their decoded frame counts start [B], and per
    decoder transformer (in decoder order) one `LayerCache` per layer."""

    slots: torch.Tensor
    start: torch.Tensor
    caches: list[list[LayerCache]]


def _stage_module(stage: Stage, down: bool) -> nn.Module:
    if isinstance(stage, PatchStage):
        return Patch(stage.patch_size, down)
    return ProjectedTransformer(stage)


class CodecModel(nn.Module):
    """The audio tokenizer; see the module docstring for layouts."""

    def __init__(self, cfg: CodecConfig):
        super().__init__()
        self.cfg = cfg
        self.encoder = nn.ModuleList(_stage_module(s, down=True) for s in cfg.encoder)
        self.quantizer = ResidualLFQ(cfg.quantizer)
        self.decoder = nn.ModuleList(_stage_module(s, down=False) for s in cfg.decoder)
        self.ring_attention_frames = 0  # chunks up to this many frames attend in place (`use_ring_attention`)
        self.fused_ring_writes = False  # ... and rotate and write their rings in one kernel a layer
        self.fused_norms = False  # ... and add each residual and normalise it in one kernel
        self.fused_attention = False  # ... and attend in the kernel that writes the rings
        self.fused_encoder = False  # reference encodes through the streaming kernels (`use_fused_encoder`)

    @property
    def compute_dtype(self) -> torch.dtype:
        return next(t.dtype for t in self.decoder.parameters())

    def compile_layers(self, backend: str = "inductor", encoder: bool = True, decoder: bool = True) -> None:
        """Run every transformer layer's halves around attention through `torch.compile` (norms,
        projections, RoPE, residual gains and the FFN fused; one compilation per half and head
        shape, dynamic in batch and length), in the `encoder` stack, the `decoder` stack or both;
        ring writes and attention stay eager, so streaming state and graphs work unchanged."""
        parts = tuple(torch.compile(f, dynamic=True, fullgraph=True, backend=backend)
                      for f in (layer_inputs, layer_outputs))
        for module in (*(self.encoder if encoder else ()), *(self.decoder if decoder else ())):
            if isinstance(module, ProjectedTransformer):
                module.transformer.parts = parts

    def use_ring_attention(self, max_frames: int | None = None, fused_writes: bool = False,
                           fused_norms: bool = False, fused_attention: bool = False) -> None:
        """Streaming decode of chunks of at most `max_frames` frames (None: every length; 0: none)
        attends over the slots' rings in place (`ring_attention`, a Triton kernel: CUDA, or
        Triton's CPU interpreter) instead of copying each row's rings out and masking. The choice
        is per chunk length, so a CUDA graph of one length records one of the two. `fused_writes`:
        those chunks rotate q and k and write their rings in one kernel a layer (`ring_write`);
        `fused_norms` (with `fused_writes`): and add each residual and normalise it in one kernel
        (`residual_norm`); `fused_attention` (with `fused_writes`): and attend in the kernel that
        writes the rings (`ring_write_attention`)."""
        if (fused_norms or fused_attention) and not fused_writes:
            raise ValueError("fused_norms and fused_attention need fused_writes (the layers' fused path)")
        self.ring_attention_frames = sys.maxsize if max_frames is None else max_frames
        self.fused_ring_writes = fused_writes
        self.fused_norms = fused_norms
        self.fused_attention = fused_attention

    def use_fused_encoder(self, on: bool = True) -> None:
        """Encode whole references through the streaming kernels (`ProjectedTransformer.forward_fused`:
        the window applied in the attention kernel, RoPE with the key writes, residual adds with
        the norms) instead of masked SDPA over padded key blocks and unfused elementwise ops, and
        each quantizer stage's nearest code in one kernel (`lfq_nearest`). The same arithmetic;
        on CUDA a few times fewer kernels and bytes (Triton's CPU interpreter runs it too, slowly)."""
        self.fused_encoder = on

    def use_gelu_epilogue(self, on: bool = True) -> None:
        """The decoder layers' FFN GELU as the tanh approximation in the first matmul's epilogue
        (`feed_forward`; on CUDA one kernel fewer a layer) instead of the checkpoint's erf GELU:
        a fidelity change (the two differ by at most ~5e-4, under bf16's step for |x| > 0.06).
        The encoder keeps the erf GELU."""
        for module in self.decoder:
            if isinstance(module, ProjectedTransformer):
                for layer in module.transformer.layers:
                    layer.gelu_epilogue = (torch.zeros(layer.linear1.out_features, dtype=layer.linear1.weight.dtype,
                                                       device=layer.linear1.weight.device) if on else None)

    def decoder_stages(self) -> list[TransformerStage]:
        return [m.stage for m in self.decoder if isinstance(m, ProjectedTransformer)]

    @torch.no_grad()
    def encode(self, wav: torch.Tensor, lengths: torch.Tensor | None = None,
               num_quantizers: int | None = None) -> EncodeResult:
        """wav [B, channels, N] at `sampling_rate`, lengths [B] valid samples (default N)."""
        B, C, N = wav.shape
        if C != self.cfg.channels:
            raise ValueError(f"expected {self.cfg.channels} channel(s), got {C}")
        if lengths is None:
            lengths = torch.full((B,), N, dtype=torch.long, device=wav.device)
        pad = (-N) % self.cfg.downsample_rate
        wav = F.pad(wav, (0, pad))
        x = wav.transpose(1, 2).reshape(B, -1, 1).to(self.compute_dtype)  # [B, (N+pad)*C, 1], L,R,L,R
        lengths = lengths * self.cfg.interleave_factor
        for module in self.encoder:
            if isinstance(module, Patch):
                x, lengths = module(x), lengths // module.patch_size
            else:
                x = module.forward_fused(x) if self.fused_encoder else module(x)
        hidden = x.transpose(1, 2).float()  # [B, D, T]
        codes = self.quantizer.encode(hidden, lengths, num_quantizers, fused=self.fused_encoder)
        return EncodeResult(codes, lengths, hidden)

    @torch.no_grad()
    def decode(self, codes: torch.Tensor, stream: StreamChunk | None = None) -> torch.Tensor:
        """codes [nq, B, T] (nq a prefix of the quantizers) -> audio [B, channels, T * downsample_rate] fp32.

        Without `stream` the whole sequence is decoded from position 0. With `stream` the codes are
        the next chunk of each slot; the caches are updated in place (the caller advances `start`);
        each chunk must fit the caches' headroom.
        """
        nq, B, T = codes.shape
        x = self.quantizer.decode(codes).transpose(1, 2).to(self.compute_dtype)  # [B, T, D]
        stage_index = 0
        for module in self.decoder:
            if isinstance(module, Patch):
                x = module(x)
            elif stream is None:
                x = module(x)
            else:
                start = stream.start * module.stage.tokens_per_frame  # [B] first position of this chunk
                in_place = T <= self.ring_attention_frames
                fused = in_place and self.fused_ring_writes
                x = module.forward_streaming(x, start, stream.caches[stage_index], stream.slots, in_place=in_place,
                                             fused=fused, fused_norms=fused and self.fused_norms,
                                             one_kernel=fused and self.fused_attention)
                stage_index += 1
        # x: [B, T * stream_hop, 1] -> [B, channels, T * downsample_rate]
        return x.reshape(B, -1, self.cfg.channels).transpose(1, 2).float()

    @torch.no_grad()
    def batch_decode(self, codes_list: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes [nq, T_i] each -> (audio [B, channels, max_T * hop], lengths [B] samples per channel).

        Shorter items are padded with code 0 at the end; causality keeps their valid part exact.
        """
        nq = codes_list[0].shape[0]
        T = max(c.shape[-1] for c in codes_list)
        codes = torch.zeros(nq, len(codes_list), T, dtype=torch.long, device=codes_list[0].device)
        for i, c in enumerate(codes_list):
            codes[:, i, : c.shape[-1]] = c
        lengths = torch.tensor([c.shape[-1] * self.cfg.downsample_rate for c in codes_list])
        return self.decode(codes), lengths


def count_parameters(cfg: CodecConfig) -> int:
    """Parameter count of a codec built on the meta device (no memory)."""
    with torch.device("meta"):
        model = CodecModel(cfg)
    return sum(p.numel() for p in model.parameters())
