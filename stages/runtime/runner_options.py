"""What the profile says about building a talker runner: the weight dtype, the capacity keywords,
the attention kernel, the CUDA graphs and the batch-invariant mode. Shared by every family's `make_talker_runner`."""

from __future__ import annotations

from typing import Any

import torch

from profiles import Profile
from stages.runtime.attention.backends import make_attention
from stages.runtime.batch_invariant import batch_invariant_supported, invariant_attention


def resolve_dtype(profile_dtype: str, device: str) -> torch.dtype:
    """`model.dtype` of a profile: auto = bfloat16 on cuda, float32 elsewhere."""
    if profile_dtype == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[profile_dtype]


def talker_options(profile: Profile) -> dict[str, Any]:
    """Runner capacity keywords from the profile's `talker` section."""
    t = profile.talker
    return dict(max_running=t.max_running, kv_block_size=t.kv_block_size, num_kv_blocks=t.kv_blocks,
                prefill_chunk_tokens=t.prefill_chunk_tokens,
                max_prefill_tokens_per_step=t.max_prefill_tokens_per_step, prefill_interval=t.prefill_interval,
                prefix_caching=t.prefix_caching, max_step_ms=t.max_step_ms,
                prefill_graph_seqs=t.prefill_graph_seqs,
                kv_cache_dtype=torch.float8_e4m3fn if t.kv_cache_dtype == "fp8" else None)


def talker_runner_options(profile: Profile, device: str, *, backbone_graphs: bool = False) -> dict[str, Any]:
    """`talker_options` plus the attention kernel the profile asks for (`talker.attention`) and
    `cuda_graphs`: `talker.cuda_graphs`, on CUDA only. A runner whose graphs are backbone graphs
    (`backbone_graphs`: the Delay and Realtime runners) needs `talker.backbone_graphs` on too. On
    CPU, "auto" attention keeps the runner's default (the per-sequence reference).
    `batch_invariant`: `talker.batch_invariant`; with it the attention is the invariant Triton
    backend (ValueError where its kernels cannot run). `prefill_graphs`: `talker.prefill_graphs`
    (used with graphs only)."""
    t = profile.talker
    cuda = str(device).startswith("cuda")
    if t.batch_invariant:
        if not batch_invariant_supported(device):
            raise ValueError(f"talker.batch_invariant needs CUDA and triton (device {device})")
        attention = invariant_attention()
    else:
        attention = make_attention(t.attention, device) if cuda or t.attention != "auto" else None
    graphs = t.cuda_graphs and (t.backbone_graphs or not backbone_graphs) and cuda
    return dict(talker_options(profile), attention=attention, cuda_graphs=graphs, batch_invariant=t.batch_invariant,
                prefill_graphs=t.prefill_graphs)
