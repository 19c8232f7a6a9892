"""The Delay talker network (docs/model_facts.md, "Delay family"): Qwen3 + summed audio embeddings + n_vq + 1 heads.

Input row embedding: `embed_tokens[text] + sum_k emb_ext[k][code_k]`; the pad code is a learned
row of every `emb_ext` table and *is* added. Every head reads the final-norm hidden state: the
text head `lm_heads.0` [V, H] and the audio heads `lm_heads.{k+1}` [audio_vocab + 1, H], whose pad
logit is -inf. No local transformer. Parameter names equal the upstream state dict
(`language_model.*`, `emb_ext.{k}`, `lm_heads.{j}`); fused SGLang checkpoints (`model.*`) load too.

After loading, `fuse_()` re-seats the n_vq audio tables and heads as views of one stacked tensor
each, so a step gathers all codebooks' embeddings with one index and computes all audio heads
with one batched matmul, with no extra memory.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from stages.models.delay.config import DelayConfig
from stages.models.qwen3 import BackboneTalker, Qwen3Config, Qwen3Model
from stages.runtime.checkpoint import load_weights, read_config, read_state_dict, safetensors_files
from stages.runtime.tensor_parallel import TPGroup, read_shards

# Fused SGLang checkpoints call the backbone `model.` and carry the codec under `codec_model.`.
CHECKPOINT_RENAMES = ((r"^model\.", "language_model."),)
CHECKPOINT_IGNORED = (r"codec_model\..*",)


class DelayModel(BackboneTalker):
    def __init__(self, config: DelayConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.config = config
        self.backbone_config = Qwen3Config.from_hf(config.language)
        hidden, rows = config.hidden_size, config.audio_rows
        self.language_model = Qwen3Model(self.backbone_config, tp)  # tp: backbone split, heads replicated
        self.emb_ext = nn.ModuleList(nn.Embedding(rows, hidden) for _ in range(config.n_vq))
        heads = [nn.Linear(hidden, config.vocab_size, bias=False)]
        heads += [nn.Linear(hidden, rows, bias=False) for _ in range(config.n_vq)]
        self.lm_heads = nn.ModuleList(heads)
        self._audio_tables: torch.Tensor | None = None  # [n_vq, rows, H] after fuse_()
        self._audio_heads: torch.Tensor | None = None  # [n_vq, rows, H] after fuse_()

    # ---- loading -------------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, model_dir: str | Path, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, tp: TPGroup | None = None) -> DelayModel:
        """Build from `config.json` and load the safetensors strictly (one error names every problem).

        With `tp`, only this rank's slices of the split backbone weights are read."""
        config = DelayConfig.from_dict(read_config(model_dir))
        with torch.device("meta"):
            model = cls(config, tp)
        model = model.to_empty(device=device).to(dtype)
        if tp is None:
            state = read_state_dict(model_dir, device=device, dtype=dtype)
            load_weights(model, state, rename=CHECKPOINT_RENAMES, ignore=CHECKPOINT_IGNORED)
        else:
            state = read_shards(model, safetensors_files(model_dir), rename=CHECKPOINT_RENAMES, dtype=dtype)
            load_weights(model, state, ignore=CHECKPOINT_IGNORED)
        return model.fuse_().eval()

    def fuse_(self) -> DelayModel:
        """Stack the audio tables and heads into one tensor each; the modules become views of it."""
        with torch.no_grad():
            tables = torch.stack([e.weight for e in self.emb_ext])  # [n_vq, rows, H]
            heads = torch.stack([h.weight for h in self.lm_heads[1:]])  # [n_vq, rows, H]
            for k in range(self.config.n_vq):
                self.emb_ext[k].weight.data = tables[k]
                self.lm_heads[k + 1].weight.data = heads[k]
        self._audio_tables, self._audio_heads = tables, heads
        return self

    # ---- pieces --------------------------------------------------------------------------------

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [..., 1 + n_vq] -> embeddings [..., H]: text row plus every codebook's row (pad included)."""
        text = self.language_model.embed_tokens(ids[..., 0])  # [..., H]
        if self._audio_tables is None:
            audio = sum(e(ids[..., k + 1]) for k, e in enumerate(self.emb_ext))
            return text + audio
        n_vq, rows, hidden = self._audio_tables.shape
        offsets = torch.arange(n_vq, device=ids.device) * rows  # [n_vq]
        flat = self._audio_tables.view(n_vq * rows, hidden)
        return text + flat[ids[..., 1:] + offsets].sum(-2)  # gather [..., n_vq, H] -> [..., H]

    def text_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> [..., V]."""
        return self.lm_heads[0](hidden)

    def audio_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> [..., n_vq, audio_vocab + 1] with the pad logit at -inf."""
        if self._audio_heads is None:
            logits = torch.stack([h(hidden) for h in self.lm_heads[1:]], dim=-2)
        else:
            logits = torch.einsum("...h,krh->...kr", hidden, self._audio_heads)
        logits[..., self.config.audio_pad_code] = float("-inf")
        return logits
