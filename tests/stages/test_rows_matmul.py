"""The few-row matmul (`talker.rows_matmul`): the kernel's product at every row tile, input split
and bias, on the CPU through Triton's interpreter and on CUDA eagerly, compiled and replayed from
a graph; `RowsLinear` keeps its linear's parameters and sends only few CUDA rows to the kernel;
the talker swaps the named layers, from the profile too."""

import tests.triton_cpu  # noqa: F401  (first: Triton's interpreter without a GPU)

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from profiles import ProfileError, load_profile
from stages.models.local_v15.config import tiny_config
from stages.models.local_v15.loader import build_talker_module
from stages.models.local_v15.runner import load_talker_runner
from stages.runtime.fp8_linear import as_fp8
from stages.runtime.rows_linear import RowsLinear, as_rows
from stages.runtime.rows_matmul import MAX_ROWS, MIN_SPLIT_K, TARGET_PROGRAMS, launch, plan, rows_mm
from tests.stages.cuda_op_check import eager_compiled_and_replayed


def _operands(m, n, k, dtype, bias, device="cpu"):
    g = torch.Generator().manual_seed(m * 7 + n + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) * k ** -0.5
    b = torch.randn(n, generator=g) if bias else None
    want = F.linear(x.double(), w.double(), None if b is None else b.double())  # [m, n]
    move = lambda t: None if t is None else t.to(device=device, dtype=dtype)  # noqa: E731
    return move(x), move(w), move(b), want.to(device)


def _rel(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("m,n,k", [
    (1, 64, 256),      # one row, one tile
    (5, 96, 1024),     # channels not a multiple of the tile, inputs split
    (16, 48, 2048),    # a full row tile, split 4 ways
    (9, 200, 384),     # inputs not a multiple of the input tile
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_the_kernel_multiplies_x_by_the_weights_and_adds_the_bias_once(m, n, k, dtype, bias):
    x, w, b, want = _operands(m, n, k, dtype, bias)
    got = rows_mm(x, w, b)
    assert got.shape == (m, n) and got.dtype == dtype
    assert _rel(got, want) < (1e-6 if dtype == torch.float32 else 8e-3)  # bf16: the output's rounding


@pytest.mark.parametrize("m", [33, 100])
def test_launched_with_larger_row_tiles_the_kernel_takes_more_rows(m):
    """64- and 128-row tiles (the bench's sweep at 48 and 88 rows), split or not; rows_mm itself
    refuses more than MAX_ROWS rows."""
    x, w, b, want = _operands(m, 80, 512, torch.float32, True)
    block_m = 64 if m <= 64 else 128
    for split in (1, 2):
        assert _rel(launch(x, w, b, (block_m, 64, 128, split, 4, 3)), want) < 1e-6
    with pytest.raises(ValueError, match="at most"):
        rows_mm(x, w, b)


def test_every_launch_configuration_the_bench_sweeps_gives_the_same_product():
    """Tiles of 32-128 channels and 64-256 inputs, 1-8 input splits (the bias in the first
    split's partials only), a row tile larger than the rows: any may become `plan`'s choice
    after a GPU sweep (`bench.rows_matmul`)."""
    x, w, b, want = _operands(7, 96, 1024, torch.float32, True)
    for block_m in (16, 64):
        for block_n in (32, 64, 128):
            for block_k in (64, 128, 256):
                for split in (1, 2, 4, 8):
                    config = (block_m, block_n, block_k, split, 4, 3)
                    assert _rel(launch(x, w, b, config), want) < 1e-6, config
    partials = launch(x, w, b, (16, 64, 128, 4, 4, 3), partials=True)
    assert partials.shape == (4, 7, 96) and partials.dtype == torch.float32
    assert _rel(partials.sum(0), want) < 1e-6
    with pytest.raises(ValueError, match="do not fit"):
        launch(x, w, b, (4, 64, 128, 1, 4, 3))


def test_the_plan_holds_every_row_in_one_tile_and_splits_only_when_the_channels_are_few():
    """The talker's decode shapes at few rows, as the sweep found best at 8: gate/up (19456
    channels) unsplit, the others split, never below MIN_SPLIT_K a split or past TARGET_PROGRAMS
    programs, the most (8 ways) for 2560 channels."""
    assert plan(8, 19456, 2560)[3] == 1
    for n, k in ((6144, 2560), (7680, 2560), (9728, 2560), (2560, 4096), (2560, 9728), (2560, 2560)):
        block_m, block_n, _, split, _, _ = plan(8, n, k)
        assert split > 1 and k // split >= MIN_SPLIT_K and -(-n // block_n) * split <= TARGET_PROGRAMS, (n, k)
    assert plan(1, 2560, 4096) == plan(MAX_ROWS, 2560, 4096) == (16, 64, 64, 8, 4, 5)
    with pytest.raises(ValueError, match="at most"):
        plan(MAX_ROWS + 1, 2560, 4096)


def test_a_rows_linear_keeps_its_linears_parameters_and_refuses_other_layers():
    """The same weight and bias tensors and state dict as the linear it replaces; on the CPU its
    product is the linear's; float8 layers (their own kernel) are refused."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    rows = as_rows(linear)
    assert isinstance(rows, RowsLinear) and rows.weight is linear.weight and rows.bias is linear.bias
    assert rows.state_dict().keys() == linear.state_dict().keys()
    x = torch.randn(3, 5, 64)
    torch.testing.assert_close(rows(x), linear(x), rtol=0, atol=0)
    with pytest.raises(TypeError, match="nn.Linear"):
        as_rows(as_fp8(nn.Linear(64, 48)))


def test_the_talker_swaps_the_named_matmuls_only_and_the_profile_asks_for_it(local_v15_dir):
    """backbone: the seven projections of each Qwen3 layer (four when fused); all: the local
    block's four too; heads stay plain linears. The profile's `talker.rows_matmul` swaps the
    fused projections of a runner; with float8 weights it is refused."""
    model = build_talker_module(tiny_config()).eval()
    layers = model.config.backbone.num_layers
    assert model.use_rows_matmul("none") == 0
    assert model.use_rows_matmul("backbone") == 7 * layers
    assert model.use_rows_matmul("all") == 4 * len(model.local_transformer.h)
    swapped = {n for n, m in model.named_modules() if isinstance(m, RowsLinear)}
    assert "transformer.layers.0.self_attn.q_proj" in swapped and "local_transformer.h.0.mlp.fc_in" in swapped
    assert type(model.local_text_lm_head) is nn.Linear
    with pytest.raises(ValueError, match="none, backbone or all"):
        model.use_rows_matmul("heads")
    runner = load_talker_runner(local_v15_dir, load_profile(
        "cpu", ["talker.rows_matmul=backbone", "talker.fused_projections=true"]), "cpu")
    layer = runner.model.transformer.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, RowsLinear) and isinstance(layer.mlp.gate_up_proj, RowsLinear)
    assert type(runner.model.local_transformer.h[0].mlp.fc_in) is nn.Linear
    with pytest.raises(ProfileError, match="rows_matmul"):
        load_profile("cpu", ["talker.rows_matmul=all", "talker.fp8_weights=backbone"])


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@cuda
@torch.no_grad()
def test_on_cuda_eager_compiled_and_replayed_alike():
    """The talker's decode shapes in bf16 on CUDA: within bf16's rounding, the same from
    torch.compile (which traces into the op and fuses the split sum) and from a CUDA graph;
    through a `RowsLinear`, more than MAX_ROWS rows are torch's product."""
    for m, n, k, bias in ((1, 6144, 2560, False), (16, 2560, 4096, False), (8, 19456, 2560, False),
                          (8, 2560, 9728, True), (3, 7680, 2560, True)):
        x, w, b, want = _operands(m, n, k, torch.bfloat16, bias, "cuda")
        eager = eager_compiled_and_replayed(
            lambda a: rows_mm(a, w, b), x,
            lambda out, _: torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-2, atol=1e-2))
        assert _rel(eager, want) < 8e-3, (m, n, k)
    linear = as_rows(nn.Linear(256, 128, device="cuda", dtype=torch.bfloat16))
    many = torch.randn(MAX_ROWS + 1, 256, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(linear(many), F.linear(many, linear.weight, linear.bias), rtol=0, atol=0)


@pytest.mark.gpu
@cuda
def test_inductor_compiled_talker_with_the_rows_kernel_matches_eager_on_cuda():
    """The rows kernel inside the compiled backbone halves and local loop: greedy requests
    through a runner emit the eager talker's codes (the same kernel in both)."""
    from tests.stages.test_talker_compile import _codes, _cuda_pair, assert_same_codes

    eager, compiled = _cuda_pair()
    assert eager.use_rows_matmul("all") == compiled.use_rows_matmul("all") > 0
    assert_same_codes(_codes(eager, greedy=True), _codes(compiled, greedy=True))
