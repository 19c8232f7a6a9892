"""The talker's paged attention alone, a decode step's layer: `python -m bench.kernels.paged_attention`.

One decode row per sequence over a paged cache filled round-robin (so every sequence's blocks
are scattered through the pool, as in the server), the Local-v1.5 backbone's heads (32 query, 8
KV, head size 128, blocks of 16 keys) at `--seqs` sequences of `--context` keys. Each variant
(cache dtype x keys per tile x warps x pipeline stages x key splits) is timed over `--iters` launches
replayed from one CUDA graph (no host launch cost; eagerly on the CPU), each launch on the next of
enough copies of the cache that none finds its keys and values in L2 (36 layers' caches do not fit
there either), and printed with the bytes of keys and values it had to read per launch, the rate that makes, its
max |difference| from the reference over the same stored values, and its time against the
first variant (the shipped one: bf16, Triton's defaults). On an H200 a layer at 88 sequences
took ~37 us as shipped, 36 layers 1.33 ms of an 8 ms step; a float8 cache read with 2 pipeline
stages took 0.66x the bf16 time at 88 x 400 keys. With one program a sequence and KV head and
no split below 256 programs, 44 or 88 sequences run 352 or 704 programs of 7 serial tiles each
at 1.6-1.7 TB/s: whether splitting their keys (flash-decoding, the fifth field) loads the
memory better is what the splits answer. `--quick` runs a tiny shape on whatever device there
is (the CPU through Triton's interpreter: TRITON_INTERPRET=1 before triton is imported).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from bench.kernels.timing import graph_us
from stages.runtime.attention.backends import ReferenceAttention
from stages.runtime.attention.metadata import build_attention_metadata
from stages.runtime.attention.triton_paged import TritonPagedAttention
from stages.runtime.kv_cache import KVCacheSpec, PagedKVCache

CACHE_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
DEFAULT_VARIANTS = ("bf16,-,4,- bf16,-,4,-,2 bf16,-,4,-,4 bf16,-,4,-,8 bf16,32,4,-,4 bf16,64,8,-,4 "
                    "fp8,-,4,- fp8,-,4,-,2 fp8,-,4,-,4 fp8,64,4,3,4")


@dataclass(frozen=True)
class Variant:
    """One configuration: cache dtype name, keys per tile, warps, stages and key splits of each
    sequence (None: the default; splits by default as the server picks them from shapes)."""

    cache: str
    block_n: int | None
    num_warps: int
    num_stages: int | None
    num_splits: int | None = None

    @classmethod
    def parse(cls, text: str) -> "Variant":
        """`cache,block_n,warps,stages[,splits]`, `-` for a default: `fp8,128,8,3`, `bf16,-,4,-,4`."""
        fields = text.split(",")
        if len(fields) not in (4, 5):
            raise ValueError(f"variant {text!r}: cache,keys per tile,warps,stages[,splits]")
        cache, block_n, warps, stages = fields[:4]
        if cache not in CACHE_DTYPES:
            raise ValueError(f"cache dtype {cache!r}: one of {sorted(CACHE_DTYPES)}")
        splits = fields[4] if len(fields) == 5 else "-"
        return cls(cache, None if block_n == "-" else int(block_n), int(warps),
                   None if stages == "-" else int(stages), None if splits == "-" else int(splits))

    def __str__(self) -> str:
        def show(x):
            return "-" if x is None else str(x)
        text = f"{self.cache},{show(self.block_n)},{self.num_warps},{show(self.num_stages)}"
        return text if self.num_splits is None else f"{text},{self.num_splits}"


@dataclass
class Result:
    """A variant's time per launch, bytes read per launch and max |error| from the reference."""

    variant: Variant
    us: float
    bytes_read: int
    max_error: float


def filled_cache(spec: KVCacheSpec, seqs: int, context: int, device: torch.device,
                 seed: int = 0) -> PagedKVCache:
    """A one-layer bf16 cache with `seqs` sequences of `context` keys, grown a block at a time in
    turn (their blocks interleave through the pool), random keys and values."""
    cache = PagedKVCache(spec, dtype=torch.bfloat16, device=device)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    cache.keys[0].copy_(torch.randn(cache.keys[0].shape, generator=gen))
    cache.values[0].copy_(torch.randn(cache.values[0].shape, generator=gen))
    left = dict.fromkeys(range(seqs), context)
    while any(left.values()):
        for s, n in left.items():
            if n:
                take = min(n, spec.block_size)
                cache.append_slots(s, take)
                left[s] -= take
    return cache


def run(seqs: int, context: int, heads: int, kv_heads: int, head_dim: int, block_size: int,
        variants: list[Variant], iters: int, device: torch.device) -> list[Result]:
    """Time every variant on the same sequences; the float8 ones read the bf16 cache's values
    cast to float8 (saturating), and are checked against the reference over those."""
    blocks = seqs * -(-(context + 1) // block_size) + 4
    spec = KVCacheSpec(1, kv_heads, head_dim, blocks, block_size)
    cache = filled_cache(spec, seqs, context, device)
    for s in range(seqs):  # the decode row's own key
        cache.append_slots(s, 1)
    meta = build_attention_metadata(cache, [(s, 1) for s in range(seqs)], device)
    q = torch.randn(seqs, heads, head_dim, generator=torch.Generator().manual_seed(1)).to(device, torch.bfloat16)
    scale = head_dim ** -0.5
    pools = {"bf16": (cache.keys[0], cache.values[0])}
    finfo = torch.finfo(torch.float8_e4m3fn)
    pools["fp8"] = tuple(p.float().clamp(finfo.min, finfo.max).to(torch.float8_e4m3fn) for p in pools["bf16"])
    want = {name: ReferenceAttention()(q, k.to(torch.bfloat16), v.to(torch.bfloat16), meta, scale).float()
            for name, (k, v) in pools.items()}
    keys_read = seqs * (context + 1)
    copies = {name: [(k, v)] + [(k.clone(), v.clone()) for _ in range(copies_beyond_l2(k.nbytes * 2, device) - 1)]
              for name, (k, v) in pools.items()}
    results = []
    for variant in variants:
        k, v = pools[variant.cache]
        attention = TritonPagedAttention(block_n=variant.block_n, num_warps=variant.num_warps,
                                         num_stages=variant.num_stages, num_splits=variant.num_splits)
        got = attention(q, k, v, meta, scale).float()
        error = (got - want[variant.cache]).abs().max().item()
        turn = [0]

        def launch(pools=copies[variant.cache]):
            k_i, v_i = pools[turn[0] % len(pools)]
            turn[0] += 1
            attention(q, k_i, v_i, meta, scale)

        us = graph_us(launch, iters)
        results.append(Result(variant, us, 2 * keys_read * kv_heads * head_dim * k.element_size(), error))
    return results


def copies_beyond_l2(pool_bytes: int, device: torch.device, l2_bytes: int = 50 * 2**20) -> int:
    """How many copies of a pool of `pool_bytes` to take turns over so that none is still in an
    H200's L2 (~50 MB) when its turn comes again: together at least 4x the L2 (1 off CUDA)."""
    if device.type != "cuda":
        return 1
    return max(1, min(32, -(-4 * l2_bytes // pool_bytes)))


def report(results: list[Result], seqs: int, context: int) -> str:
    """One line per variant: us a launch, MB read, GB/s, max error and time against the first."""
    base = results[0].us
    lines = [f"decode attention, {seqs} sequences x {context} keys: cache,keys per tile,warps,stages"
             f"[,splits] (- = default)"]
    for r in results:
        lines.append(f"  {str(r.variant):<14} {r.us:9.1f} us  {r.bytes_read / 1e6:8.1f} MB  "
                     f"{r.bytes_read / r.us / 1e3:7.0f} GB/s  max err {r.max_error:.2e}  "
                     f"{r.us / base:5.2f}x the first")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[88, 44])
    ap.add_argument("--context", type=int, nargs="+", default=[250, 400, 1000])
    ap.add_argument("--variants", default=DEFAULT_VARIANTS,
                    help="space-separated cache,keys per tile,warps,stages[,splits] ('-' for a default)")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--quick", action="store_true", help="a tiny shape, a few launches (any device)")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    variants = [Variant.parse(t) for t in args.variants.split()]
    heads, kv_heads, head_dim, block_size = 32, 8, 128, 16
    if args.quick:
        args.seqs, args.context, args.iters = [3], [40], 2
        heads, kv_heads, head_dim, block_size = 4, 2, 32, 4
    for seqs in args.seqs:
        for context in args.context:
            results = run(seqs, context, heads, kv_heads, head_dim, block_size, variants, args.iters, device)
            print(report(results, seqs, context), flush=True)


if __name__ == "__main__":
    main()
