"""`talker.local_attention: kernel`: a local position's attention in one Triton kernel
(`stages.models.local_v15.local_attend`), on the CPU through Triton's interpreter: the plain
steps' outputs at every position of a frame, its refusals, and through a runner built from the
profile the plain runner's frames."""

from tests import triton_cpu  # noqa: F401  (first: Triton's interpreter without a GPU)

import pytest  # noqa: E402
import torch  # noqa: E402

from stages.models.local_v15.config import LocalBlockConfig  # noqa: E402
from stages.models.local_v15.local_attend import local_attend  # noqa: E402
from stages.models.local_v15.model import LocalTransformer  # noqa: E402
from tests.stages.test_local_attention_plain import assert_same_frames_each_way  # noqa: E402
from tests.stages.test_local_v15_runner import mixed_requests  # noqa: E402


def _frame(local: LocalTransformer, x: torch.Tensor, mode: str) -> torch.Tensor:
    """Every position of one frame, x [positions, B, H] -> [positions, B, H]."""
    local.attend_plainly(mode == "plain")
    local.attend_by_kernel(mode == "kernel")
    rope, cache = local.rope_tables(x.shape[0], x), local.new_cache()
    with torch.no_grad():
        return torch.stack([local.step(x[p], p, rope, cache) for p in range(x.shape[0])])


def test_the_kernel_attends_as_the_plain_steps_do():
    """12 positions (1 to 12 keys) of a block with 5 heads of 24 (a head count that leaves a
    program's last heads masked, pairs that leave a tile's last pairs masked), fp32: the plain
    steps' outputs, and SDPA's; rows stay apart."""
    torch.manual_seed(0)
    local = LocalTransformer(LocalBlockConfig(hidden_size=120, num_layers=1, num_heads=5, inner_size=64)).eval()
    x = torch.randn(12, 3, 120)
    kernel, plain, sdpa = (_frame(local, x, mode) for mode in ("kernel", "plain", "sdpa"))
    torch.testing.assert_close(kernel, plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kernel, sdpa, rtol=1e-5, atol=1e-5)
    assert not torch.equal(kernel[1:], kernel[1:].roll(1, dims=1))  # rows differ: a real check


def test_the_kernel_in_bfloat16_rounds_as_the_plain_steps():
    """bf16 projections: within a few bf16 steps of the plain steps (which round q and k after
    rotating, as the kernel does, but sum in another order)."""
    torch.manual_seed(1)
    local = LocalTransformer(LocalBlockConfig(hidden_size=64, num_layers=1, num_heads=4, inner_size=64)).eval()
    local = local.to(torch.bfloat16)
    x = torch.randn(6, 4, 64, dtype=torch.bfloat16)
    kernel, plain = _frame(local, x, "kernel").float(), _frame(local, x, "plain").float()
    torch.testing.assert_close(kernel, plain, rtol=0.02, atol=0.02)


def test_the_kernel_refuses_what_it_cannot_attend():
    qkv = torch.zeros(2, 3 * 64)
    with pytest.raises(ValueError, match="positions"):
        local_attend([qkv] * 17, 4, 1e6)  # more positions than it takes
    with pytest.raises(ValueError, match="positions"):
        local_attend([qkv], 3, 1e6)  # 64 is no whole number of 3 heads
    with pytest.raises(ValueError, match="one shape"):
        local_attend([qkv, torch.zeros(3, 3 * 64)], 4, 1e6)
    local = LocalTransformer(LocalBlockConfig(hidden_size=64, num_layers=1, num_heads=4, inner_size=64))
    local.attend_by_kernel()
    rope, cache = local.rope_tables(4, qkv), local.new_cache()
    with pytest.raises(ValueError, match="in order"):
        local.step(torch.zeros(2, 64), 1, rope, cache)  # position 1 before position 0


@pytest.mark.slow
def test_a_runner_with_the_kernel_makes_the_plain_runners_frames(local_v15_dir):
    """Four requests of mixed settings (sampled, penalised, stops by the model and forced
    lengths) through runners built from the profile with the plain attention and the kernel."""
    reqs = dict(list(mixed_requests(local_v15_dir).items())[:4])
    assert_same_frames_each_way(local_v15_dir, reqs, "plain", "kernel", min_frames=12)
