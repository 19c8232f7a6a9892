"""What the Delay, Realtime and Local-v1.5 talker runners share: the capacity settings, the paged KV
cache and the `RowScheduler` over it, and the request bookkeeping that only asks the scheduler.

A subclass keeps its per-request host state in `_requests` (rid -> an object with a `sched:
RowRequest`) and adds its own `add` and `step`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from stages.attention import AttentionBackend, ReferenceAttention
from stages.kv_cache import PagedKVCache
from stages.qwen3 import Qwen3Config
from stages.row_scheduler import RowScheduler, default_num_blocks


class ScheduledRunner:
    frame_rate = 12.5

    def __init__(
        self,
        model: torch.nn.Module,
        backbone: Qwen3Config,
        *,
        max_running: int = 64,
        kv_block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_memory_fraction: float = 0.5,
        prefill_chunk_tokens: int = 512,
        max_prefill_tokens_per_step: int = 2048,
        prefill_interval: int = 1,
        attention: AttentionBackend | None = None,
        spare_kv_blocks: int = 0,
    ) -> None:
        """`backbone` sizes the KV pool (this rank's KV heads); `spare_kv_blocks` are added on top
        of `num_kv_blocks` (or the default count) for the subclass's own use. `prefill_interval`:
        while requests decode, prefill chunks run at most every this many steps (`RowScheduler`)."""
        param = next(model.parameters())
        self.model, self.device, self.dtype = model.eval(), param.device, param.dtype
        self.max_running = max_running
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.max_prefill_tokens_per_step = max_prefill_tokens_per_step
        self.prefill_interval = prefill_interval
        self.attention = attention or ReferenceAttention()
        if num_kv_blocks is None:
            num_kv_blocks = default_num_blocks(backbone, device=self.device, dtype=self.dtype,
                                               max_running=max_running, block_size=kv_block_size,
                                               memory_fraction=kv_memory_fraction)
        self.cache = PagedKVCache(backbone.kv_cache_spec(num_kv_blocks + spare_kv_blocks, kv_block_size),
                                  dtype=self.dtype, device=self.device)
        self.scheduler = RowScheduler(self.cache, max_running=max_running, prefill_chunk_tokens=prefill_chunk_tokens,
                                      max_prefill_tokens_per_step=max_prefill_tokens_per_step,
                                      prefill_interval=prefill_interval)
        self._requests: dict[int, Any] = {}

    @property
    def preemptions(self) -> int:
        """Block holders sent back to prefill for lack of KV blocks."""
        return self.scheduler.preemptions

    def can_admit(self, prompt_len: int) -> bool:
        return self.scheduler.can_admit(prompt_len)

    def remove(self, rid: int) -> None:
        if self._requests.pop(rid, None) is not None:
            self.scheduler.remove(rid)

    def num_running(self) -> int:
        return len(self._requests)

    def rows(self, rid: int) -> np.ndarray:
        """All backbone rows of a running request so far (prompt, then one per generated step)."""
        return self._requests[rid].sched.rows.view().copy()
