"""The local attention kernel alone (`talker.local_attention: kernel`), by rows, position and
heads a program, against the plain steps' attention compiled (full-size local block shapes:
32 heads of 80, random bf16 projections).

    python -m bench.kernels.local_attend [--rows 48 88] [--heads 1 2 4 8] [--iters 50]

Per row count (each launch timed from CUDA graph replays): each heads-a-program setting's
microseconds at positions 1, 4, 8 and 12 (keys so far) and summed over a frame's 12 positions; then the same 12 positions through the plain
attention as the compiled local loop runs it (torch.compile of the products, softmax and sums
of `LocalAttention.step` after the input projection), summed. CUDA only.
"""

from __future__ import annotations

import argparse

import torch

from bench.kernels.timing import graph_us
from stages.models.local_v15.local_attend import local_attend
from stages.models.local_v15.model import apply_rope_interleaved, rope_interleaved_tables

HEADS, DIM, POSITIONS = 32, 80, 12


def _plain(q_src: torch.Tensor, qkvs: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`LocalAttention.step`'s plain attention from the projections: [B, 3H] each -> [B, H]."""
    B, H = q_src.shape[0], HEADS * DIM
    p = len(qkvs) - 1
    q = apply_rope_interleaved(q_src[:, :H].view(B, HEADS, DIM), cos[p], sin[p]).float()
    keys = [apply_rope_interleaved(t[:, H: 2 * H].view(B, HEADS, DIM), cos[j], sin[j]) for j, t in enumerate(qkvs)]
    scores = torch.stack([(q * k.float()).sum(-1) for k in keys], dim=1) * DIM ** -0.5  # [B, P, heads]
    weights = scores.softmax(dim=1)
    o = weights[:, 0, :, None] * qkvs[0][:, 2 * H:].view(B, HEADS, DIM).float()
    for j in range(1, len(qkvs)):
        o = o + weights[:, j, :, None] * qkvs[j][:, 2 * H:].view(B, HEADS, DIM).float()
    return o.to(q_src.dtype).reshape(B, H)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[48, 88])
    ap.add_argument("--heads", type=int, nargs="+", default=[1, 2, 4, 8], help="heads a program")
    ap.add_argument("--iters", type=int, default=50, help="launches a CUDA graph times")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    cos, sin = rope_interleaved_tables(torch.arange(POSITIONS, device="cuda"), DIM, 1e6, torch.bfloat16)
    plain = torch.compile(_plain, dynamic=False)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * POSITIONS)  # one a position
    print(f"{torch.cuda.get_device_name()}: local attention, {HEADS} heads of {DIM}, bf16, us a launch")
    for rows in args.rows:
        qkvs = [torch.randn(rows, 3 * HEADS * DIM, device="cuda", dtype=torch.bfloat16) for _ in range(POSITIONS)]
        for heads in args.heads:
            us = [graph_us(lambda p=p: local_attend(qkvs[:p], HEADS, 1e6, heads), args.iters)
                  for p in range(1, POSITIONS + 1)]
            print(f"rows {rows:4d}  kernel, {heads:2d} heads a program: positions 1/4/8/12 "
                  f"{us[0]:6.2f} {us[3]:6.2f} {us[7]:6.2f} {us[11]:6.2f} us, a frame {sum(us):7.1f} us")
        us = [graph_us(lambda p=p: plain(qkvs[p - 1], qkvs[:p], cos, sin), args.iters) for p in range(1, POSITIONS + 1)]
        print(f"rows {rows:4d}  plain, compiled:            positions 1/4/8/12 "
              f"{us[0]:6.2f} {us[3]:6.2f} {us[7]:6.2f} {us[11]:6.2f} us, a frame {sum(us):7.1f} us")
        want = plain(qkvs[-1], qkvs, cos, sin).float()
        got = local_attend(qkvs, HEADS, 1e6).float()
        print(f"rows {rows:4d}  kernel against plain at position 12: max |diff| {(got - want).abs().max().item():.4f} "
              f"(values up to {want.abs().max().item():.2f})")


if __name__ == "__main__":
    main()
