"""Batch-invariant kernels: a request's numbers do not depend on which other rows share its batch.

On a GPU the library kernels behind a talker step pick their strategy from the shapes of the
whole batch: a matmul's tile sizes and split-K come from M (the number of rows), a row reduction
may be split over several thread blocks when there are few rows, a compiled kernel is specialised
for one row. Each strategy sums in its own order, so row i of `x @ W^T` moves by a rounding step
when the batch grows, and the sampler flips a near-tie: the same seed gives different speech under
different load. The remedy is to make every reduction of the per-step path sum a row in an order
fixed by the row's own length alone:

* `BatchInvariantKernels.linear`: a Triton matmul with one tile configuration for every call (no
  split-K; tiles fixed at construction, never chosen from M). Output row i is a function of input
  row i and the weight: the K loop runs in the same order whatever M is, and other rows of a tile
  never enter row i's sums.
* `rms_norm` / `layer_norm`: one program per row, the whole row in one block.
* `cumsum` / `sum` over one dimension of floating tensors (the sampler's top-p scan, summed
  embeddings): one program per row, fixed chunks in a fixed order.
* `attention`: the small dense attention of a local/depth loop (`F.scaled_dot_product_attention`
  over at most a few dozen keys): one program per (batch, head, query).
* The paged attention of the backbone is `stages.runtime.attention.triton_paged.TritonPagedAttention`
  with one split and decode rows run as prefill tiles (`invariant_attention`).

Installation: `BatchInvariantKernels.mode()` returns a `torch.overrides.TorchFunctionMode` that
routes `F.linear`, `F.layer_norm`, `F.scaled_dot_product_attention`, `torch.einsum` of a
linear-head form, floating `cumsum`/`sum` over one dimension, and `rms_norm` (this module's
overridable RMSNorm, which the Qwen3 backbone calls) to these kernels, for tensors on a CUDA device
(or on CPU under Triton's interpreter, `TRITON_INTERPRET=1`, for tests). A talker runner built with
`batch_invariant=True` holds one `BatchInvariantKernels` and enters a fresh mode around each step
and graph capture; nothing is global, and outside the mode every call is torch's own.

What is guaranteed, and what is not:
* Integer ops, gathers, sorts, top-k selection and elementwise ops are exact per element already.
* Inside CUDA graphs the kernels recorded are these; replays reuse them. Launch configurations
  depend on shapes only (graph-capturable), and no kernel reads a device value on the host.
* torch.compile is not used in this mode (a compiled graph chooses its own reduction kernels and
  is specialised for a batch of one): the runner factory leaves it off.
* Tensor parallelism is excluded (an all-reduce's algorithm may change with the message size).
* Bit-identity across batch compositions holds on one device, one build, one tile configuration;
  results equal the default path only up to rounding (different summation order).
* A call the mode does not recognise (an einsum of another form, SDPA with a float mask) runs
  torch's kernel unchanged: a new model's per-step path has to be checked against this list.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode, handle_torch_function, has_torch_function_variadic


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] -> weight * (x / rms(x)), the normalisation in fp32, the result in x's dtype
    before the weight multiplies it. Overridable by a `TorchFunctionMode` (the batch-invariant
    mode runs it per row in Triton); plain torch ops otherwise, so the default path is unchanged."""
    if has_torch_function_variadic(x, weight):
        return handle_torch_function(rms_norm, (x, weight), x, weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def batch_invariant_supported(device: torch.device | str) -> bool:
    """Whether the mode's Triton kernels can run on `device` (`triton_runs_on`)."""
    return triton_runs_on(device)


def triton_runs_on(device: torch.device | str) -> bool:
    """Whether Triton kernels can run on `device`: CUDA with triton importable, or CPU under
    Triton's interpreter (tests)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    kind = torch.device(device).type
    return kind == "cuda" or (kind == "cpu" and _interpreting())


def invariant_attention():
    """The paged attention of the mode: Triton, one decode split (no split-K that changes with the
    batch), decode rows computed by the prefill tile program (same tile shape, same key order)."""
    from stages.runtime.attention.triton_paged import TritonPagedAttention

    return TritonPagedAttention(num_splits=1, decode_as_prefill=True)


@dataclass(frozen=True)
class MatmulTiles:
    """The one tile configuration of `BatchInvariantKernels.linear` (never chosen from M)."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


class BatchInvariantKernels:
    """The batch-invariant kernels with their fixed configuration; `mode()` installs them."""

    def __init__(self, tiles: MatmulTiles = MatmulTiles(), *, row_block: int = 1024) -> None:
        """`tiles`: the matmul's tile configuration. `row_block`: chunk of the row scans and sums
        (a power of two)."""
        if row_block & (row_block - 1):
            raise ValueError(f"row_block must be a power of two, got {row_block}")
        self.tiles, self.row_block = tiles, row_block
        self._cpu_ok = _interpreting()

    def handles(self, *tensors: torch.Tensor) -> bool:
        """Whether these tensors are where the kernels run (CUDA, or CPU under the interpreter)."""
        return all(t.is_cuda or (self._cpu_ok and t.device.type == "cpu") for t in tensors)

    def mode(self) -> BatchInvariantMode:
        """A fresh context manager routing the per-step reductions to these kernels."""
        return BatchInvariantMode(self)

    # ---- kernels --------------------------------------------------------------------------------

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] @ weight[N, K]^T (+ bias [N]) -> [..., N] in x's dtype, fp32 accumulation."""
        from stages.runtime import batch_invariant_kernels as k

        lead, K = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, K)  # [M, K]
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        out = torch.empty(x2.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)  # [M, N]
        k.matmul(x2, weight, bias, out, self.tiles)
        return out.view(*lead, weight.shape[0])

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """`rms_norm`, one Triton program per row of x [..., D]."""
        from stages.runtime import batch_invariant_kernels as k

        return k.row_norm(x, weight, None, eps, rms=True, out_dtype=torch.promote_types(x.dtype, weight.dtype))

    def layer_norm(self, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                   eps: float) -> torch.Tensor:
        """`F.layer_norm` over the last dimension of x [..., D], one Triton program per row."""
        from stages.runtime import batch_invariant_kernels as k

        return k.row_norm(x, weight, bias, eps, rms=False, out_dtype=x.dtype)

    def cumsum(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Inclusive scan of floating x along `dim`, per row in fixed chunks."""
        from stages.runtime import batch_invariant_kernels as k

        return k.row_reduce(x, dim, scan=True, block=self.row_block, keepdim=True)

    def sum(self, x: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
        """Sum of floating x over `dim`, per output element in fixed chunks (fp32 accumulation)."""
        from stages.runtime import batch_invariant_kernels as k

        return k.row_reduce(x, dim, scan=False, block=self.row_block, keepdim=keepdim)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                  is_causal: bool, scale: float | None) -> torch.Tensor:
        """Dense attention q [B, H, Q, D], k/v [B, H, L, D], bool mask broadcastable to
        [B, H, Q, L] -> [B, H, Q, D]; one program per (b, h, query), fp32 softmax."""
        from stages.runtime import batch_invariant_kernels as kern

        return kern.dense_attention(q, k, v, mask, is_causal, q.shape[-1] ** -0.5 if scale is None else scale)


def _linear_head_equation(equation: str) -> str | None:
    """For `...h,XYh->...XY` (contract the last dim of both, the second without ellipsis), the
    output letters XY; else None."""
    eq = equation.replace(" ", "")
    try:
        ins, out = eq.split("->")
        a, b = ins.split(",")
    except ValueError:
        return None
    if not a.startswith("...") or len(a) != 4 or "." in b or len(b) < 2:
        return None
    h = a[3]
    if b[-1] != h or h in b[:-1] or out != "..." + b[:-1]:
        return None
    return b[:-1]


class BatchInvariantMode(TorchFunctionMode):
    """Routes the per-step reductions to `BatchInvariantKernels` while active (see module doc)."""

    def __init__(self, kernels: BatchInvariantKernels) -> None:
        super().__init__()
        self.kernels = kernels

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        found = self._route(func, args, kwargs)
        return func(*args, **kwargs) if found is None else found

    def _route(self, func, args, kwargs):
        """The batch-invariant result of `func(*args, **kwargs)`, or None to run torch's."""
        kern = self.kernels
        if func is F.linear:
            x, w = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            if x.is_floating_point() and x.dtype == w.dtype and kern.handles(x, w):
                return kern.linear(x, w, b)
        elif func is rms_norm:
            x, w, eps = args
            if kern.handles(x, w):
                return kern.rms_norm(x, w, eps)
        elif func is F.layer_norm:
            x, shape = args[0], args[1]
            w = args[2] if len(args) > 2 else kwargs.get("weight")
            b = args[3] if len(args) > 3 else kwargs.get("bias")
            eps = args[4] if len(args) > 4 else kwargs.get("eps", 1e-5)
            if len(shape) == 1 and kern.handles(x):
                return kern.layer_norm(x, w, b, eps)
        elif func is F.scaled_dot_product_attention:
            return self._sdpa(args, kwargs)
        elif func is torch.einsum:
            return self._einsum(args)
        elif func in (torch.cumsum, torch.Tensor.cumsum):
            x = args[0]
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            if x.is_floating_point() and kwargs.get("dtype") is None and kern.handles(x):
                return kern.cumsum(x, dim)
        elif func in (torch.sum, torch.Tensor.sum):
            x = args[0]
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
            if isinstance(dim, (tuple, list)) and len(dim) == 1:
                dim = dim[0]
            if isinstance(dim, int) and x.is_floating_point() and kwargs.get("dtype") is None and kern.handles(x):
                return kern.sum(x, dim, keepdim)
        return None

    def _sdpa(self, args, kwargs):
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        a = dict(zip(names, args), **kwargs)
        q, k, v, mask = a["query"], a["key"], a["value"], a.get("attn_mask")
        if (q.dim() != 4 or k.shape[1] != q.shape[1] or a.get("dropout_p", 0.0) or a.get("enable_gqa")
                or (mask is not None and mask.dtype != torch.bool) or not self.kernels.handles(q, k, v)):
            return None
        return self.kernels.attention(q, k, v, mask, bool(a.get("is_causal", False)), a.get("scale"))

    def _einsum(self, args):
        if len(args) != 3 or not isinstance(args[0], str):
            return None
        letters = _linear_head_equation(args[0])
        x, w = args[1], args[2]
        if letters is None or not isinstance(w, torch.Tensor) or x.dtype != w.dtype \
                or not self.kernels.handles(x, w):
            return None
        out = self.kernels.linear(x, w.reshape(-1, w.shape[-1]))  # [..., prod(w.shape[:-1])]
        return out.view(*x.shape[:-1], *w.shape[:-1])
