"""`sample_tokens` in one kernel a head (Triton): logits to tokens, every step in registers.

The torch sampler (`stages.runtime.sampling`) runs a head's sampling as a chain of small kernels
(a top-k, two sorts and their gathers, the scaled and masked softmax mass, a scan, the hashed
noise, an argmin, a gather): at 13 heads a frame that is most of the local loop's launches. Here a
program owns one row and does the same arithmetic in the same order: the repetition penalty, the
ranking (value descending, vocabulary index ascending; one bitonic sort of (value, index) packed
into 64-bit keys), temperature, the top-k threshold, the top-p prefix of the unnormalised mass,
and the exponential race with the counter-based noise of each entry's vocabulary index (the same
hash, so the same draw). Only rounding differs from the torch chain (the scan's order, the
exclusive prefix taken as `cum - mass`), so a token can differ where two candidates' race values
or a top-p boundary fall within float rounding of each other; a row's token depends on its own
logits, settings, seed and frame alone, as there. `width` (the candidate path's K_CAP, or the
whole vocabulary) bounds the ranks that can be drawn, as `sample_tokens(candidates=)` does.
On CPU it runs in Triton's interpreter (the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stages.runtime.sampling import RowSampling


@triton.jit
def _mix32(x):
    """lowbias32 on uint32 (`sampling._mix32`)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _sample_kernel(
    logits_ptr, stride_l, seen_ptr, stride_s, temp_ptr, topk_ptr, topp_ptr, penalty_ptr, greedy_ptr, key_ptr,
    stride_k, out_ptr, V, width,
    HAS_SEEN: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Program (row b): out[b] = the token of logits[b] under the row's settings and noise key."""
    b = tl.program_id(0).to(tl.int64)
    v = tl.arange(0, BLOCK_V)
    ok = v < V
    x = tl.load(logits_ptr + b * stride_l + v, mask=ok, other=float("-inf")).to(tl.float32)
    if HAS_SEEN:
        seen = tl.load(seen_ptr + b * stride_s + v, mask=ok, other=0) != 0
        p = tl.load(penalty_ptr + b)
        x = tl.where(seen, tl.where(x < 0, x * p, x / p), x)
    # rank: 64-bit keys (order-preserving value bits, then the index reversed) sorted descending
    bits = x.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    keys = (ordered.to(tl.int64) << 32) | (BLOCK_V - 1 - v).to(tl.int64)
    keys = tl.sort(keys, descending=True)
    index = BLOCK_V - 1 - (keys & 0xFFFFFFFF).to(tl.int32)  # [BLOCK_V] vocabulary index by rank
    ordered = (keys >> 32).to(tl.int32)
    values = tl.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered).to(tl.float32, bitcast=True)
    rank = tl.arange(0, BLOCK_V)

    temperature = tl.load(temp_ptr + b)
    s = values / tl.maximum(temperature, 1e-6)
    k = tl.load(topk_ptr + b)
    k = tl.minimum(tl.where(k > 0, k, V), width)  # k <= 0 or k >= V keeps everything (within width)
    kth = tl.sum(tl.where(rank == k - 1, s, 0.0))
    top = tl.max(s)
    drawable = rank < width
    mass = tl.where(drawable & (s >= kth), tl.exp(s - top), 0.0)  # unnormalised top-k softmax
    cum = tl.cumsum(mass, 0)
    total = tl.sum(mass)
    p = tl.load(topp_ptr + b)
    limit = tl.where(p > 0, p, float("inf")) * total  # p >= 1 keeps everything, p <= 0 is off
    keep = ((cum - mass) <= limit) & (mass > 0)  # the mass ranked before an entry within the limit
    key = tl.load(key_ptr + b * stride_k).to(tl.uint32)
    h = _mix32(_mix32(key ^ index.to(tl.uint32)))
    log_u = tl.log(((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0))  # log U, U in (0, 1]
    race = tl.where(keep, mass / log_u, float("inf"))  # -(mass / E): the draw is its argmin
    pick = tl.argmin(race, 0, tie_break_left=True)
    sampled = tl.sum(tl.where(rank == pick, index, 0))
    greedy = (tl.load(greedy_ptr + b) != 0) | (temperature <= 0)
    first = tl.sum(tl.where(rank == 0, index, 0))
    tl.store(out_ptr + b, tl.where(greedy, first, sampled).to(tl.int64))


def sample_tokens_fused(logits: torch.Tensor, rows: RowSampling, key: torch.Tensor, seen: torch.Tensor | None = None,
                        *, width: int | None = None) -> torch.Tensor:
    """logits [B, V], the rows' settings ([B] tensors, contiguous), their noise keys [B] (any stride;
    `sampling.noise_key`), `seen` [B, V]
    bool (this request's earlier tokens of the head; with a repetition penalty) -> tokens [B] int64.
    `width`: the ranks a draw may come from (None: every entry; the candidate path: K_CAP)."""
    B, V = logits.shape
    block_v = max(16, triton.next_power_of_2(V))
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B == 0:
        return out
    if logits.stride(-1) != 1 or (seen is not None and seen.stride(-1) != 1):
        raise ValueError("logits and seen need a contiguous vocabulary dimension")
    seen_arg = seen.view(torch.int8) if seen is not None else logits  # unread without HAS_SEEN
    _sample_kernel[(B,)](
        logits, logits.stride(0), seen_arg, seen.stride(0) if seen is not None else 0,
        rows.temperature, rows.top_k, rows.top_p, rows.repetition_penalty, rows.greedy, key, key.stride(0), out,
        V, min(V, width or V),
        HAS_SEEN=seen is not None, BLOCK_V=block_v, num_warps=4 if block_v >= 512 else 1,
    )
    return out
