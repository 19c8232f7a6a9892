"""A CUDA op checked the three ways the talker runs it: eagerly, compiled, and replayed from a graph."""

from collections.abc import Callable

import torch


def eager_compiled_and_replayed(op: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                                after_negation: Callable[[torch.Tensor, torch.Tensor], None]) -> torch.Tensor:
    """`op(x)` eagerly; torch.compile of `op(x) * 2` (dynamic) within bf16's rounding of twice
    it; then a CUDA graph of `op(x)` replayed after x is negated in place, its output passed to
    `after_negation(out, eager)` to assert on. Returns the eager output."""
    eager = op(x)
    compiled = torch.compile(lambda a: op(a) * 2.0, dynamic=True)(x)
    torch.testing.assert_close(compiled, eager * 2.0, rtol=1e-2, atol=1e-2)
    graph, out = torch.cuda.CUDAGraph(), None
    op(x)  # warm: the kernel compiled before capture
    with torch.cuda.graph(graph):
        out = op(x)
    x.copy_(x * -1.0)
    graph.replay()
    after_negation(out, eager)
    return eager
