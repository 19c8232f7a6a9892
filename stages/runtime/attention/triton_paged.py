"""Triton paged attention: the new tokens attend straight over the KV block pool, no gather.

`TritonPagedAttention` implements the `stages.runtime.attention.backends.AttentionBackend` seam:
`backend(q [N, Hq, D], k_pool, v_pool [num_blocks, block_size, Hkv, D], meta, scale) -> [N, Hq, D]`.
Unlike `PaddedBatchAttention` it never copies a sequence's blocks into a padded K/V tensor: the
kernel reads each key/value row through the sequence's block table
(token t lives in block `block_tables[seq, t // block_size]`, row `t % block_size`).

One kernel, `_paged_attention_kernel`, serves both groups of a mixed batch:

* decode (one new token per sequence): a program owns one sequence and one KV head and handles
  all `Hq / Hkv` query heads that share that KV head together (GQA), padded to 16 rows for
  `tl.dot`. Optionally split-K ("flash-decoding"): `num_splits` programs per (sequence, KV head)
  each cover a slice of the keys and write an fp32 partial output + log-sum-exp, and
  `_combine_splits_kernel` merges them. Worth it when few sequences have long contexts (B=1).
* prefill chunks: a program owns a tile of `BLOCK_M` query tokens x the query heads of one KV head
  (rows flattened to `BLOCK_M * G`) and applies the causal mask: query j of a chunk of q_len new
  tokens sits at position `seq_len - q_len + j` and sees keys 0..that position.

Both use an online softmax in fp32 (exp2 with the scale folded in) over tiles of `BLOCK_N` keys.
With `decode_as_prefill` (the batch-invariant mode) decode rows run the prefill program with one
split, so no row's sums depend on the batch; keys past a row's position add exact zeros.

Graph capture: the launch grids and every constexpr depend only on tensor shapes (rows in the
group, width of `prefill_rows`, KV heads, head dim, block size, block-table width), never on tensor
values; lengths and block ids are read by the kernel from device tensors. Eager calls pass block
tables as wide as their batch's longest; the table stride is not specialised on (Triton would
compile a variant for a width of 1, a multiple of 16 and any other), so a width first met under
load compiles nothing then. The only host values
read from `meta` are shapes, so a decode-only step launches identically inside a CUDA graph
(`stages/models/local_v15/graphs.py`), and no call synchronises with the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stages.runtime.attention.metadata import AttentionMetadata
from stages.runtime.kv_cache import KVCacheSpec


@triton.jit(do_not_specialize=["stride_tb"])  # one kernel for every block-table width (see below)
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    seqs_ptr, qstart_ptr, tables_ptr, seq_lens_ptr,
    qk_scale,  # softmax scale * log2(e)
    stride_qn, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_on, stride_oh, stride_tb, stride_sl,
    REP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr,  # REP rounded up to a power of two (>= 16 / BLOCK_M)
    BLOCK_M: tl.constexpr,  # query tokens per program (1 for decode)
    BLOCK_N: tl.constexpr,  # keys per inner step
    BLOCK_SIZE: tl.constexpr,  # KV block (page) size
    NUM_SPLITS: tl.constexpr,  # >1: write fp32 partials + lse for _combine_splits_kernel
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no tf32), else None (the default)
    DOT_FP32: tl.constexpr,  # on CPU (interpreter: its bf16 tl.dot is wrong, its fp32 one is numpy's
    # matmul, whose bits for a row can depend on where the row sits): fp32 products and sums
):
    """Program (tile * NUM_SPLITS + split, i, kv_head) -> rows of group sequence `seqs[i]`."""
    tile = tl.program_id(0) // NUM_SPLITS
    split = tl.program_id(0) % NUM_SPLITS
    seq = tl.load(seqs_ptr + tl.program_id(1))
    kvh = tl.program_id(2)
    q_first = tl.load(qstart_ptr + seq)
    q_len = tl.load(qstart_ptr + seq + 1) - q_first
    seq_len = tl.load(seq_lens_ptr + seq * stride_sl).to(tl.int32)

    r = tl.arange(0, BLOCK_M * BLOCK_G)  # flattened (token, head) rows of this tile
    j = tile * BLOCK_M + r // BLOCK_G  # token within the chunk
    g = r % BLOCK_G
    row_ok = (j < q_len) & (g < REP)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_rows = (q_first + j).to(tl.int64)
    heads = kvh * REP + g
    q = tl.load(q_ptr + q_rows[:, None] * stride_qn + heads[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    q_pos = seq_len - q_len + j  # causal limit of each row

    # keys this tile can see, divided among the splits in multiples of BLOCK_N
    kv_end = tl.minimum(seq_len, seq_len - q_len + (tile + 1) * BLOCK_M)
    kv_end = tl.where(tile * BLOCK_M < q_len, kv_end, 0)  # a tile past a short chunk: no work
    per_split = ((kv_end + NUM_SPLITS - 1) // NUM_SPLITS + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, kv_end)

    m_i = tl.full([BLOCK_M * BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < end
        block = tl.load(tables_ptr + seq * stride_tb + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        in_block = (n % BLOCK_SIZE).to(tl.int64)
        kv_mask = n_ok[None, :] & d_ok[:, None]
        k_t = tl.load(k_ptr + (block * stride_kb + in_block * stride_kt + kvh * stride_kh)[None, :] + d[:, None],
                      mask=kv_mask, other=0.0)  # [BLOCK_D, BLOCK_N]
        if DOT_FP32:  # the interpreter: products and sums, a row's the same wherever it sits in the tile
            s = tl.sum(q[:, :, None] * k_t.to(tl.float32)[None, :, :], 1) * qk_scale
        else:
            s = tl.dot(q, k_t.to(q.dtype), input_precision=DOT_PRECISION) * qk_scale  # [rows, BLOCK_N], log2
        allowed = n_ok[None, :] & (n[None, :] <= q_pos[:, None])
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet: no NaN
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + (block * stride_vb + in_block * stride_vt + kvh * stride_vh)[:, None] + d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        if DOT_FP32:
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], 1)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
        m_i = m_new

    has_keys = l_i > 0.0
    o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    store_mask = row_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + q_rows[:, None] * stride_on + heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:  # partials [N, Hq, NUM_SPLITS, (BLOCK_D)], contiguous
        part = (q_rows * (REP * tl.num_programs(2)) + heads) * NUM_SPLITS + split  # Hq = REP * Hkv
        tl.store(part_o_ptr + part[:, None] * BLOCK_D + d[None, :], o, mask=store_mask)
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=row_ok)


@triton.jit
def _combine_splits_kernel(
    out_ptr, part_o_ptr, part_lse_ptr, seqs_ptr, qstart_ptr, stride_on, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    """Program (i, head): out[row, head] = lse-weighted mean of the split partials, where row is
    the decode token of sequence seqs[i]."""
    row = tl.load(qstart_ptr + tl.load(seqs_ptr + tl.program_id(0))).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, BLOCK_D)
    base = (row * NUM_HEADS + head) * NUM_SPLITS
    lse = tl.load(part_lse_ptr + base + s)  # split 0 always has keys, so the max is finite
    w = tl.exp2(lse - tl.max(lse, 0))
    o = tl.load(part_o_ptr + (base + s)[:, None] * BLOCK_D + d[None, :], mask=(lse > float("-inf"))[:, None],
                other=0.0)
    o = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + row * stride_on + head * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def _pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


class TritonPagedAttention:
    """Paged attention backend: decode group and prefill group each in one kernel launch.

    `block_n`: keys per inner tile (power of two, >= 16); None picks it from the cache's element
    size, `tile_key_bytes` / bytes per element (64 keys of a bf16 cache, 128 of a float8 one:
    a program keeps as many bytes in flight whatever the cache holds). `block_m`: prefill query
    tokens per program. `num_splits`: split-K factor of the decode group; None picks it from
    shapes only (enough programs to fill the GPU, at least `min_split_tokens` keys per split).
    `num_stages`: software pipelining depth of the key loop; None picks it from the cache's
    element size (`stages_per_loop`).
    """

    table_width_free = True  # reads a block table only as far as its sequence's length

    tile_key_bytes = 128  # keys per tile x bytes per cache element, when block_n is None

    def __init__(self, *, block_n: int | None = None, block_m: int = 16, num_splits: int | None = None,
                 target_programs: int = 256, min_split_tokens: int = 128, num_warps: int = 4,
                 num_stages: int | None = None, decode_as_prefill: bool = False) -> None:
        if block_n is not None and (block_n < 16 or block_n & (block_n - 1)):
            raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
        if num_splits is not None and (num_splits < 1 or num_splits & (num_splits - 1)):
            raise ValueError(f"num_splits must be a power of two >= 1, got {num_splits}")
        self.block_n, self.block_m, self.num_splits = block_n, _pow2(block_m), num_splits
        self.target_programs, self.min_split_tokens, self.num_warps = target_programs, min_split_tokens, num_warps
        self.num_stages = num_stages
        if decode_as_prefill and num_splits not in (None, 1):
            raise ValueError(f"decode_as_prefill runs one split, got num_splits={num_splits}")
        self.decode_as_prefill = decode_as_prefill

    @property
    def batch_invariant(self) -> bool:
        """A row's result depends on its own sequence only: one split whatever the batch, and decode
        rows computed as prefill rows."""
        return self.decode_as_prefill

    def keys_per_tile(self, cache_dtype: torch.dtype) -> int:
        """Keys a program reads per step of its loop over a cache of `cache_dtype`: `block_n`, or
        64 for 2-byte elements and 128 for 1-byte ones (the same bytes a tile)."""
        if self.block_n is not None:
            return self.block_n
        return max(16, self.tile_key_bytes // cache_dtype.itemsize)

    def stages_per_loop(self, cache_dtype: torch.dtype) -> int | None:
        """Software pipelining depth of the key loop over a cache of `cache_dtype`: `num_stages`,
        or 2 for 1-byte elements and Triton's default (None) for wider ones. On one H200 a float8
        cache's 128-key tiles took 54.7 / 97.2 / 46.6 / 54.6 us with 2 stages against 92.5 / 95.4
        / 47.1 / 52.8 with the default, one decode layer of 88 x 400, 88 x 1000, 44 x 400 and
        44 x 1000 keys (`python -m bench.kernels.paged_attention`); bf16 tiles gained nothing from 2."""
        if self.num_stages is not None or cache_dtype.itemsize != 1:
            return self.num_stages
        return 2

    def decode_splits(self, n_seqs: int, n_kv_heads: int, max_tokens: int) -> int:
        """Split-K factor from shapes only: double while the grid is below `target_programs` and
        each split keeps at least `min_split_tokens` of `max_tokens` (the block-table width)."""
        if self.num_splits is not None:
            return self.num_splits
        s = 1
        while s < 64 and n_seqs * n_kv_heads * s * 2 <= self.target_programs \
                and max_tokens >= s * 2 * self.min_split_tokens:
            s *= 2
        return s

    def split_counts(self) -> list[int]:
        """Every split count `decode_splits` can return (a kernel variant each)."""
        if self.num_splits is not None:
            return [self.num_splits]
        return [1 << i for i in range(7)]  # 1 .. 64

    def warm_variants(self, spec: KVCacheSpec, dtype: torch.dtype, num_heads: int, device: torch.device | str,
                      kv_dtype: torch.dtype | None = None) -> int:
        """Launch every kernel variant a call can pick once, on tiny inputs of the served dtypes
        and layout (`spec`'s KV heads, head dim and block size, `num_heads` query heads; queries
        in `dtype`, the cache in `kv_dtype`, `dtype` when None): decode
        with each split count (`split_counts`) and its split combiner, and prefill, so that none
        is compiled in the middle of a serving step. A step's rows that no graph takes come here
        with a split count that follows their batch (one prompt token left after the prefix
        cache's blocks is a decode row), and a count no warm-up batch produced was a JIT compile
        of hundreds of milliseconds. Returns the launches made."""
        from stages.runtime.attention.metadata import build_attention_metadata
        from stages.runtime.kv_cache import PagedKVCache

        cache = PagedKVCache(KVCacheSpec(1, spec.num_kv_heads, spec.head_dim, 4, spec.block_size),
                             dtype=kv_dtype or dtype, device=device)
        keys, values = cache.keys[0], cache.values[0]
        scale = spec.head_dim ** -0.5
        decode = build_attention_metadata(cache, [(0, 1)], device)
        q = torch.zeros(1, num_heads, spec.head_dim, dtype=dtype, device=device)  # [1, Hq, D]
        launches = 0
        for splits in self.split_counts():
            if self.decode_as_prefill:
                break
            self._launch(q, keys, values, decode, scale, torch.zeros_like(q), decode.decode_seqs, block_m=1,
                         tiles=1, splits=splits)
            launches += 1
        prefill = build_attention_metadata(cache, [(1, 2)], device)
        self(torch.zeros(2, num_heads, spec.head_dim, dtype=dtype, device=device), keys, values, prefill, scale)
        return launches + 1

    def __call__(self, q, k_pool, v_pool, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # rows no sequence covers (prefill and mixed graphs' padding) are cleared to stay finite;
        # where every row attends (decode steps, graphed or not) the kernels write them all
        out = torch.empty_like(q) if meta.every_row_attends else torch.zeros_like(q)
        n_dec = meta.decode_seqs.shape[0]
        if n_dec and self.decode_as_prefill:
            self._launch(q, k_pool, v_pool, meta, scale, out, meta.decode_seqs, block_m=self.block_m, tiles=1, splits=1)
        elif n_dec:
            splits = self.decode_splits(n_dec, k_pool.shape[2], meta.block_tables.shape[1] * k_pool.shape[1])
            self._launch(q, k_pool, v_pool, meta, scale, out, meta.decode_seqs, block_m=1, tiles=1, splits=splits)
        if meta.prefill_seqs.shape[0]:
            tiles = -(-meta.prefill_rows.shape[1] // self.block_m)
            self._launch(q, k_pool, v_pool, meta, scale, out, meta.prefill_seqs, block_m=self.block_m,
                         tiles=tiles, splits=1)
        return out

    def _launch(self, q, k_pool, v_pool, meta, scale, out, seqs, *, block_m, tiles, splits) -> None:
        N, Hq, D = q.shape
        block_size, Hkv = k_pool.shape[1], k_pool.shape[2]
        if q.stride(-1) != 1 or k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1:
            raise ValueError("q, k_pool and v_pool need a contiguous last (head_dim) dimension")
        if seqs.stride(0) != 1 or meta.query_start_loc.stride(0) != 1:
            raise ValueError("decode_seqs/prefill_seqs and query_start_loc must be contiguous")
        rep = Hq // Hkv
        block_d = _pow2(D)
        block_g = max(_pow2(rep), -(-16 // block_m))  # tl.dot needs >= 16 rows
        tables = meta.block_tables
        if splits > 1:
            part_o = torch.empty(N, Hq, splits, block_d, dtype=torch.float32, device=q.device)
            part_lse = torch.empty(N, Hq, splits, dtype=torch.float32, device=q.device)
        else:
            part_o = part_lse = out  # unused
        grid = (tiles * splits, seqs.shape[0], Hkv)
        stages = self.stages_per_loop(k_pool.dtype)
        _paged_attention_kernel[grid](
            q, k_pool, v_pool, out, part_o, part_lse,
            seqs, meta.query_start_loc, tables, meta.seq_lens,
            scale * 1.4426950408889634,
            q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
            v_pool.stride(0), v_pool.stride(1), v_pool.stride(2), out.stride(0), out.stride(1), tables.stride(0),
            meta.seq_lens.stride(0),
            REP=rep, HEAD_DIM=D, BLOCK_D=block_d, BLOCK_G=block_g, BLOCK_M=block_m,
            BLOCK_N=self.keys_per_tile(k_pool.dtype),
            BLOCK_SIZE=block_size, NUM_SPLITS=splits,
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,
            DOT_FP32=q.device.type == "cpu", num_warps=self.num_warps,
            **({} if stages is None else {"num_stages": stages}),
        )
        if splits > 1:
            _combine_splits_kernel[(seqs.shape[0], Hq)](
                out, part_o, part_lse, seqs, meta.query_start_loc, out.stride(0), out.stride(1),
                NUM_HEADS=Hq, HEAD_DIM=D, BLOCK_D=block_d, NUM_SPLITS=splits, num_warps=self.num_warps,
            )
