"""Linear layers whose few-row products run in the rows kernel (`talker.rows_matmul`).

`RowsLinear` is an `nn.Linear` (the same weight and bias, the same state dict) whose forward
sends at most `rows_matmul.MAX_ROWS` (16) rows on CUDA through `rows_matmul.rows_mm` (every row
in one tile, the weights read once, the inputs split when the channels are few) and anything
else, more rows or the CPU, through `F.linear` as before. `use_rows_kernel(module, names)`
swaps the named linears of a module after loading (and after `fuse_projections`, whose stacked
linears it then swaps).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from stages.runtime.linears import replace_linears


class RowsLinear(nn.Linear):
    """y [..., out] = x [..., in] @ W^T (+ b): few rows on CUDA through the rows kernel."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # the Triton kernel: imported when a rows layer is made, not with the model, so a process
        # that serves without it never imports Triton (tests choose its CPU interpreter first)
        from stages.runtime import rows_matmul

        self.kernels = rows_matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)  # [M, in]
        if not x.is_cuda or x2.shape[0] > self.kernels.MAX_ROWS:
            return F.linear(x, self.weight, self.bias)
        y = self.kernels.rows_mm(x2.contiguous(), self.weight, self.bias)  # [M, out]
        return y.reshape(*x.shape[:-1], self.out_features)


def as_rows(linear: nn.Module) -> RowsLinear:
    """The `RowsLinear` of an `nn.Linear`, sharing its parameters (others are refused: a float8 or
    tensor-parallel linear has its own forward)."""
    if type(linear) is not nn.Linear:
        raise TypeError(f"the rows kernel replaces nn.Linear layers, not {type(linear).__name__}")
    rows = RowsLinear(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
    rows.weight, rows.bias = linear.weight, linear.bias
    return rows


def use_rows_kernel(module: nn.Module, names: Iterable[str]) -> int:
    """Replace every submodule of `module` whose own name is in `names` by its `RowsLinear`;
    returns how many were replaced."""
    return replace_linears(module, names, as_rows, RowsLinear)
