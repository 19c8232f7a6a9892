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
