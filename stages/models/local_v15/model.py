"""MOSS-TTS-Local-Transformer-v1.5 talker: Qwen3 backbone + GPT-2-style local block (docs/model_facts.md, "Local-v1.5").

Per 80 ms frame: the backbone turns the previous row into a hidden state `h`; the local block
runs 12 positions that restart every frame: position 0 is `h` itself, position k (1..11) the
embedding of codebook k-1 just sampled (`audio_embeddings[k-1]`). Position 0 feeds the binary
continue/stop head (`local_text_lm_head`, column 0 = continue = the gen-slot id, column 1 =
stop = audio_end) and codebook 0's head; position k feeds codebook k's head. Audio heads are tied
to the audio embeddings (`audio_lm_heads.k = audio_embeddings.k`), so they are computed from the
embedding weights and are not parameters of their own. The next backbone row is
`[gen_slot | codes]`.

Module names equal the checkpoint's (`transformer.*`, `local_transformer.h.{i}.*`,
`local_transformer.ln_f.*`, `audio_embeddings.{k}`, `local_text_lm_head`), so loading is a strict
name match.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from stages.models.local_v15.config import LocalBlockConfig, LocalV15Config
from stages.models.qwen3 import BACKBONE_LINEARS, Qwen3Model
from stages.runtime.fp8_linear import quantize_linears

# checkpoint tensors that are tied copies of others; save_pretrained drops them, the model ignores them
TIED_CHECKPOINT_NAMES = (r"text_lm_head\.weight", r"audio_lm_heads\.\d+\.weight")
LOCAL_LINEARS = ("c_attn", "c_proj", "fc_in", "fc_out")  # the local block's matmuls


def rope_interleaved_tables(
    positions: torch.Tensor, head_dim: int, base: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-J RoPE tables for `positions [P]`: cos, sin [P, D], each frequency repeated for its pair."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.to(torch.float32)[:, None] * inv_freq  # [P, D/2]
    return freqs.cos().repeat_interleave(2, -1).to(dtype), freqs.sin().repeat_interleave(2, -1).to(dtype)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (2i, 2i+1) of x [..., heads, D]; cos/sin [..., D] broadcast over heads."""
    rotated = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).reshape_as(x)
    return x * cos.unsqueeze(-2) + rotated * sin.unsqueeze(-2)


class LocalAttention(nn.Module):
    def __init__(self, cfg: LocalBlockConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.c_attn = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)  # q | k | v
        self.c_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.plain_step = False  # `step` attends by products and sums, not SDPA (`LocalTransformer.attend_plainly`)
        self.kernel_step = False  # `step` attends in one Triton kernel (`LocalTransformer.attend_by_kernel`)
        self.rope_base = cfg.rope_base  # the kernel computes its angles

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        q, k, v = self.c_attn(x).split(x.shape[-1], dim=-1)
        shape = (*x.shape[:-1], self.num_heads, self.head_dim)
        q, k, v = q.view(shape), k.view(shape), v.view(shape)
        return apply_rope_interleaved(q, cos, sin), apply_rope_interleaved(k, cos, sin), v

    def step(self, x: torch.Tensor, pos: int, rope: tuple[torch.Tensor, torch.Tensor],
             keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
        """x [B, H] at local position `pos`; rope tables [P, D]; keys/values: the frame's earlier
        positions' rotated keys and values, each [B, heads, D], to which this position's are
        appended. A list, not a preallocated [B, P, heads, D] buffer written in place: compiled,
        each write into a buffer becomes a functional scatter that copies the whole buffer.
        With `kernel_step` the list holds each position's unrotated projection [B, 3H] instead
        (`local_attend` rotates them as it reads), `values` stays empty."""
        if self.kernel_step:
            from stages.models.local_v15.local_attend import local_attend

            if pos != len(keys):
                raise ValueError(f"local position {pos} after {len(keys)} positions: they go in order")
            keys.append(self.c_attn(x))  # [B, 3H]
            return self.c_proj(local_attend(keys, self.num_heads, self.rope_base))
        q, k, v = self._qkv(x, rope[0][pos], rope[1][pos])  # [B, heads, D]
        keys.append(k)
        values.append(v)
        if self.plain_step:  # one query over at most n_vq keys, in float32, key by key
            qf, scale = q.float(), self.head_dim**-0.5
            scores = torch.stack([(qf * key.float()).sum(-1) for key in keys], dim=1) * scale  # [B, P, heads]
            weights = scores.softmax(dim=1)
            o = weights[:, 0, :, None] * values[0].float()  # [B, heads, D]
            for j in range(1, len(values)):
                o = o + weights[:, j, :, None] * values[j].float()
            o = o.to(x.dtype)
        else:
            o = F.scaled_dot_product_attention(
                q.unsqueeze(2), torch.stack(keys, dim=2), torch.stack(values, dim=2)
            )  # [B, heads, 1, D]
        return self.c_proj(o.reshape(x.shape))

    def forward_dense(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [B, S, H] at positions 0..S-1, causal; rope tables [>= S, D]."""
        S = x.shape[1]
        q, k, v = self._qkv(x, rope[0][:S], rope[1][:S])  # [B, S, heads, D]
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.c_proj(o.transpose(1, 2).reshape(x.shape))


class LocalMLP(nn.Module):
    def __init__(self, cfg: LocalBlockConfig) -> None:
        super().__init__()
        self.fc_in = nn.Linear(cfg.hidden_size, cfg.inner_size)
        self.fc_out = nn.Linear(cfg.inner_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.silu(self.fc_in(x)))


class LocalBlock(nn.Module):
    def __init__(self, cfg: LocalBlockConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.attn = LocalAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = LocalMLP(cfg)


class LocalTransformer(nn.Module):
    """Pre-LN GPT-2 blocks (`h.{i}`) and `ln_f`; no token or position embeddings (RoPE only)."""

    def __init__(self, cfg: LocalBlockConfig) -> None:
        super().__init__()
        self.config = cfg
        self.h = nn.ModuleList(LocalBlock(cfg) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def new_cache(self) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
        """A frame's KV, empty: per block, its positions' keys and values (`LocalAttention.step`)."""
        return [([], []) for _ in self.h]

    def attend_plainly(self, on: bool = True) -> None:
        """A frame's local steps attend by elementwise products and sums (float32) instead of
        `F.scaled_dot_product_attention`: under torch.compile they fuse into a few small kernels,
        where SDPA runs a flash kernel sized for long sequences once a position (one query, at most
        n_vq keys). Not batch-invariant (`talker.batch_invariant` routes SDPA to its own kernel)."""
        for block in self.h:
            block.attn.plain_step = on

    def attend_by_kernel(self, on: bool = True) -> None:
        """A frame's local steps attend in one Triton kernel a position (`local_attend`: the
        rotations, scores, softmax and weighted values from the input projection's outputs),
        where the plain attention leaves several small kernels a position. CUDA, or Triton's CPU
        interpreter; not batch-invariant."""
        for block in self.h:
            block.attn.kernel_step = on

    def rope_tables(self, length: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [length, D] for positions 0..length-1 (computed on the device, no host copy)."""
        positions = torch.arange(length, device=like.device)
        return rope_interleaved_tables(positions, self.config.head_dim, self.config.rope_base, like.dtype)

    def step(self, x: torch.Tensor, pos: int, rope: tuple[torch.Tensor, torch.Tensor],
             cache: list[tuple[list[torch.Tensor], list[torch.Tensor]]]) -> torch.Tensor:
        """One local position for a batch: x [B, H] -> ln_f output [B, H]; `cache` from
        `new_cache`, positions taken in order."""
        for block, (keys, values) in zip(self.h, cache):
            x = x + block.attn.step(block.ln_1(x), pos, rope, keys, values)
            x = x + block.mlp(block.ln_2(x))
        return self.ln_f(x)

    def forward_dense(self, x: torch.Tensor) -> torch.Tensor:
        """Whole local sequences x [B, S, H] -> [B, S, H] (teacher forcing)."""
        rope = self.rope_tables(x.shape[1], x)
        for block in self.h:
            x = x + block.attn.forward_dense(block.ln_1(x), rope)
            x = x + block.mlp(block.ln_2(x))
        return self.ln_f(x)


class FrameSampler(Protocol):
    """Chooses the stop decision and the codes of a frame from logits, for a batch of requests."""

    def stop(self, logits: torch.Tensor) -> torch.Tensor:  # [B, 2] -> [B] bool (True: stop)
        ...

    def code(self, codebook: int, logits: torch.Tensor) -> torch.Tensor:  # [B, V] -> [B] int64
        ...


class GreedyFrameSampler:
    """argmax everywhere (upstream `do_sample=False`)."""

    def stop(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(-1) == 1

    def code(self, codebook: int, logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(-1)


class LocalV15Talker(nn.Module):
    """The whole talker: `embed_rows` -> `transformer` (Qwen3, paged or dense) -> `decode_frame`
    (local loop with a `FrameSampler`); `teacher_forced_logits` for parity checks."""

    def __init__(self, cfg: LocalV15Config) -> None:
        super().__init__()
        self.config = cfg
        self.transformer = Qwen3Model(cfg.backbone)
        self.local_transformer = LocalTransformer(cfg.local)
        self.audio_embeddings = nn.ModuleList(nn.Embedding(cfg.codebook_size, cfg.hidden_size) for _ in range(cfg.n_vq))
        self.local_text_lm_head = nn.Linear(cfg.hidden_size, 2, bias=False)

    def compile_hot_paths(self, backend: str = "inductor", mode: str | None = None) -> None:
        """Serve through `torch.compile`: the backbone's layer halves (`Qwen3Model.compile_layers`),
        `embed_rows` and `decode_frame` (local loop + sampling, fused into few kernels), each
        dynamic in the batch. Compilation happens on the first call of each (warm-up / graph
        capture's warm-up run); results equal the eager ones up to floating-point reassociation.
        `mode`: torch.compile's for the layer halves and the local loop (None: its default)."""
        self.transformer.compile_layers(backend, mode)
        self.embed_rows = torch.compile(self.embed_rows, dynamic=True, backend=backend)
        self.decode_frame = torch.compile(self.decode_frame, dynamic=True, backend=backend, mode=mode)

    def use_fp8_weights(self, which: str, scheme: str = "w8a16") -> int:
        """Serve `which` matmuls from float8 weights (`stages.runtime.fp8_linear`, its `scheme`):
        "none", "backbone" (every Qwen3 layer's projections, fused or not) or "all" (the local
        block's too). Embeddings, heads and norms stay as loaded. Returns how many linears were
        swapped."""
        if which not in ("none", "backbone", "all"):
            raise ValueError(f"fp8 weights for {which!r}: expected none, backbone or all")
        swapped = 0
        if which in ("backbone", "all"):
            swapped += quantize_linears(self.transformer, BACKBONE_LINEARS, scheme)
        if which == "all":
            swapped += quantize_linears(self.local_transformer, LOCAL_LINEARS, scheme)
        return swapped

    def embed_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [..., 1 + n_vq] (text id, codes) -> [..., H]: text embedding plus the embedding of
        every non-pad code (pad codes contribute zero)."""
        x = self.transformer.embed_tokens(rows[..., 0])
        for k, table in enumerate(self.audio_embeddings):
            codes = rows[..., k + 1]
            valid = codes != self.config.audio_pad_code
            x = x + table(codes.masked_fill(~valid, 0)) * valid.unsqueeze(-1).to(x.dtype)
        return x

    def audio_logits(self, codebook: int, y: torch.Tensor) -> torch.Tensor:
        """Tied head of `codebook`: y [B, H] -> [B, codebook_size]."""
        return F.linear(y, self.audio_embeddings[codebook].weight)

    def decode_frame(self, h: torch.Tensor, sampler: FrameSampler) -> tuple[torch.Tensor, torch.Tensor]:
        """The local loop of one frame for a batch. h [B, H] backbone hidden states ->
        (stop [B] bool, codes [B, n_vq] int64). Codes are computed for every row; rows that stop
        carry codes that the caller drops."""
        n_vq = self.config.n_vq
        local = self.local_transformer
        cache = local.new_cache()
        rope = local.rope_tables(n_vq, h)
        y = local.step(h, 0, rope, cache)  # [B, H]
        stop = sampler.stop(self.local_text_lm_head(y))
        codes = []
        for k in range(n_vq):
            code = sampler.code(k, self.audio_logits(k, y))  # [B]
            codes.append(code)
            if k + 1 < n_vq:
                y = local.step(self.audio_embeddings[k](code), k + 1, rope, cache)
        return stop, torch.stack(codes, dim=-1)

    def teacher_forced_logits(
        self, global_hidden: torch.Tensor, target_codes: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Local block over known codes. global_hidden [T, H]; target_codes [T, n_vq] (the codes
        that follow each position; anything outside [0, codebook) feeds a zero vector).
        Returns stop/continue logits [T, 2] and audio logits [T, n_vq, codebook_size]."""
        n_vq = self.config.n_vq
        valid = (target_codes >= 0) & (target_codes < self.config.codebook_size)  # [T, n_vq]
        safe = target_codes.clamp(0, self.config.codebook_size - 1)
        inputs = [global_hidden]
        for k in range(n_vq - 1):
            inputs.append(self.audio_embeddings[k](safe[:, k]) * valid[:, k, None].to(global_hidden.dtype))
        y = self.local_transformer.forward_dense(torch.stack(inputs, dim=1))  # [T, n_vq, H]
        audio = torch.stack([self.audio_logits(k, y[:, k]) for k in range(n_vq)], dim=1)
        return self.local_text_lm_head(y[:, 0]), audio
