"""`triton_kernel_counter`: the workers' count of Triton kernels specialised while serving (a
first-use compile stalls a step); on CPU it is None and leaves triton unimported."""

import subprocess
import sys

import pytest
import torch


def test_on_cpu_there_is_no_counter_and_triton_stays_unimported():
    code = ("import sys\n"
            "from stages.workers.common import triton_kernel_counter\n"
            "assert triton_kernel_counter('cpu') is None\n"
            "assert 'triton' not in sys.modules, 'imported triton'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_kernel_specialised_for_new_constants_is_counted_once():
    import triton
    import triton.language as tl

    from stages.workers.common import triton_kernel_counter

    @triton.jit
    def scale(x_ptr, n, FACTOR: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < n
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=ok) * FACTOR, mask=ok)

    count = triton_kernel_counter("cuda")
    assert count is not None and count() == 0
    x = torch.ones(100, device="cuda")
    scale[(1,)](x, 100, FACTOR=2.0, BLOCK=128)
    scale[(1,)](x, 100, FACTOR=2.0, BLOCK=128)  # the same specialisation: no new kernel
    assert count() == 1
    scale[(1,)](x, 100, FACTOR=3.0, BLOCK=128)  # a new constant: a new kernel
    torch.cuda.synchronize()
    assert count() == 2 and float(x[0]) == 12.0
    assert len(count.since(0)) == 2 and count.since(2) == []
    (name,) = count.since(1)  # the slow line's name of the second one
    assert "scale(" in name and "FACTOR" in name and "num_warps" not in name


def test_the_counter_keeps_the_last_specialisations_by_name():
    """What a slow step's line names: the kernels made after a count, the last `KEEP` of them,
    each as Triton describes it less its launch options."""
    from stages.workers.common import TritonKernelCounter, kernel_names, specialisation_name

    counter = TritonKernelCounter()
    assert counter() == 0 and counter.since(0) == [] and kernel_names(counter, 0) == ""
    for i in range(12):
        counter.record(f"k{i}(x: *fp32)")
    assert counter() == 12
    assert counter.since(10) == ["k10(x: *fp32)", "k11(x: *fp32)"]
    assert counter.since(0) == [f"k{i}(x: *fp32)" for i in range(4, 12)]  # the last KEEP only
    assert kernel_names(counter, 11) == ": k11(x: *fp32)"
    assert kernel_names(lambda: 3, 0) == ""  # a plain count has no names
    assert specialisation_name("_paged[num_warps=4, num_ctas=1](q_ptr: *bf16, T: i32)") == \
        "_paged(q_ptr: *bf16, T: i32)"
    assert specialisation_name(None) == "?"
