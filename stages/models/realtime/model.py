"""MOSS-TTS-Realtime network (docs/model_facts.md, "Realtime"): Qwen3 backbone + 16-codebook local depth transformer.

Backbone input row: `sum_c embed_tokens[c](ids[..., c])` over the 17 columns (text + 16 codebooks;
the padding rows are zero in the checkpoint, upstream zeroes them on load). The backbone's own
`language_model.embed_tokens` is stored by upstream but never used (inputs go in as embeddings):
it is dropped here, explicitly ignored when loading, and costs no memory.

Local depth transformer, one frame: position 0 is the backbone's last hidden state, position i
(1..15) is `local.embed_tokens[i-1](code_{i-1})`; head i (`local_lm_heads[i]`) predicts codebook i
from position i. Qwen3-style layers (q/k RMSNorm, NeoX RoPE at positions 0..15, SwiGLU), causal.
The per-frame step keeps a static 16-slot KV buffer per layer, so every step has the same shapes.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from stages.models.qwen3 import BackboneTalker, Qwen3Config, Qwen3DecoderLayer, Qwen3Model, RMSNorm, rope_cos_sin
from stages.models.realtime.config import RealtimeConfig
from stages.runtime.checkpoint import load_weights, read_config, read_state_dict

UNUSED_CHECKPOINT_TENSORS = (r"language_model\.embed_tokens\.weight",)


class LocalKV:
    """Per-frame state of the depth transformer: per layer `[B, rvq, Hkv, D]` keys and values, plus
    the RoPE tables `[rvq, D]` and visibility masks `[rvq, 1, rvq]` of the rvq positions, made once
    per frame so a position step issues no host-to-device copy."""

    def __init__(self, num_layers: int, batch: int, slots: int, kv_heads: int, head_dim: int, theta: float,
                 *, dtype: torch.dtype, device: torch.device) -> None:
        shape = (batch, slots, kv_heads, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        positions = torch.arange(slots, device=device)
        self.cos, self.sin = rope_cos_sin(positions, head_dim, theta, dtype)  # [rvq, D]
        self.visible = (positions[None, :] <= positions[:, None])[:, None, :]  # [rvq, 1, rvq]


class LocalModel(nn.Module):
    """`local_transformer.model`: codebook input tables, decoder layers, final norm."""

    def __init__(self, cfg: Qwen3Config, rvq: int, audio_vocab: int) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.ModuleList(nn.Embedding(audio_vocab, cfg.hidden_size) for _ in range(rvq - 1))
        self.layers = nn.ModuleList(Qwen3DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LocalTransformer(nn.Module):
    """`local_transformer`: the depth model and its 16 heads."""

    def __init__(self, cfg: Qwen3Config, rvq: int, audio_vocab: int) -> None:
        super().__init__()
        self.rvq = rvq
        self.model = LocalModel(cfg, rvq, audio_vocab)
        self.local_lm_heads = nn.ModuleList(nn.Linear(cfg.hidden_size, audio_vocab, bias=False) for _ in range(rvq))

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.model.config
        return rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, dtype)

    def forward_dense(self, hidden: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """Teacher forcing: hidden [B, H] + codes [B, rvq - 1] of the frame -> logits [B, rvq, vocab]."""
        cfg = self.model.config
        inputs = [hidden] + [self.model.embed_tokens[i](codes[:, i]) for i in range(self.rvq - 1)]
        x = torch.stack(inputs, dim=1)  # [B, rvq, H]
        cos, sin = self._rope(torch.arange(self.rvq, device=x.device), x.dtype)  # [rvq, D]

        def attend(q, k, v):  # [B, L, H*, D]
            rep = q.shape[2] // k.shape[2]
            q, k, v = (t.transpose(1, 2) for t in (q, k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)))
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=cfg.head_dim**-0.5)
            return o.transpose(1, 2)

        for layer in self.model.layers:
            x = layer(x, cos, sin, attend)
        x = self.model.norm(x)  # [B, rvq, H]
        return torch.stack([head(x[:, i]) for i, head in enumerate(self.local_lm_heads)], dim=1)

    def new_kv(self, batch: int, dtype: torch.dtype, device: torch.device) -> LocalKV:
        cfg = self.model.config
        return LocalKV(cfg.num_layers, batch, self.rvq, cfg.num_kv_heads, cfg.head_dim, cfg.rope_theta,
                       dtype=dtype, device=device)

    def step(self, x: torch.Tensor, position: int, kv: LocalKV) -> torch.Tensor:
        """One depth position for a batch: input x [B, H] at `position` -> logits [B, vocab] of that head."""
        cfg = self.model.config
        cos, sin = kv.cos[position], kv.sin[position]  # [D]
        visible = kv.visible[position]  # [1, rvq]: slots written so far

        for i, layer in enumerate(self.model.layers):

            def attend(q, k, v, i=i):  # q [B, Hq, D], k/v [B, Hkv, D]
                kv.keys[i][:, position] = k
                kv.values[i][:, position] = v
                rep = q.shape[1] // k.shape[1]
                keys = kv.keys[i].repeat_interleave(rep, 2).transpose(1, 2)  # [B, Hq, rvq, D]
                values = kv.values[i].repeat_interleave(rep, 2).transpose(1, 2)
                o = F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=visible,
                                                   scale=cfg.head_dim**-0.5)  # [B, Hq, 1, D]
                return o[:, :, 0]

            x = layer(x, cos, sin, attend)
        return self.local_lm_heads[position](self.model.norm(x))

    def embed_code(self, codebook: int, codes: torch.Tensor) -> torch.Tensor:
        """Input of depth position `codebook + 1`: codes [B] of `codebook` -> [B, H]."""
        return self.model.embed_tokens[codebook](codes)


class RealtimeModel(BackboneTalker):
    def __init__(self, config: RealtimeConfig) -> None:
        super().__init__()
        self.config = config
        backbone = Qwen3Config.from_hf(config.language)
        hidden = backbone.hidden_size
        self.embed_tokens = nn.ModuleList([nn.Embedding(backbone.vocab_size, hidden)])
        self.embed_tokens.extend(nn.Embedding(config.audio_vocab_size, hidden) for _ in range(config.rvq))
        self.language_model = Qwen3Model(backbone)
        self.language_model.embed_tokens = None  # unused upstream too: inputs go in as embeddings
        local = Qwen3Config.from_hf(config.local)
        self.local_transformer = LocalTransformer(local, config.rvq, config.audio_vocab_size)

    @classmethod
    def from_dir(cls, model_dir: str | Path, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32) -> RealtimeModel:
        config = RealtimeConfig.from_dict(read_config(model_dir))
        with torch.device("meta"):
            model = cls(config)
        model = model.to_empty(device=device).to(dtype)
        state = read_state_dict(model_dir, device=device, dtype=dtype)
        load_weights(model, state, ignore=UNUSED_CHECKPOINT_TENSORS)
        return model.zero_padding_rows_().eval()

    def zero_padding_rows_(self) -> RealtimeModel:
        """Upstream `from_pretrained` re-initialises the input tables' `padding_idx` rows to zero
        after loading (text pad id in table 0, audio pad 1024 in tables 1..16), whatever the file
        holds; do the same. The depth transformer's tables are left as stored."""
        with torch.no_grad():
            self.embed_tokens[0].weight[self.config.pad_token_id].zero_()
            for table in self.embed_tokens[1:]:
                table.weight[self.config.audio_pad].zero_()
        return self

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [..., 1 + rvq] -> [..., H]: the sum of the 17 column embeddings."""
        x = self.embed_tokens[0](ids[..., 0])
        for c in range(1, self.config.rvq + 1):
            x = x + self.embed_tokens[c](ids[..., c])
        return x
