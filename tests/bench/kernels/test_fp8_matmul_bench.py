"""`bench.kernels.fp8_matmul --quick` (one tiny shape through Triton's interpreter on the CPU): the kernel's
sweep and the comparison line come out, so a GPU call does not find the bench broken."""

from tests import triton_cpu  # noqa: F401  (before triton: its CPU interpreter)

import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from bench.kernels import fp8_matmul  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="the quick run is the CPU's")
def test_the_quick_run_sweeps_the_kernel_and_compares_it_with_bf16(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["fp8_matmul", "--quick", "--sweep", "3"])
    fp8_matmul.main()
    out = capsys.readouterr().out
    assert "sweep w8a16 tiny" in out and "fastest:" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("tiny"))
    assert all(part in line for part in ("bf16", "w8a16", "err"))
    err = float(line.split("err ")[1].split(")")[0])
    assert err < 1e-2  # the kernel's product against the dequantized weights'
    assert "a decode step's matmuls at    3 rows" in out
