"""Qwen3 decoder backbone shared by every MOSS-TTS variant (docs/model_facts.md, "Qwen3 backbone").

Pre-norm RMSNorm (computed in fp32), GQA attention with per-head RMSNorm on q and k applied
*before* NeoX (rotate-half) RoPE with θ from the config, SwiGLU MLP, final norm. Parameter names
equal HF `Qwen3Model`: `embed_tokens`, `layers.{i}.self_attn.{q,k,v,o}_proj`,
`layers.{i}.self_attn.{q,k}_norm`, `layers.{i}.mlp.{gate,up,down}_proj`,
`layers.{i}.{input,post_attention}_layernorm`, `norm`.

Two entry points, one set of layers:
* `forward(embeds [N, H], meta, cache)`: the serving path. N packed new tokens of many sequences
  (prefill chunks and decode tokens mixed) attend over the paged KV cache (`stages.runtime.attention.backends`).
* `forward_dense(embeds [B, S, H], attention_mask [B, S])`: a whole batch at once without a cache
  (teacher forcing, tests). Positions are `cumsum(attention_mask) - 1` and hidden states are
  multiplied by the query mask at the input, after every layer and after the final norm, as
  upstream `MossQwen3Model` does.
Nothing variant-specific lives here: inputs are embeddings, outputs final-norm hidden states.

Tensor parallelism: built with `tp=TPGroup`, q/k/v and gate/up are column-parallel and o_proj /
down_proj row-parallel (`stages.runtime.tensor_parallel`): each rank holds `rank_config`'s heads, KV heads
(its KV cache too) and FFN channels, and each layer all-reduces twice. `tp=None` is one device.

Fused projections (`fuse_projections`, after loading): each layer's q, k and v projections become
one matmul (`qkv_proj`, their weights stacked along the outputs) and the MLP's gate and up another
(`gate_up_proj`): three kernels fewer a layer, each wider. The same products, summed in the
order the wider matmul's kernel picks; the checkpoint's names stay those above. KV stores in the
layers (`Qwen3Model.store_kv_in_layers`): the serving path stores each layer's new keys and values
inside its first half (`attention_inputs_stored`), which a compiled model fuses into the kernels
that compute them. Or (`Qwen3Model.store_kv_by_kernel`) the compiled half stops at the
projections and one Triton kernel a layer applies the q/k norms and RoPE and stores the keys
and values (`stages.runtime.qk_rope_store`).

Float8 layers (`stages.runtime.fp8_linear`, w8a8) on that path can leave work to the kernels
around their matmuls: the MLP's SiLU product quantized in one kernel (`Qwen3MLP.use_fp8_swiglu`),
each product's scales applied where it is read next (`Qwen3Model.use_fp8_scales_later`), and
each residual sum, norm and row quantization in one kernel (`Qwen3Model.use_fp8_norms`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from stages.runtime.attention.backends import ReferenceAttention
from stages.runtime.attention.metadata import AttentionBackend, AttentionMetadata
from stages.runtime.batch_invariant import rms_norm, triton_runs_on
from stages.runtime.kv_cache import KVCacheSpec, PagedKVCache, scatter_kv
from stages.runtime.tensor_parallel import TPGroup, column_linear, row_linear

# the names of a layer's matmuls, plain and fused (`fuse_projections`)
BACKBONE_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                    "qkv_proj", "gate_up_proj")


@dataclass(frozen=True)
class Qwen3Config:
    """Backbone shape. `from_hf` reads an HF `Qwen3Config` dict (`language_config`/`qwen3_config`)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0

    @classmethod
    def from_hf(cls, cfg: dict) -> "Qwen3Config":
        theta = cfg.get("rope_theta")
        for key in ("rope_parameters", "rope_scaling"):
            if theta is None and isinstance(cfg.get(key), dict):
                theta = cfg[key].get("rope_theta")
        heads = int(cfg["num_attention_heads"])
        return cls(
            hidden_size=int(cfg["hidden_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads", heads)),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta if theta is not None else 1_000_000.0),
        )

    def kv_cache_spec(self, num_blocks: int, block_size: int = 16) -> KVCacheSpec:
        return KVCacheSpec(self.num_layers, self.num_kv_heads, self.head_dim, num_blocks, block_size)

    def per_rank(self, tp_size: int) -> "Qwen3Config":
        """The shapes one of `tp_size` tensor-parallel ranks holds: heads, KV heads, FFN split."""
        split = {"num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads,
                 "intermediate_size": self.intermediate_size}
        bad = [f"{k}={v}" for k, v in split.items() if v % tp_size]
        if bad:
            raise ValueError(f"tensor parallel size {tp_size} does not divide {', '.join(bad)}")
        return replace(self, **{k: v // tp_size for k, v in split.items()})


class RMSNorm(nn.Module):
    """y = weight * (x / rms(x)); the normalisation runs in fp32, the result in the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)  # a per-row kernel in the batch-invariant mode


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX RoPE tables for `positions [...]`: cos, sin `[..., head_dim]` (halves repeated)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.to(torch.float32)[..., None] * inv_freq  # [..., D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [..., D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[..., heads, D]`, cos/sin `[..., D]` (broadcast over heads)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(-2) + rotated * sin.unsqueeze(-2)


# attend(q [..., Hq, D], k [..., Hkv, D], v [..., Hkv, D]) -> [..., Hq, D] for one layer
AttendFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Qwen3Attention(nn.Module):
    def __init__(self, cfg: Qwen3Config, tp: TPGroup | None = None) -> None:
        super().__init__()
        local = cfg.per_rank(tp.size) if tp else cfg
        self.num_heads, self.num_kv_heads, self.head_dim = local.num_heads, local.num_kv_heads, cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.q_proj = column_linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, tp)
        self.k_proj = column_linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, tp)
        self.v_proj = column_linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, tp)
        self.o_proj = row_linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, tp)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qkv_proj: nn.Linear | None = None  # q | k | v in one matmul (`fuse_projections`)
        self.qkv_sizes = (self.num_heads * self.head_dim,) + (self.num_kv_heads * self.head_dim,) * 2
        self.qkv_scales_later = False  # `use_fp8_scales_later`: `project_unscaled` leaves q|k|v's scales

    def project(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h [..., H] -> q [..., Hq * D], k, v [..., Hkv * D] (this rank's heads)."""
        if self.qkv_proj is not None:
            return self.qkv_proj(h).split(self.qkv_sizes, dim=-1)
        return self.q_proj(h), self.k_proj(h), self.v_proj(h)

    def project_unscaled(self, h: torch.Tensor):
        """`project` for the q/k norm, RoPE and store kernel: h [N, H] -> (q, k, v, row_scale).
        With `qkv_scales_later`, q|k|v's float8 product before its scales (bf16 views) and the
        rows' scales [N, 1] fp32, the channels' being `qkv_proj.weight_scale`; else the
        projections and None."""
        if self.qkv_scales_later:
            raw, row_scale = self.qkv_proj.product(h)  # [N, (Hq + 2 Hkv) D], [N, 1]
            return (*raw.split(self.qkv_sizes, dim=-1), row_scale)
        return (*self.project(h), None)

    def fuse_projections(self) -> None:
        """q, k and v in one matmul from now on (`qkv_proj`; the three weights stacked, then freed)."""
        if self.qkv_proj is None:
            self.qkv_proj = stacked_linear(self.q_proj, self.k_proj, self.v_proj)
            del self.q_proj, self.k_proj, self.v_proj


class Qwen3MLP(nn.Module):
    def __init__(self, cfg: Qwen3Config, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.gate_proj = column_linear(cfg.hidden_size, cfg.intermediate_size, tp)
        self.up_proj = column_linear(cfg.hidden_size, cfg.intermediate_size, tp)
        self.down_proj = row_linear(cfg.intermediate_size, cfg.hidden_size, tp)
        self.gate_up_proj: nn.Linear | None = None  # gate | up in one matmul (`fuse_projections`)
        self.fp8_swiglu = None  # `use_fp8_swiglu`: the module stages.runtime.fp8_swiglu
        self.fp8_swiglu_by_kernel = False  # its SiLU product quantized by the Triton kernel
        self.down_scales_later = False  # `use_fp8_scales_later`: `product` leaves down's scales

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8_swiglu is not None:
            return self.fp8_swiglu.swiglu_fp8(self.gate_up_proj, self.down_proj, x, self.fp8_swiglu_by_kernel)
        return self.down_proj(self._silu_product(x))

    def _silu_product(self, x: torch.Tensor) -> torch.Tensor:
        """SiLU(gate(x)) * up(x) [..., I], gate and up fused or not."""
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return F.silu(gate) * up

    def product(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """With `down_scales_later` (down a w8a8 float8 layer without bias): x [N, H] -> (raw
        [N, H], row_scale [N, 1] fp32), down's product before its scales:
        `(raw * (row_scale * down_proj.weight_scale)).to(x.dtype)` is `forward(x)`."""
        if self.fp8_swiglu is not None:
            h, h_scale = self.fp8_swiglu.quantized_swiglu(self.gate_up_proj, x, self.fp8_swiglu_by_kernel)
            return self.down_proj.raw_product(h), h_scale
        return self.down_proj.product(self._silu_product(x))

    def fuse_projections(self) -> None:
        """gate and up in one matmul from now on (`gate_up_proj`; both weights stacked, then freed)."""
        if self.gate_up_proj is None:
            self.gate_up_proj = stacked_linear(self.gate_proj, self.up_proj)
            del self.gate_proj, self.up_proj

    def use_fp8_swiglu(self, on: bool = True) -> bool:
        """With gate|up and down float8 layers of the w8a8 scheme without biases: the SiLU product
        and its quantization for down in one Triton kernel after gate|up's product
        (`stages.runtime.fp8_swiglu`; the torch ops where Triton cannot run). Returns whether the
        MLP now takes that path (off whenever its layers are not such)."""
        from stages.runtime.fp8_linear import Fp8Linear

        layers = (self.gate_up_proj, getattr(self, "down_proj", None))
        if not on or not all(isinstance(m, Fp8Linear) and m.scheme == "w8a8" and m.bias is None for m in layers):
            self.fp8_swiglu = None
            return False
        from stages.runtime import fp8_swiglu  # imports Triton: only when asked

        self.fp8_swiglu = fp8_swiglu
        self.fp8_swiglu_by_kernel = triton_runs_on(self.gate_up_proj.weight_fp8.device)
        return True


def stacked_linear(*parts: nn.Module) -> nn.Linear:
    """One bias-free linear computing every part's outputs, in order, from their `[out, in]`
    weights (plain or column-parallel: a rank's slices stack as they are)."""
    weight = torch.cat([p.weight.detach() for p in parts], dim=0)  # [sum of outs, in]
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    return fused


def fuse_projections(module: nn.Module) -> int:
    """Fuse the projections of every Qwen3 attention and MLP inside `module` (module docstring);
    returns how many layers' parts were fused. Serving only: after it the module's state dict no
    longer has the checkpoint's q/k/v and gate/up names."""
    parts = [m for m in module.modules() if isinstance(m, (Qwen3Attention, Qwen3MLP))]
    for m in parts:
        m.fuse_projections()
    return len(parts)


def attention_inputs(layer: Qwen3DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """The layer up to attention: x [..., H] -> q [..., Hq, D], k, v [..., Hkv, D] (RoPE applied)."""
    attn = layer.self_attn
    return normed_rotated_heads(attn, *attn.project(layer.input_layernorm(x)), cos, sin)


def normed_rotated_heads(attn: Qwen3Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         cos: torch.Tensor, sin: torch.Tensor):
    """Projections q [..., Hq * D], k, v [..., Hkv * D] -> q, k [..., H*, D] normed and rotated,
    v [..., Hkv, D]."""
    lead = q.shape[:-1]  # [N] or [B, S]
    q = attn.q_norm(q.reshape(*lead, attn.num_heads, attn.head_dim))
    k = attn.k_norm(k.reshape(*lead, attn.num_kv_heads, attn.head_dim))
    v = v.reshape(*lead, attn.num_kv_heads, attn.head_dim)
    return apply_rope_neox(q, cos, sin), apply_rope_neox(k, cos, sin), v


def attention_inputs_stored(layer: Qwen3DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                            keys: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """`attention_inputs`, storing k and v at flat `slot_mapping [N]` of the layer's paged cache
    `keys`, `values` `[blocks, block_size, Hkv, D]` (compiled: by the kernels that compute them,
    no copies after): x [N, H] -> q [N, Hq, D]."""
    q, k, v = attention_inputs(layer, x, cos, sin)
    scatter_kv(keys, values, slot_mapping, k, v)
    return q


def attention_projections(layer: Qwen3DecoderLayer, x: torch.Tensor):
    """The layer up to its q/k/v projection: x [N, H] -> q [N, Hq * D], k, v [N, Hkv * D] (no
    norms, no RoPE: `qk_rope_store.qk_norm_rope_store` takes them from here) and the rows'
    scales [N, 1] of a float8 product whose scales are left to that kernel (else None:
    `Qwen3Attention.project_unscaled`)."""
    return layer.self_attn.project_unscaled(layer.input_layernorm(x))


def attention_projections_normed(layer: Qwen3DecoderLayer, x: torch.Tensor, raw: torch.Tensor,
                                 row_scale: torch.Tensor, col_scale: torch.Tensor):
    """With the float8 norms (`Qwen3Model.use_fp8_norms`): the layer up to its q|k|v product after
    the layer before's MLP output (down's float8 product raw [N, H] before its rows' [N, 1] and
    channels' [1, H] scales) is added to x [N, H], the sum normed and quantized by one kernel
    (`stages.runtime.fp8_norm`) -> (that sum, q, k, v before their scales, the rows' scales [N, 1])."""
    norm, attn = layer.input_layernorm, layer.self_attn
    x, h, h_scale = layer.fp8_norm(x, raw, row_scale, col_scale, norm.weight, norm.eps, layer.fp8_norm_by_kernel)
    return (x, *attn.qkv_proj.raw_product(h).split(attn.qkv_sizes, dim=-1), h_scale)


def attention_outputs_normed(layer: Qwen3DecoderLayer, x: torch.Tensor, o: torch.Tensor):
    """With the float8 norms: the layer after attention, o_proj's float8 product added to x
    [N, H], normed and quantized by one kernel, and the MLP from those float8 rows: attention
    output o [N, Hq, D] -> (x + o_proj(o) [N, H], down's float8 product before its scales
    [N, H], its rows' [N, 1] and channels' [1, H] scales), which the next layer's first half (or
    the final norm) adds up."""
    attn, mlp, norm = layer.self_attn, layer.mlp, layer.post_attention_layernorm
    o_raw, o_scale = attn.o_proj.product(o.reshape(*x.shape[:-1], -1))
    x, h, h_scale = layer.fp8_norm(x, o_raw, o_scale, attn.o_proj.weight_scale, norm.weight, norm.eps,
                                   layer.fp8_norm_by_kernel)
    h, h_scale = mlp.fp8_swiglu.quantized_swiglu_from(mlp.gate_up_proj, h, h_scale, x.dtype,
                                                      mlp.fp8_swiglu_by_kernel)
    return x, mlp.down_proj.raw_product(h), h_scale, mlp.down_proj.weight_scale


def final_norm_normed(norm: RMSNorm, x: torch.Tensor, raw: torch.Tensor, row_scale: torch.Tensor,
                      col_scale: torch.Tensor) -> torch.Tensor:
    """The final norm after the last layer's outputs with the float8 norms (`attention_outputs_normed`)."""
    return norm(x + scaled_product(raw, row_scale, col_scale).to(x.dtype))


def scaled_product(raw: torch.Tensor, *scales: torch.Tensor) -> torch.Tensor:
    """A product [N, C] as it is, or a float8 product before its scales (`Fp8Linear.product`)
    times its rows' [N, 1] and channels' [1, C] scales, in the product's dtype (compiled: inside
    the kernel that reads it)."""
    return raw if not scales else (raw * (scales[0] * scales[1])).to(raw.dtype)


def attention_projections_after(layer: Qwen3DecoderLayer, x: torch.Tensor, o: torch.Tensor, mlp: torch.Tensor,
                                *scales: torch.Tensor):
    """`attention_projections` after the residual sums the layer before deferred
    (`attention_outputs_deferred`): x [N, H] + its attention's o [N, H] + its MLP's output
    [N, H] (`scaled_product`) -> (that sum, q, k, v, row scales or None)."""
    x = x + o + scaled_product(mlp, *scales).to(x.dtype)
    return (x, *attention_projections(layer, x))


def attention_outputs_deferred(layer: Qwen3DecoderLayer, x: torch.Tensor, o: torch.Tensor):
    """The layer after attention without its residual sums: residual x [N, H], attention output
    o [N, Hq, D] -> (o_proj's output [N, H], the MLP's output [N, H]), which the next layer's
    first half (or the final norm) adds to x. Compiled for CUDA, `x + o_proj(o)` kept for later
    is a matmul whose sum goes into the norm's kernel; as `attention_outputs` has it, inductor
    makes both sums an `addmm` that first copies x into its output (two device copies a layer).
    With `Qwen3MLP.down_scales_later` the MLP's output is down's float8 product before its
    scales, followed by its rows' [N, 1] and channels' [1, H] scales (`scaled_product`)."""
    o = layer.self_attn.o_proj(o.reshape(*x.shape[:-1], -1))
    h = layer.post_attention_layernorm(x + o)
    if layer.mlp.down_scales_later:
        return (o, *layer.mlp.product(h), layer.mlp.down_proj.weight_scale)
    return o, layer.mlp(h)


def final_norm_after(norm: RMSNorm, x: torch.Tensor, o: torch.Tensor, mlp: torch.Tensor,
                     *scales: torch.Tensor) -> torch.Tensor:
    """The final norm of x [N, H] after the last layer's deferred residual sums (one kernel compiled)."""
    return norm(x + o + scaled_product(mlp, *scales).to(x.dtype))


def attention_outputs(layer: Qwen3DecoderLayer, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """The layer after attention: residual x [..., H], attention output o [..., Hq, D] -> [..., H]."""
    x = x + layer.self_attn.o_proj(o.reshape(*x.shape[:-1], -1))
    return x + layer.mlp(layer.post_attention_layernorm(x))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3Config, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(cfg, tp)
        self.mlp = Qwen3MLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fp8_norm: Callable | None = None  # `Qwen3Model.use_fp8_norms`: fp8_norm.add_rms_norm_quant
        self.fp8_norm_by_kernel = False  # its sums, norms and quantization by the Triton kernel

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: AttendFn) -> torch.Tensor:
        """The layer around `attend` (whole sequences, depth loops; the paged serving path runs the
        halves itself, `Qwen3Model.forward`)."""
        return attention_outputs(self, x, attend(*attention_inputs(self, x, cos, sin)))


class ServingParts(NamedTuple):
    """The serving path's layer halves, compiled together (`Qwen3Model.compile_layers`)."""

    inputs: Callable  # before attention, q/k normed and rotated (`attention_inputs`)
    inputs_stored: Callable  # the same, the KV stores inside (`attention_inputs_stored`)
    projections: Callable  # up to the projections (`attention_projections`)
    projections_after: Callable  # the same after the deferred sums (`attention_projections_after`)
    outputs: Callable  # after attention (`attention_outputs`)
    outputs_deferred: Callable  # the same, the residual sums left (`attention_outputs_deferred`)
    final_norm_after: Callable  # the final norm after the last deferred sums (`final_norm_after`)
    projections_normed: Callable  # with the float8 norms (`attention_projections_normed`)
    outputs_normed: Callable  # the same after attention (`attention_outputs_normed`)
    final_norm_normed: Callable  # the final norm after them (`final_norm_normed`)


SERVING_PARTS = ServingParts(attention_inputs, attention_inputs_stored, attention_projections,
                             attention_projections_after, attention_outputs, attention_outputs_deferred,
                             final_norm_after, attention_projections_normed, attention_outputs_normed,
                             final_norm_normed)


class Qwen3Model(nn.Module):
    """Embedding table, decoder layers and final norm (no LM head: variants own their heads)."""

    def __init__(self, cfg: Qwen3Config, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.rank_config = cfg.per_rank(tp.size) if tp else cfg  # what this rank holds (KV cache shape)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(cfg, tp) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self._parts = SERVING_PARTS
        self.kv_stores_in_layers = False  # `store_kv_in_layers`
        self.kv_stores_by_kernel = False  # `store_kv_by_kernel`
        self.residuals_deferred = False  # `defer_residuals`
        self.fp8_norms = False  # `use_fp8_norms`

    def compile_layers(self, backend: str = "inductor", mode: str | None = None) -> None:
        """Serve through `torch.compile`d layer halves (one compilation shared by every layer,
        dynamic in the token count); attention stays outside, so any `AttentionBackend` works.
        `forward_dense` is unchanged. `mode`: torch.compile's (None: its default; e.g.
        "max-autotune-no-cudagraphs" times matmul templates against cuBLAS at compile time)."""
        self._parts = ServingParts(*(torch.compile(f, dynamic=True, backend=backend, mode=mode) for f in SERVING_PARTS))

    def store_kv_in_layers(self, on: bool = True) -> None:
        """Store each layer's new keys and values in the paged cache inside the layer's first half
        (`attention_inputs_stored`: compiled, the kernels computing k and v write them) instead of
        two copies after it. The same values in the same slots either way."""
        self.kv_stores_in_layers = on

    def store_kv_by_kernel(self, on: bool = True) -> None:
        """Each layer's q/k norms, RoPE and KV stores in one Triton kernel after its compiled
        projections (`stages.runtime.qk_rope_store`; the torch ops where Triton cannot run, as
        `attention_inputs` and the cache's copies):
        the same values up to the rounding of the rotation's products. Takes precedence over
        `store_kv_in_layers`."""
        self.kv_stores_by_kernel = on

    def use_fp8_swiglu(self, on: bool = True) -> int:
        """Every MLP's SiLU product quantized by one kernel where its matmuls are float8 by w8a8
        (`Qwen3MLP.use_fp8_swiglu`); returns how many MLPs take that path."""
        return sum(layer.mlp.use_fp8_swiglu(on) for layer in self.layers)

    def use_fp8_scales_later(self, on: bool = True) -> int:
        """With `store_kv_by_kernel` and `defer_residuals`, where a layer's q|k|v and down are
        w8a8 float8 layers without biases: q|k|v's row and channel scales applied by the q/k
        norm, RoPE and store kernel as it loads the product, and down's inside the next layer's
        input norm (or the final norm), each instead of a kernel of its own after the matmul.
        The same products and scales, the scaled q|k|v no longer rounded to the model's dtype.
        Returns how many of the layers' q|k|v and down layers now leave their scales."""
        from stages.runtime.fp8_linear import Fp8Linear

        def unbiased_w8a8(m) -> bool:
            return isinstance(m, Fp8Linear) and m.scheme == "w8a8" and m.bias is None

        n = 0
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv_scales_later = on and unbiased_w8a8(attn.qkv_proj)
            mlp.down_scales_later = on and unbiased_w8a8(getattr(mlp, "down_proj", None))
            n += attn.qkv_scales_later + mlp.down_scales_later
        return n

    def use_fp8_norms(self, on: bool = True) -> int:
        """With `store_kv_by_kernel`, `defer_residuals`, every MLP's SwiGLU kernel path
        (`use_fp8_swiglu`) and every layer's scales left to the kernels (`use_fp8_scales_later`,
        o_proj a w8a8 float8 layer without bias too): each residual sum, the norm after it and the
        rows' quantization for the float8 matmul next in one Triton kernel
        (`stages.runtime.fp8_norm`; the torch ops where Triton cannot run), the post-attention
        norm's sum written as the new residual. Returns how many layers take that path (all or
        none)."""
        from stages.runtime.fp8_linear import Fp8Linear

        def ready(layer) -> bool:
            o = layer.self_attn.o_proj
            return (layer.self_attn.qkv_scales_later and layer.mlp.down_scales_later and layer.mlp.fp8_swiglu is not None
                    and isinstance(o, Fp8Linear) and o.scheme == "w8a8" and o.bias is None)

        self.fp8_norms = bool(on and self.kv_stores_by_kernel and self.residuals_deferred
                              and all(ready(layer) for layer in self.layers))
        fn, by_kernel = None, False
        if self.fp8_norms:
            from stages.runtime import fp8_norm  # imports Triton: only when asked

            fn, by_kernel = fp8_norm.add_rms_norm_quant, triton_runs_on(self.norm.weight.device)
        for layer in self.layers:
            layer.fp8_norm, layer.fp8_norm_by_kernel = fn, by_kernel
        return len(self.layers) if self.fp8_norms else 0

    def defer_residuals(self, on: bool = True) -> None:
        """With `store_kv_by_kernel`: each layer leaves its two residual sums to the next layer's
        first half (`attention_outputs_deferred`, `attention_projections_after`), where they go
        into the input norm's kernel, and the last layer's to the final norm: no `addmm` copies.
        The same sums, rounded once instead of twice."""
        self.residuals_deferred = on

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, dtype)

    def forward(
        self,
        embeds: torch.Tensor,  # [N, H] packed new tokens
        meta: AttentionMetadata,
        cache: PagedKVCache,
        backend: AttentionBackend | None = None,
    ) -> torch.Tensor:  # [N, H] final-norm hidden states
        """Serving path: write this step's K/V into the paged cache, attend over each sequence."""
        backend = backend or ReferenceAttention()
        cos, sin = self._rope(meta.positions, embeds.dtype)  # [N, D]
        parts = self._parts
        if self.kv_stores_by_kernel:
            return self._forward_by_kernel(embeds, meta, cache, backend, cos, sin)
        x = embeds
        for i, layer in enumerate(self.layers):
            keys, values = cache.keys[i], cache.values[i]
            if self.kv_stores_in_layers:
                q = parts.inputs_stored(layer, x, cos, sin, keys, values, meta.slot_mapping)
            else:
                q, k, v = parts.inputs(layer, x, cos, sin)
                cache.write(i, meta.slot_mapping, k, v)
            x = parts.outputs(layer, x, backend(q, keys, values, meta, layer.self_attn.scale))
        return self.norm(x)

    def _forward_by_kernel(self, x, meta, cache, backend, cos, sin) -> torch.Tensor:
        """`forward` with the q/k norms, RoPE and KV stores in one kernel a layer
        (`store_kv_by_kernel`), the residual sums deferred or not (`defer_residuals`); with float8
        layers, their products' scales left to the kernels after them (`use_fp8_scales_later`)
        and their sums and norms in one kernel each (`use_fp8_norms`)."""
        parts = self._parts
        by_kernel = triton_runs_on(x.device)  # else the same through the torch ops
        if by_kernel:  # imports Triton: only when asked (tests choose its CPU interpreter first)
            from stages.runtime.qk_rope_store import qk_norm_rope_store
        normed = self.fp8_norms
        pending = None  # deferred: the layer before's attention and MLP outputs, not yet added to x
        for i, layer in enumerate(self.layers):
            if pending is None:
                q, k, v, row_scale = parts.projections(layer, x)
            elif normed:  # pending: the residual after attention, the MLP's product and scales
                x, q, k, v, row_scale = parts.projections_normed(layer, *pending)
            else:
                x, q, k, v, row_scale = parts.projections_after(layer, x, *pending)
            attn = layer.self_attn
            col_scale = None if row_scale is None else attn.qkv_proj.weight_scale  # [1, (Hq + 2 Hkv) D]
            if by_kernel:
                q = qk_norm_rope_store(q, k, v, attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps, cos, sin,
                                       cache.keys[i], cache.values[i], meta.slot_mapping, row_scale, col_scale)
            else:
                if row_scale is not None:  # the scales the kernel would apply
                    q, k, v = (scaled_product(t, row_scale, c).to(x.dtype)
                               for t, c in zip((q, k, v), col_scale.split(attn.qkv_sizes, -1)))
                q, k, v = normed_rotated_heads(attn, q, k, v, cos, sin)
                cache.write(i, meta.slot_mapping, k, v)
            o = backend(q, cache.keys[i], cache.values[i], meta, attn.scale)
            if normed:
                pending = parts.outputs_normed(layer, x, o)
            elif self.residuals_deferred:
                pending = parts.outputs_deferred(layer, x, o)
            else:
                x = parts.outputs(layer, x, o)
        if pending is None:
            return self.norm(x)
        return parts.final_norm_normed(self.norm, *pending) if normed else parts.final_norm_after(self.norm, x, *pending)

    def forward_dense(
        self,
        embeds: torch.Tensor,  # [B, S, H]
        attention_mask: torch.Tensor | None = None,  # [B, S] bool, False on (left) padding
    ) -> torch.Tensor:  # [B, S, H]
        """Whole sequences, no cache: upstream `MossQwen3Model.forward` semantics."""
        B, S, _ = embeds.shape
        if attention_mask is None:
            attention_mask = torch.ones(B, S, dtype=torch.bool, device=embeds.device)
        mask = attention_mask.bool()
        positions = (mask.long().cumsum(-1) - 1).masked_fill(~mask, 0)  # [B, S]
        cos, sin = self._rope(positions, embeds.dtype)
        causal = torch.ones(S, S, dtype=torch.bool, device=embeds.device).tril()
        allowed = causal[None, None] & mask[:, None, None, :]  # [B, 1, S, S]
        # additive mask with finfo.min (not -inf): fully padded query rows stay finite, as upstream
        bias = torch.zeros(allowed.shape, dtype=embeds.dtype, device=embeds.device)
        bias.masked_fill_(~allowed, torch.finfo(embeds.dtype).min)
        keep = mask.unsqueeze(-1).to(embeds.dtype)  # [B, S, 1]

        def attend(q, k, v):  # [B, S, H*, D]
            rep = q.shape[2] // k.shape[2]
            q, k, v = (t.transpose(1, 2) for t in (q, k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)))
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=self.config.head_dim**-0.5)
            return o.transpose(1, 2)

        x = embeds * keep
        for layer in self.layers:
            x = layer(x, cos, sin, attend) * keep
        return self.norm(x) * keep



class BackboneTalker(nn.Module):
    """A talker whose 2-D rows `[..., 1 + n_vq]` are embedded by the family (`embed`) and run
    through a Qwen3 backbone (`language_model`): the Delay and Realtime networks."""

    language_model: Qwen3Model

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [..., 1 + n_vq] -> input embeddings [..., H]."""
        raise NotImplementedError

    def forward(self, ids: torch.Tensor, meta: AttentionMetadata, cache: PagedKVCache,
                backend: AttentionBackend | None = None) -> torch.Tensor:
        """Serving path: packed new rows ids [N, 1 + n_vq] -> final-norm hidden [N, H]."""
        return self.language_model(self.embed(ids), meta, cache, backend)

    def forward_dense(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Teacher forcing without a cache: ids [B, S, 1 + n_vq] -> hidden [B, S, H]."""
        return self.language_model.forward_dense(self.embed(ids), attention_mask)

def hf_language_config(
    *, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, ffn: int, vocab: int,
    pad_token_id: int, max_positions: int = 40960, tie_word_embeddings: bool = False,
) -> dict[str, Any]:
    """A Qwen3 `language_config` dict in the layout upstream's config classes write (random-weight
    checkpoints of every family)."""
    return {
        "model_type": "qwen3",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": ffn,
        "vocab_size": vocab,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
        "max_position_embeddings": max_positions,
        "attention_bias": False,
        "tie_word_embeddings": tie_word_embeddings,
        "pad_token_id": pad_token_id,
    }
