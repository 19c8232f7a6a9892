"""`stages.runtime.sampling` before the candidate path (the reference the tests and this benchmark compare
against) and a micro-benchmark of `sample_tokens`.

    python -m bench.kernels.sampling [--device cuda] [--iters 200]

prints ms per call of the legacy sampler, the full path and the candidate path at B = 1, 64, 256,
V = 1024 (default audio parameters, repetition penalty on), eager and, on CUDA, replayed from a
CUDA graph; before timing it checks on the device that the candidate path draws the full path's
tokens and that the noise equals the legacy hash.
"""

from __future__ import annotations

import argparse
import time

import torch

from speech.sampling import SamplingParams
from stages.runtime.sampling import K_CAP, RowSampling, SamplingSlots, sample_tokens

# ---------------------------------------------------------------- the legacy sampler, verbatim


def top_k_filter(scores: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Mask scores below the k-th largest of each row; rows with k <= 0 or k >= V are untouched."""
    vocab = scores.shape[-1]
    active = (top_k > 0) & (top_k < vocab)  # [B]
    k = top_k.clamp(1, vocab).long()
    kth = scores.sort(dim=-1, descending=True).values.gather(-1, (k - 1)[:, None])  # [B, 1]
    kth = torch.where(active[:, None], kth, torch.full_like(kth, -torch.inf))
    return scores.masked_fill(scores < kth, -torch.inf)


def top_p_filter(scores: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Nucleus filter of each row; rows with p <= 0 or p >= 1 are untouched."""
    active = (top_p > 0) & (top_p < 1)  # [B]
    sorted_scores, order = scores.sort(dim=-1, descending=True)
    cumulative = sorted_scores.softmax(-1).cumsum(-1)  # [B, V]
    remove_sorted = cumulative > top_p.to(cumulative.dtype)[:, None]
    remove_sorted = torch.cat([torch.zeros_like(remove_sorted[:, :1]), remove_sorted[:, :-1]], dim=-1)
    remove_sorted &= active[:, None]
    remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
    return scores.masked_fill(remove, -torch.inf)


_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def legacy_noise(seed: torch.Tensor, frame: torch.Tensor, stream: int, vocab: int) -> torch.Tensor:
    seed = seed.long()
    key = _mix32(seed & _MASK32)
    key = _mix32(key ^ ((seed >> 32) & _MASK32))
    key = _mix32(key ^ (frame.long() & _MASK32))
    key = _mix32(key ^ (stream & _MASK32))  # [B]
    index = torch.arange(vocab, device=seed.device, dtype=torch.long)
    h = _mix32(_mix32(key[:, None] ^ index[None, :]))  # [B, V]
    uniform = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # (0, 1), 24 exact bits
    return -torch.log(uniform)


def legacy_sample_tokens(logits, rows: RowSampling, frame, stream: int, seen=None, *,
                         zero_noise_fix: bool = True) -> torch.Tensor:
    """The legacy sampler. `zero_noise_fix`: a filtered entry whose noise is -0.0 (U rounded to 1,
    2**-24 per entry) scored 0 / -0.0 = NaN, and argmax picks NaN: the legacy code drew a token
    outside top-k / top-p about once in 6e4 draws at V = 1024. The fix scores it -inf instead."""
    scores = logits.float()
    if seen is not None:
        p = rows.repetition_penalty.to(scores.dtype)[:, None]
        scores = torch.where(seen, torch.where(scores < 0, scores * p, scores / p), scores)
    greedy_tokens = scores.argmax(-1)
    greedy = rows.greedy | (rows.temperature <= 0)
    scores = scores / rows.temperature.clamp_min(1e-6)[:, None]
    scores = top_p_filter(top_k_filter(scores, rows.top_k), rows.top_p)
    probs = scores.softmax(-1)
    noise = legacy_noise(rows.seed, frame, stream, scores.shape[-1])
    ratio = probs / noise
    if zero_noise_fix:
        ratio = torch.where(probs > 0, ratio, -torch.inf)
    sampled = ratio.argmax(-1)
    return torch.where(greedy, greedy_tokens, sampled)


# ---------------------------------------------------------------- benchmark


def _inputs(batch: int, vocab: int, device: str, dtype: torch.dtype):
    g = torch.Generator().manual_seed(batch)
    slots = SamplingSlots(batch, device)
    for i in range(batch):
        slots.write(i, SamplingParams(seed=i, repetition_penalty=1.1 if i % 2 else 1.0))
    logits = (torch.randn(batch, vocab, generator=g) * 3).to(device, dtype)
    seen = (torch.rand(batch, vocab, generator=g) < 0.05).to(device)
    frame = torch.arange(batch, device=device) * 7
    return logits, slots.rows(torch.arange(batch, device=device)), frame, seen


def check(device: str, vocab: int = 1024, batch: int = 256, frames: int = 20) -> None:
    """Candidate path == full path == legacy with the zero-noise fix (random float32 logits), and
    noise == legacy noise."""
    logits, rows, frame, seen = _inputs(batch, vocab, device, torch.float32)
    for f in range(frames):
        x = logits.roll(f, dims=-1)
        ref = legacy_sample_tokens(x, rows, frame + f, 3, seen)
        full = sample_tokens(x, rows, frame + f, 3, seen)
        cand = sample_tokens(x, rows, frame + f, 3, seen, candidates=True)
        assert torch.equal(full, cand) and torch.equal(full, ref), f"frame {f}: paths disagree"
    from stages.runtime.sampling import exponential_noise

    seed = torch.randint(-(2**62), 2**62, (batch,), device=device)
    assert torch.equal(exponential_noise(seed, frame, 5, vocab), legacy_noise(seed, frame, 5, vocab))
    print(f"check ok on {device}: candidate == full == legacy tokens, noise == legacy noise")


def _time(fn, iters: int, device: str) -> float:
    for _ in range(3):
        fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters * 1e3


def _graphed(fn, device: str):
    if not device.startswith("cuda"):
        return None
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def bench(device: str = "cpu", iters: int = 50, vocab: int = 1024, dtype: torch.dtype = torch.float32) -> None:
    print(f"sample_tokens, V={vocab}, K_CAP={K_CAP}, {dtype}, {device}: ms per call (eager / graph replay)")
    for batch in (1, 64, 256):
        logits, rows, frame, seen = _inputs(batch, vocab, device, dtype)
        paths = {
            "legacy": lambda: legacy_sample_tokens(logits, rows, frame, 3, seen),
            "full": lambda: sample_tokens(logits, rows, frame, 3, seen),
            "candidates": lambda: sample_tokens(logits, rows, frame, 3, seen, candidates=True),
            "candidates, no penalty": lambda: sample_tokens(logits, rows, frame, 3, candidates=True),
        }
        for name, fn in paths.items():
            with torch.inference_mode():
                eager = _time(fn, iters, device)
                replay = _graphed(fn, device)
                graph = f" / {_time(replay, iters * 4, device):7.3f}" if replay else ""
            print(f"  B={batch:4d} {name:24s} {eager:7.3f}{graph}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    with torch.inference_mode():
        check(args.device)
    bench(args.device, args.iters)
    bench(args.device, args.iters, dtype=torch.bfloat16)


if __name__ == "__main__":
    main()
