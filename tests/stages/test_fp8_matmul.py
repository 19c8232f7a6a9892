"""The float8-weight matmul for few rows (`w8a16_mm`): the product of the dequantized operands at every row tile and input split, on the CPU through
Triton's interpreter and on CUDA eagerly, compiled and replayed from a graph."""

from tests import triton_cpu  # noqa: F401  (first: Triton's interpreter without a GPU)

import pytest
import torch

from stages.runtime.fp8_linear import quantize_rows
from stages.runtime.fp8_matmul import MIN_SPLIT_K, TARGET_PROGRAMS, launch, plan, w8a16_mm
from tests.stages.cuda_op_check import eager_compiled_and_replayed


def _operands(m, n, k, dtype, device="cpu"):
    g = torch.Generator().manual_seed(m * 7 + n + k)
    w_fp8, w_scale = quantize_rows(torch.randn(n, k, generator=g))  # [n, k], [n, 1]
    x = torch.randn(m, k, generator=g).to(dtype)
    want = x.double() @ (w_fp8.double() * w_scale.double()).t()  # [m, n]
    return x.to(device), w_fp8.to(device), w_scale.reshape(-1).to(device), want.to(device)


@pytest.mark.parametrize("m,n,k", [
    (1, 64, 256),      # one row, one tile
    (5, 96, 1024),     # channels not a multiple of the tile, inputs split 2+ ways
    (33, 48, 2048),    # a 64-row tile, split
    (100, 80, 512),    # a 128-row tile
    (150, 64, 192),    # two row tiles, inputs not a multiple of the input tile
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_multiplies_x_by_the_dequantized_weights(m, n, k, dtype):
    x, w, scale, want = _operands(m, n, k, dtype)
    got = w8a16_mm(x, w, scale)
    assert got.shape == (m, n) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 8e-3  # bf16: the output's rounding
    assert ((got.double() - want).norm() / want.norm()).item() < tol


def test_every_launch_configuration_the_bench_sweeps_gives_the_same_product():
    """Tiles of 32-256 channels and 64-256 inputs, 1-4 input splits, row tiles larger than the
    rows: any of them may become `plan`'s choice after a GPU sweep (`bench.kernels.fp8_matmul --sweep`)."""
    x, w, scale, want = _operands(7, 96, 768, torch.float32)
    for block_m in (16, 32):
        for block_n in (32, 64, 128, 256):
            for block_k in (64, 128, 256):
                for split in (1, 2, 4):
                    got = launch(x, w, scale, (block_m, block_n, block_k, split, 4, 3))
                    err = ((got.double() - want).norm() / want.norm()).item()
                    assert err < 1e-5, (block_m, block_n, block_k, split, err)


def test_the_plan_splits_the_inputs_only_when_the_channels_are_few():
    """Decode-step shapes of the 4B backbone at 88 rows: gate/up (19456 channels) fills the GPU
    unsplit, o_proj and down_proj (2560 channels) split their inputs, never below MIN_SPLIT_K
    inputs a split or past TARGET_PROGRAMS programs; every row of a decode step in one tile."""
    block_m, block_n, _, split, _, _ = plan(88, 19456, 2560)
    assert (block_m, split) == (128, 1)
    for n, k in ((2560, 4096), (2560, 9728), (6144, 2560)):
        block_m, block_n, _, split, _, _ = plan(88, n, k)
        programs = -(-n // block_n) * split
        assert split > 1 and k // split >= MIN_SPLIT_K and programs <= TARGET_PROGRAMS, (n, k, split)
    assert plan(1, 2560, 4096)[0] == 16
    assert plan(300, 2560, 4096) == (128, 128, 64, 1, 8, 3)  # a prefill: a GEMM's tiles, no split


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@cuda
@torch.no_grad()
def test_on_cuda_eager_compiled_and_replayed_alike():
    """The backbone's decode shapes in bf16 on CUDA: the product within bf16's rounding, the same
    from torch.compile (which traces into the op and fuses the split sum) and from a CUDA graph."""
    for m, n, k in ((1, 6144, 2560), (44, 2560, 4096), (88, 19456, 2560), (88, 2560, 9728), (300, 2560, 9728)):
        x, w, scale, want = _operands(m, n, k, torch.bfloat16, "cuda")
        eager = eager_compiled_and_replayed(
            lambda a: w8a16_mm(a, w, scale), x,
            lambda out, eager: torch.testing.assert_close(out, -eager, rtol=0, atol=0))
        assert ((eager.double() - want).norm() / want.norm()).item() < 8e-3, (m, n, k)
