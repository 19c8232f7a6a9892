"""The codec's causal windowed transformer (docs/model_facts.md, "Codec"), channel-last `[B, T, D]` throughout.

Layer: `x += ls1 * attn(LN1(x))`; `x += ls2 * linear2(gelu_erf(linear1(LN2(x))))`; LayerNorm eps 1e-5
with bias, bias-free linears, fused `in_projs.0` ([3D, D], q|k|v blocks, head-major) and
`out_projs.0`. RoPE is GPT-J interleaved (pairs (2i, 2i+1)), computed in fp32 at absolute positions.
Key j is visible to query i iff `0 <= i - j < context`.

Attention runs in one of two modes:
* whole sequence: positions 0..T-1, no cache;
* streaming: a `LayerCache` holds a per-slot ring of keys/values with capacity
  `context + headroom` (headroom >= the largest chunk in positions), so a chunk's earliest query
  still finds every key of its window and chunked decoding equals the whole decode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from stages.models.codec.config import TransformerStage


@dataclass
class LayerCache:
    """One attention layer's streaming ring for a pool of slots.

    k, v: [S, C, H, Dh], time-major so a position is one contiguous row; slot s holds position p
    at ring index p % C.
    """

    k: torch.Tensor
    v: torch.Tensor

    @property
    def capacity(self) -> int:
        return self.k.shape[1]


def rope_rotor(positions: torch.Tensor, head_dim: int, max_period: float) -> torch.Tensor:
    """positions [B, T] (long) -> (cos, sin) fp32 [B, T, 1, 1, Dh/2, 2], angles in fp32 as upstream.

    Real-valued rather than complex: torch.compile fuses real arithmetic into the layer's other
    elementwise work; it cannot generate code for complex tensors."""
    ds = torch.arange(head_dim // 2, device=positions.device, dtype=torch.float32)
    freqs = torch.exp(ds * (-math.log(max_period) * 2 / head_dim))  # [Dh/2]
    angles = positions.float()[:, :, None, None, None] * freqs  # [B, T, 1, 1, Dh/2]
    return torch.stack((torch.cos(angles), torch.sin(angles)), dim=-1)


def apply_interleaved_rope(x: torch.Tensor, rotor: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (2i, 2i+1) of x [B, T, n, H, Dh] by the angles of rotor [B, T, 1, 1, Dh/2, 2]
    (cos, sin): (a, b) -> (a cos - b sin, a sin + b cos), the product of complex numbers a + ib
    and cos + i sin; fp32 math."""
    pairs = x.float().unflatten(-1, (-1, 2))  # [B, T, n, H, Dh/2, 2]
    a, b = pairs[..., 0], pairs[..., 1]
    cos, sin = rotor[..., 0], rotor[..., 1]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2).to(x.dtype)


@dataclass
class WindowPlan:
    """What every layer of one stage shares for one call: RoPE tables and the visibility mask.

    rotor [B, T, 1, 1, Dh/2, 2] (cos, sin) fp32. mask, an additive bias (0 visible, -inf hidden) in the compute
    dtype, made once per stage rather than converted from bool in every layer: [T, T] (whole
    sequence), [2, blk, blk + context - 1]
    (whole sequence in query blocks of `block`: the first block's mask, then every later one's, over
    keys left-padded by context - 1), or [B, 1, T, C] over ring indices (streaming).
    rows [B * T]: the pool rows (slot * C + ring index) where the chunk's keys go (streaming only).
    With `start` [B] (streaming with `ring_attention`) there is no mask: the kernel applies the
    window from the chunk's positions. With `table` as well, each layer rotates q and k and writes
    the rings in one kernel (`stages.models.codec.ring_write`); with `one_kernel`, the same kernel
    attends too (`stages.models.codec.ring_write_attention`).
    """

    rotor: torch.Tensor
    mask: torch.Tensor | None
    rows: torch.Tensor | None = None
    block: int | None = None
    context: int = 0
    start: torch.Tensor | None = None  # [B] first query position (streaming over the rings in place)
    table: torch.Tensor | None = None  # [B * T, Dh/2, 2] fp32 (cos, sin): RoPE fused with the ring writes
    one_kernel: bool = False  # with `table`: the ring writes and the attention in one kernel too

    @classmethod
    def whole(cls, B: int, T: int, stage: TransformerStage, device: torch.device, dtype: torch.dtype,
              block: int | None = None) -> WindowPlan:
        """Positions 0..T-1. block: queries per attention block; None picks max(context, 256) when
        T exceeds two blocks (memory linear in T), 0 never blocks."""
        rotor = rope_rotor(torch.arange(T, device=device).expand(B, T), stage.head_dim, stage.max_period)
        context = stage.context
        if block is None:
            block = max(context, 256) if T > 2 * max(context, 256) else 0
        if block:
            if block < context - 1:
                raise ValueError(f"attention block {block} shorter than the context - 1 ({context - 1})")
            r = torch.arange(block, device=device)[:, None]  # query within the block
            c = torch.arange(block + context - 1, device=device)[None, :]  # padded key within the block
            later = (c >= r) & (c <= r + context - 1)  # [blk, blk + P]
            first = later & (c >= context - 1)  # the first block's padding holds no keys
            return cls(rotor, _bias(torch.stack([first, later]), dtype), block=block, context=context)
        pos = torch.arange(T, device=device)
        delta = pos[:, None] - pos[None, :]  # [T, T] query - key
        return cls(rotor, _bias((delta >= 0) & (delta < context), dtype), context=context)

    @classmethod
    def chunk(cls, slots: torch.Tensor, start: torch.Tensor, T: int, stage: TransformerStage, capacity: int,
              dtype: torch.dtype, in_place: bool = False, fused: bool = False, one_kernel: bool = False) -> WindowPlan:
        """A chunk of T positions for each of slots [B], the first at start [B], over rings of
        `capacity`; `in_place`: attention reads the rings where they are (no mask is built);
        `fused` (with `in_place`): RoPE and the ring writes in one kernel per layer; `one_kernel`
        (with `fused`): and the attention in that kernel."""
        if T > capacity - stage.context + 1:
            raise ValueError(f"chunk of {T} positions exceeds the ring headroom ({capacity} - {stage.context} + 1)")
        pos_q = start[:, None] + torch.arange(T, device=start.device)  # [B, T]
        if in_place:
            rotor = rope_rotor(pos_q, stage.head_dim, stage.max_period)
            rows = (slots[:, None] * capacity + pos_q % capacity).reshape(-1)  # [B * T]
            if fused:
                from stages.models.codec.ring_write import rope_table

                return cls(rotor, None, rows, context=stage.context, start=start, table=rope_table(rotor),
                           one_kernel=one_kernel)
            return cls(rotor, None, rows, context=stage.context, start=start)
        last = pos_q[:, -1:]  # [B, 1] newest position written
        ring = torch.arange(capacity, device=start.device)
        pos_k = last - (last - ring) % capacity  # [B, C] absolute position held at each ring index
        delta = pos_q[:, :, None] - pos_k[:, None, :]  # [B, T, C]
        mask = (pos_k[:, None, :] >= 0) & (delta >= 0) & (delta < stage.context)
        rotor = rope_rotor(pos_q, stage.head_dim, stage.max_period)
        rows = (slots[:, None] * capacity + pos_q % capacity).reshape(-1)  # [B * T]
        return cls(rotor, _bias(mask[:, None], dtype), rows, context=stage.context)


def _bias(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool visibility -> additive attention bias: 0 where visible, -inf elsewhere."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


class CausalWindowAttention(nn.Module):
    """Multi-head self-attention, causal within the stage's context, interleaved RoPE on q and k."""

    def __init__(self, d_model: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.in_projs = nn.ModuleList([nn.Linear(d_model, 3 * d_model, bias=False)])
        self.out_projs = nn.ModuleList([nn.Linear(d_model, d_model, bias=False)])

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: WindowPlan,
               cache: LayerCache | None = None, slots: torch.Tensor | None = None) -> torch.Tensor:
        """q, k, v [B, T, H, Dh] (RoPE applied) -> [B, H, T, Dh]. With a cache, the rows are the next
        chunk of slots [B]: its keys and values are written into their rings first, then the
        queries attend over the rings."""
        B, T = q.shape[:2]
        if cache is not None:
            S, C = cache.k.shape[:2]
            cache.k.view(S * C, -1).index_copy_(0, plan.rows, k.reshape(B * T, -1))  # row copies, no reshuffle
            cache.v.view(S * C, -1).index_copy_(0, plan.rows, v.reshape(B * T, -1))
            if plan.start is not None:  # the rings read in place (`ring_attention`)
                from stages.models.codec.ring_attention import ring_attention

                return ring_attention(q, cache.k, cache.v, slots, plan.start, plan.context).transpose(1, 2)
            k, v = cache.k.index_select(0, slots), cache.v.index_select(0, slots)  # [B, C, H, Dh]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, *, Dh] views
        if plan.block:
            return _blocked_window_attention(q, k, v, plan)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=plan.mask)  # [B, H, T, Dh]


def _blocked_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: WindowPlan) -> torch.Tensor:
    """Whole-sequence windowed attention, `plan.block` queries at a time over their window only:
    q, k, v [B, H, T, Dh] -> [B, H, T, Dh], memory O(T * (block + context))."""
    T, blk, pad = q.shape[2], plan.block, plan.context - 1
    k = F.pad(k, (0, 0, pad, 0))  # [B, H, pad + T, Dh]
    v = F.pad(v, (0, 0, pad, 0))
    outs = []
    for b0 in range(0, T, blk):
        n = min(blk, T - b0)
        mask = plan.mask[0 if b0 == 0 else 1, :n, : n + pad]
        outs.append(F.scaled_dot_product_attention(
            q[:, :, b0: b0 + n], k[:, :, b0: b0 + n + pad], v[:, :, b0: b0 + n + pad], attn_mask=mask))
    return torch.cat(outs, dim=2)


class LayerScale(nn.Module):
    """Per-channel residual gain (`scale`, [D])."""

    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), 0.01))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class TransformerLayer(nn.Module):
    """Pre-LN block: windowed attention then erf-GELU FFN, each behind a LayerScale."""

    def __init__(self, d_model: int, num_heads: int, dim_feedforward: int):
        super().__init__()
        self.self_attn = CausalWindowAttention(d_model, num_heads)
        self.norm1 = nn.LayerNorm(d_model, eps=1e-5)
        self.norm2 = nn.LayerNorm(d_model, eps=1e-5)
        self.linear1 = nn.Linear(d_model, dim_feedforward, bias=False)
        self.linear2 = nn.Linear(dim_feedforward, d_model, bias=False)
        self.layer_scale_1 = LayerScale(d_model)
        self.layer_scale_2 = LayerScale(d_model)
        # [F] zeros when the FFN's GELU rides in linear1's epilogue (`CodecModel.use_gelu_epilogue`)
        self.register_buffer("gelu_epilogue", None, persistent=False)

    def forward(self, x: torch.Tensor, plan: WindowPlan, cache: LayerCache | None = None,
                slots: torch.Tensor | None = None, parts=None) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D]; `parts`: the halves around attention (compiled ones when the
        codec is compiled, `CodecModel.compile_layers`), default `layer_inputs`, `layer_outputs`."""
        before, after = parts or (layer_inputs, layer_outputs)
        if plan.table is not None and cache is not None:  # RoPE and the ring writes in one kernel
            return after(self, x, fused_ring_attention(layer_qkv(self, x), plan, cache, slots).transpose(1, 2))
        q, k, v = before(self, x, plan.rotor)
        return after(self, x, self.self_attn.attend(q, k, v, plan, cache, slots))


def fused_ring_attention(qkv: torch.Tensor, plan: WindowPlan, cache: LayerCache, slots: torch.Tensor) -> torch.Tensor:
    """A streaming layer's attention with RoPE and the ring writes in one kernel (`plan.table`),
    the attention in it too with `plan.one_kernel`: qkv [B, T, 3, H, Dh] (the input projection)
    -> [B, T, H, Dh], the rings written."""
    from stages.models.codec.ring_attention import ring_attention
    from stages.models.codec.ring_write import rope_ring_write

    if plan.one_kernel:
        from stages.models.codec.ring_write_attention import rope_write_attend

        return rope_write_attend(qkv, plan.table, cache.k, cache.v, slots, plan.start, plan.context)

    q = rope_ring_write(qkv, plan.table, cache.k, cache.v, plan.rows)  # [B, T, H, Dh]
    return ring_attention(q, cache.k, cache.v, slots, plan.start, plan.context)


def layer_qkv(layer: TransformerLayer, x: torch.Tensor) -> torch.Tensor:
    """A layer's packed input projection: x [B, T, D] -> qkv [B, T, 3, H, Dh] (before RoPE)."""
    attn = layer.self_attn
    B, T, _ = x.shape
    return attn.in_projs[0](layer.norm1(x)).view(B, T, 3, attn.num_heads, attn.head_dim)


def layer_inputs(layer: TransformerLayer, x: torch.Tensor, rotor: torch.Tensor):
    """A layer up to attention: x [B, T, D] -> q, k, v [B, T, H, Dh] (RoPE on q and k)."""
    qkv = layer_qkv(layer, x)
    qk = apply_interleaved_rope(qkv[:, :, :2], rotor)  # [B, T, 2, H, Dh]
    return qk[:, :, 0], qk[:, :, 1], qkv[:, :, 2]


def layer_outputs(layer: TransformerLayer, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """A layer after attention: residual x [B, T, D], attention output o [B, H, T, Dh] -> [B, T, D]."""
    B, T, D = x.shape
    x = torch.addcmul(x, layer.layer_scale_1.scale, layer.self_attn.out_projs[0](o.transpose(1, 2).reshape(B, T, D)))
    return torch.addcmul(x, layer.layer_scale_2.scale, feed_forward(layer, layer.norm2(x)))


def feed_forward(layer: TransformerLayer, x: torch.Tensor) -> torch.Tensor:
    """A layer's FFN: x [B, T, D] -> linear2(GELU(linear1(x))) [B, T, D]. The checkpoint's erf
    GELU; with `layer.gelu_epilogue` (a zero bias [F]) the tanh approximation, on CUDA inside the
    first matmul (cuBLASLt's GELU epilogue: one kernel fewer), elsewhere as its own op."""
    bias = layer.gelu_epilogue
    if bias is None:
        return layer.linear2(F.gelu(layer.linear1(x)))
    if x.is_cuda:
        hidden = torch._addmm_activation(bias, x.reshape(-1, x.shape[-1]), layer.linear1.weight.t(), use_gelu=True)
        hidden = hidden.view(*x.shape[:-1], -1)  # [B, T, F]
    else:
        hidden = F.gelu(layer.linear1(x), approximate="tanh")
    return layer.linear2(hidden)


class Transformer(nn.Module):
    """A stack of `TransformerLayer`s (checkpoint names `layers.{i}.*`)."""

    def __init__(self, stage: TransformerStage):
        super().__init__()
        self.layers = nn.ModuleList(
            TransformerLayer(stage.d_model, stage.num_heads, stage.dim_feedforward) for _ in range(stage.num_layers)
        )
        self.parts = (layer_inputs, layer_outputs)  # the layer halves (compiled: CodecModel.compile_layers)


class ProjectedTransformer(nn.Module):
    """input_proj -> Transformer -> output_proj, on channel-last x [B, T, in] -> [B, T, out].

    A projection is Identity when its dims are equal, unless `stage.project_always` (v2).
    """

    def __init__(self, stage: TransformerStage):
        super().__init__()
        self.stage = stage
        keep_in = stage.project_always or stage.input_dim != stage.d_model
        keep_out = stage.project_always or stage.output_dim != stage.d_model
        self.input_proj = nn.Linear(stage.input_dim, stage.d_model, bias=False) if keep_in else nn.Identity()
        self.transformer = Transformer(stage)
        self.output_proj = nn.Linear(stage.d_model, stage.output_dim, bias=False) if keep_out else nn.Identity()

    @property
    def transformer_dtype(self) -> torch.dtype:
        return self.transformer.layers[0].norm1.weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The whole sequence from position 0."""
        plan = WindowPlan.whole(x.shape[0], x.shape[1], self.stage, x.device, self.transformer_dtype)
        x = self.input_proj(x)
        for layer in self.transformer.layers:
            x = layer(x, plan, parts=self.transformer.parts)
        return self.output_proj(x)

    def forward_fused(self, x: torch.Tensor) -> torch.Tensor:
        """The whole sequence from position 0, as `forward` computes it, through the streaming
        kernels: x [B, T, in] is one chunk starting at position 0 of each row, its keys written
        into one scratch ring per row that every layer reuses (a layer's keys are read only by
        that layer), long enough that nothing wraps; the window is applied in the attention kernel
        (no mask, no padded key blocks), RoPE and the ring writes in one kernel, each residual add
        and the LayerNorm after it in one. CUDA, or Triton's CPU interpreter."""
        B, T, _ = x.shape
        st = self.stage
        capacity = T + st.context - 1  # a chunk of T positions fits beside a full window: no wrap
        k = torch.empty(B, capacity, st.num_heads, st.head_dim, dtype=self.transformer_dtype, device=x.device)
        ring = LayerCache(k, torch.empty_like(k))  # [B, C, H, Dh] each
        slots = torch.arange(B, device=x.device)
        start = torch.zeros(B, dtype=torch.long, device=x.device)
        return self.forward_streaming(x, start, [ring] * len(self.transformer.layers), slots,
                                      in_place=True, fused=True, fused_norms=True)

    def forward_streaming(self, x: torch.Tensor, start: torch.Tensor, caches: list[LayerCache],
                          slots: torch.Tensor, *, in_place: bool = False, fused: bool = False,
                          fused_norms: bool = False, one_kernel: bool = False) -> torch.Tensor:
        """The next chunk of slots [B], whose first positions are start [B]; caches: one per layer.
        `in_place`: attend over the rings in place (`ring_attention`) rather than copy and mask;
        `fused` (with it): RoPE and the ring writes in one kernel per layer (`ring_write`);
        `fused_norms` (with both): each residual add and the LayerNorm after it in one kernel
        (`residual_norm`); `one_kernel` (with `fused`): the attention in the ring writes' kernel."""
        plan = WindowPlan.chunk(slots, start, x.shape[1], self.stage, caches[0].capacity, self.transformer_dtype,
                                in_place=in_place, fused=fused, one_kernel=one_kernel)
        x = self.input_proj(x)
        if fused_norms and plan.table is not None:
            return self.output_proj(fused_norm_layers(self.transformer.layers, x, plan, caches, slots))
        for layer, cache in zip(self.transformer.layers, caches, strict=True):
            x = layer(x, plan, cache, slots, self.transformer.parts)
        return self.output_proj(x)


def fused_norm_layers(layers: nn.ModuleList, x: torch.Tensor, plan: WindowPlan, caches: list[LayerCache],
                      slots: torch.Tensor) -> torch.Tensor:
    """A streaming chunk through `layers` with RoPE and the ring writes fused (`plan.table`) and
    every residual add fused with the LayerNorm that reads it (`residual_norm`): the attention
    half's add with the layer's second LayerNorm, the FFN half's with the next layer's first.
    x [B, T, D] -> [B, T, D]; the same layers as `TransformerLayer.forward`, nine kernels a layer
    rather than eleven."""
    from stages.models.codec.residual_norm import residual_norm

    B, T, D = x.shape
    normed = layers[0].norm1(x)
    for i, (layer, cache) in enumerate(zip(layers, caches, strict=True)):
        attn = layer.self_attn
        qkv = attn.in_projs[0](normed).view(B, T, 3, attn.num_heads, attn.head_dim)
        o = fused_ring_attention(qkv, plan, cache, slots)  # [B, T, H, Dh]
        x, normed = residual_norm(x, attn.out_projs[0](o.reshape(B, T, D)), layer.layer_scale_1.scale, layer.norm2)
        ffn = feed_forward(layer, normed)
        if i + 1 < len(layers):
            x, normed = residual_norm(x, ffn, layer.layer_scale_2.scale, layers[i + 1].norm1)
        else:
            x = torch.addcmul(x, layer.layer_scale_2.scale, ffn)
    return x


def patch_down(x: torch.Tensor, patch: int) -> torch.Tensor:
    """[B, L*p, D] -> [B, L, D*p], channel d*p + j <- time l*p + j (upstream's conv-layout order)."""
    B, T, D = x.shape
    return x.view(B, T // patch, patch, D).transpose(2, 3).reshape(B, T // patch, D * patch)


def patch_up(x: torch.Tensor, patch: int) -> torch.Tensor:
    """[B, L, D*p] -> [B, L*p, D], the exact inverse of `patch_down`."""
    B, L, DP = x.shape
    return x.view(B, L, DP // patch, patch).transpose(2, 3).reshape(B, L * patch, DP // patch)
