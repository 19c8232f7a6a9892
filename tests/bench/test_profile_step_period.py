"""The step profile's period listing: one backbone layer (or local position) of a profile's
kernels in launch order, with the idle time between them."""

from tests import triton_cpu  # noqa: F401  (the bench imports the talker, and with it triton: its CPU interpreter first)

from bench.local_v15_profile_step import kernel_period  # noqa: E402


def _layer(t0: float) -> list[tuple[str, float, float]]:
    """A layer's kernels from t0 (us): attention 10 us, 2 us idle, a matmul 5 us, 1 us idle,
    a norm 2 us, then 3 us idle before the next layer's attention."""
    return [("_paged_attention_kernel", t0, 10.0), ("nvjet_gemm", t0 + 12.0, 5.0), ("rms_norm", t0 + 18.0, 2.0)]


def test_one_period_lists_the_kernels_between_two_anchors_with_their_gaps():
    kernels = [k for i in range(4) for k in _layer(23.0 * i)]
    kernels.reverse()  # a profile's events come in any order
    text = kernel_period(kernels, "_paged_attention", which=1)
    lines = text.splitlines()
    assert [line.split()[-1] for line in lines[1:4]] == ["_paged_attention_kernel", "nvjet_gemm", "rms_norm"]
    assert [float(line.split()[0]) for line in lines[1:4]] == [0.0, 2.0, 1.0]
    assert lines[-1] == "  the period: 3 launches, 17.0 us of kernels, 6.0 us between them"  # 2 + 1 + 3


def test_kernels_overlapping_on_another_stream_add_no_gap():
    kernels = _layer(0.0) + [("memcpy", 1.0, 3.0)] + _layer(23.0)
    assert kernel_period(kernels, "_paged_attention", which=0).endswith("20.0 us of kernels, 6.0 us between them")


def test_too_few_anchors_say_so():
    assert "fewer than 3" in kernel_period(_layer(0.0), "_paged_attention", which=2)
