"""`tests.triton_cpu` on a machine without CUDA: a kernel whose device helper runs in a loop still
computes its result, the helper's calls inside the launch do not patch `triton.language` again,
and after the launch the language is restored as the interpreter left it."""

from tests import triton_cpu  # noqa: F401  (first: Triton's interpreter without a GPU)

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs only without CUDA")


@triton.jit
def twice(x):
    return x * 2


@triton.jit
def kernel(out_ptr, N: tl.constexpr, CALLS: tl.constexpr):
    acc = tl.zeros([N], tl.float32)
    for _ in tl.static_range(CALLS):
        acc += twice(tl.arange(0, N).to(tl.float32))
    tl.store(out_ptr + tl.arange(0, N), acc)


def test_a_helper_in_a_loop_computes_and_the_language_is_restored(monkeypatch):
    from triton.runtime import interpreter

    assert interpreter._patch_lang.skips_repatching
    walks = []
    real = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda *a: walks.append(a[0]) or real(*a))
    original = tl.arange
    out = torch.empty(8)
    kernel[(1,)](out, N=8, CALLS=1)  # the first launch rewrites the functions (fewer walks)
    walks.clear()
    kernel[(1,)](out, N=8, CALLS=1)
    one_call = len(walks)
    walks.clear()
    kernel[(1,)](out, N=8, CALLS=4)
    torch.testing.assert_close(out, 8 * torch.arange(8.0))
    assert one_call and len(walks) == one_call  # three more helper calls walked nothing again
    assert tl.arange is original  # restored
