"""The batch-invariant kernels: right (against float64 references) and invariant (a row's result is
bit-identical whatever other rows share the call), and the mode routes the per-step calls to them.

Without a CUDA device the kernels run on CPU tensors through Triton's interpreter:
TRITON_INTERPRET=1 has to be set before triton itself is imported, so this module sets it first
thing when there is no CUDA device. Tiny shapes only: the interpreter runs every program in numpy.
"""

import torch

from tests import triton_cpu  # noqa: E402, F401  (before triton: its CPU interpreter)

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytest.importorskip("triton")

from stages.runtime.batch_invariant import (BatchInvariantKernels, MatmulTiles, _linear_head_equation,  # noqa: E402
                                            rms_norm)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# small tiles on CPU (the interpreter's cost grows with the tile), the serving tiles on a GPU
KERNELS = BatchInvariantKernels(MatmulTiles(16, 16, 16) if DEVICE == "cpu" else MatmulTiles(), row_block=16)
ROWS = (1, 3, 17, 64)


def _rows(m: int, k: int, seed: int = 0) -> torch.Tensor:
    """The first m rows of one fixed [64, k] matrix: row i is the same data in every call."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(64, k, generator=g)[:m].to(DEVICE)


@pytest.mark.parametrize("k, n, bias", [(40, 24, False), (16, 33, True)])
def test_linear_matches_float64_and_rows_are_batch_invariant(k, n, bias):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(n, k, generator=g).to(DEVICE)  # [N, K]
    b = torch.randn(n, generator=g).to(DEVICE) if bias else None
    outs = {}
    for m in ROWS:
        x = _rows(m, k)  # [m, K]
        y = KERNELS.linear(x, w, b)  # [m, N]
        ref = x.double() @ w.double().T + (b.double() if bias else 0)
        torch.testing.assert_close(y.double(), ref, atol=1e-4, rtol=1e-4)
        outs[m] = y
    for m in ROWS:  # row i bit-identical in every product that holds it
        assert torch.equal(outs[m], outs[64][:m]), f"rows of the {m}-row product differ from the 64-row one"


def test_linear_keeps_leading_dims_and_dtype():
    x = _rows(6, 16).view(2, 3, 16)
    w = _rows(5, 16, seed=3)
    y = KERNELS.linear(x, w)
    assert y.shape == (2, 3, 5) and y.dtype == x.dtype
    torch.testing.assert_close(y, F.linear(x, w), atol=1e-4, rtol=1e-4)


def test_norms_match_torch_and_are_per_row():
    w = _rows(1, 24, seed=4)[0]
    b = _rows(1, 24, seed=5)[0]
    x = _rows(17, 24) * 3 + 1  # [17, 24]
    torch.testing.assert_close(KERNELS.rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(KERNELS.layer_norm(x, w, b, 1e-5), F.layer_norm(x, (24,), w, b, 1e-5),
                               atol=1e-5, rtol=1e-5)
    for m in (1, 3):
        assert torch.equal(KERNELS.rms_norm(x[:m], w, 1e-6), KERNELS.rms_norm(x, w, 1e-6)[:m])
        assert torch.equal(KERNELS.layer_norm(x[:m], w, b, 1e-5), KERNELS.layer_norm(x, w, b, 1e-5)[:m])


def test_scans_and_sums_match_torch_over_several_chunks():
    x = _rows(5, 40).abs()  # 40 columns: three chunks of 16
    torch.testing.assert_close(KERNELS.cumsum(x, -1), x.cumsum(-1), atol=1e-5, rtol=1e-5)
    assert torch.equal(KERNELS.cumsum(x[:1], -1), KERNELS.cumsum(x, -1)[:1])
    y = _rows(12, 8).view(3, 4, 8)  # sum over the middle dimension, as summed embeddings are
    torch.testing.assert_close(KERNELS.sum(y, -2), y.sum(-2), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(KERNELS.sum(y, 1, keepdim=True), y.sum(1, keepdim=True), atol=1e-5, rtol=1e-5)
    assert torch.equal(KERNELS.sum(y[:1], -2), KERNELS.sum(y, -2)[:1])


@pytest.mark.parametrize("causal, masked", [(False, False), (True, False), (False, True)])
def test_dense_attention_matches_sdpa(causal, masked):
    q = _rows(2 * 3 * 4, 8).view(2, 3, 4, 8)  # [B, H, Q, D]
    k = _rows(2 * 3 * 5, 8, seed=6).view(2, 3, 5, 8)
    v = _rows(2 * 3 * 5, 8, seed=7).view(2, 3, 5, 8)
    mask = torch.tensor([[True, False, True, True, False]], device=DEVICE) if masked else None  # [1, L]
    got = KERNELS.attention(q, k, v, mask, causal, None)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(KERNELS.attention(q[:1], k[:1], v[:1], mask, causal, None), got[:1])


def test_the_mode_routes_the_step_calls_to_the_kernels(monkeypatch):
    """Every call the talkers' per-step path makes reaches a kernel inside the mode, and only then."""
    called = []
    for name in ("linear", "rms_norm", "layer_norm", "cumsum", "sum", "attention"):
        real = getattr(KERNELS, name)
        monkeypatch.setattr(KERNELS, name, lambda *a, _real=real, _name=name, **kw: called.append(_name) or _real(*a, **kw))
    x, w = _rows(3, 16), _rows(4, 16, seed=2)
    heads = _rows(6, 16, seed=3).view(2, 3, 16)

    def step_calls():
        F.linear(x, w)
        torch.nn.Linear(16, 4).to(DEVICE)(x)
        rms_norm(x, w[0], 1e-6)
        torch.nn.LayerNorm(16).to(DEVICE)(x)
        x.cumsum(-1)
        torch.cumsum(x, dim=1)
        x.view(3, 2, 8).sum(-2)
        torch.einsum("...h,krh->...kr", x, heads)
        q = x.view(1, 3, 1, 16)
        F.scaled_dot_product_attention(q, q, q)
        x.sum()  # no dimension: torch's
        x.long().cumsum(-1)  # integers are exact: torch's

    step_calls()
    assert called == []
    with KERNELS.mode():
        step_calls()
    assert called == ["linear", "linear", "rms_norm", "layer_norm", "cumsum", "cumsum", "sum", "linear", "attention"]


def test_linear_head_einsum_forms():
    assert _linear_head_equation("...h,krh->...kr") == "kr"
    assert _linear_head_equation("...h,vh->...v") == "v"
    assert _linear_head_equation("...h,krh->...rk") is None
    assert _linear_head_equation("bh,krh->bkr") is None
