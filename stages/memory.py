"""A replica's GPU memory plan from its variant and profile (`stages.runtime.memory_plan`).

Reads only configs and the safetensors headers of the checkpoints (no weights), so every worker of
a replica computes the same plan in a moment, before it allocates anything.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from stages.models.codec.config import CodecConfig, TransformerStage
from stages.models.codec.serving import chunk_lengths
from stages.models.codec.streaming import slot_state_bytes
from stages.runtime.checkpoint import read_config, safetensors_files
from stages.runtime.memory_plan import (CodecStageShape, MemoryNeeds, MemoryPlan, codec_workspace,
                                        plan_memory, talker_workspace)

_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}
_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2,
                "I16": 2, "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}


def tensor_bytes(files: list[Path], float_bytes: int) -> int:
    """Bytes the tensors of these safetensors files take once loaded, floating ones at
    `float_bytes` each (from the files' headers: no tensor is read)."""
    total = 0
    for path in files:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            numel = 1
            for dim in entry["shape"]:
                numel *= dim
            dtype = entry["dtype"]
            total += numel * (float_bytes if dtype in _FLOAT_DTYPES else _DTYPE_BYTES.get(dtype, 4))
    return total


def replica_memory_needs(variant: Any, device: str) -> MemoryNeeds:
    """What `variant` served with its profile on `device` needs (`MemoryNeeds`)."""
    import torch

    from stages.runtime.runner_options import resolve_dtype

    profile = variant.profile
    t, c = profile.talker, profile.codec
    dtype = resolve_dtype(profile.model.dtype, device)
    elem = torch.empty((), dtype=dtype).element_size()
    tp = t.tensor_parallel
    backbone = variant.backbone().per_rank(tp) if tp > 1 else variant.backbone()
    kv_dtype = torch.float8_e4m3fn if t.kv_cache_dtype == "fp8" else dtype
    step_tokens = t.max_running + max(t.max_prefill_tokens_per_step, t.mixed_step_tokens)
    talker_weights = tensor_bytes(_talker_files(variant.model_dir, variant.codec_dir), elem) // tp

    codec_cfg = CodecConfig.from_json(read_config(variant.codec_dir))
    lengths = chunk_lengths(profile)
    longest = max(lengths)
    headroom = longest + 1 if c.split_chunks else longest
    graphs = c.cuda_graphs and str(device).startswith("cuda")
    slots = c.max_slots + 1 if graphs else c.max_slots  # the graphs' scratch slot
    in_place = c.ring_attention and (c.ring_attention_max_frames or longest) >= longest
    return MemoryNeeds(
        talker_weights=talker_weights,
        talker_workspace=talker_workspace(
            hidden=backbone.hidden_size, heads=backbone.num_heads, kv_heads=backbone.num_kv_heads,
            head_dim=backbone.head_dim, intermediate=backbone.intermediate_size,
            step_tokens=step_tokens, element_size=elem),
        kv_block_bytes=backbone.kv_cache_spec(1, t.kv_block_size).bytes_per_block(kv_dtype),
        kv_block_tokens=t.kv_block_size,
        max_running=t.max_running,
        codec_weights=tensor_bytes(safetensors_files(variant.codec_dir), elem),
        codec_state=slots * slot_state_bytes(codec_cfg, headroom, elem),
        codec_workspace=codec_workspace(
            decoder=_stage_shapes(codec_cfg.decoder, codec_cfg, headroom),
            encoder=_stage_shapes(codec_cfg.encoder, codec_cfg, None),
            decode_rows=min(profile.coalescing.max_batch, c.max_slots) + (1 if graphs else 0),
            decode_frames=headroom, lanes=c.decode_lanes if graphs else 1,
            attention_in_place=in_place,
            # a batch bounded in seconds: one clip of that length; else encode_batch of the longest
            encode_batch=1 if c.encode_batch_seconds is not None else c.encode_batch,
            encode_seconds=c.encode_batch_seconds or profile.api.max_ref_seconds, element_size=elem,
            encode_graphs=c.encode_graphs and graphs),
        kv_blocks=t.kv_blocks,
    )


def replica_memory_plan(variant: Any, device: str, card: int) -> MemoryPlan:
    """The replica's plan on a card of `card` bytes (`MemoryPlanError` when it does not fit)."""
    return plan_memory(replica_memory_needs(variant, device), card, variant.profile.memory.gpu_utilization)


def _talker_files(model_dir: Path, codec_dir: Path) -> list[Path]:
    """The talker's weight files: the checkpoint's own, never its audio tokenizer's."""
    codec_dir = Path(codec_dir).resolve()
    return [p for p in safetensors_files(model_dir) if codec_dir not in p.resolve().parents]


def _stage_shapes(stages: Any, cfg: CodecConfig, headroom_frames: int | None) -> list[CodecStageShape]:
    from stages.models.codec.streaming import ring_capacity

    return [CodecStageShape(tokens_per_frame=s.tokens_per_frame, d_model=s.d_model,
                            dim_feedforward=s.dim_feedforward,
                            ring_tokens=ring_capacity(s, headroom_frames) if headroom_frames else 0,
                            tokens_per_second=s.rate)
            for s in stages if isinstance(s, TransformerStage)]
