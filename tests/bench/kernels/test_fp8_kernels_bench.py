"""`bench.kernels.fp8_kernels --quick` (tiny widths, Triton's interpreter on the CPU): every warp count of
both kernels runs and is reported beside the torch ops with its share of equal float8 codes, so
a GPU call does not find the bench broken."""

from tests import triton_cpu  # noqa: F401  (first: Triton's interpreter without a GPU)

import re  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from bench.kernels import fp8_kernels  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="the quick run is the CPU's")
def test_the_quick_run_reports_every_warp_count_of_both_kernels(capsys):
    fp8_kernels.main(["--quick"])
    out = capsys.readouterr().out
    for name, warps in (("swiglu", fp8_kernels.SWIGLU_WARPS), ("norm", fp8_kernels.NORM_WARPS)):
        line = next(ln for ln in out.splitlines() if ln.startswith(f"{name} rows"))
        assert line.split(": ", 1)[1].startswith("torch"), line
        reported = [int(w) for w in re.findall(r"(\d+) warps", line)]
        assert reported == list(warps), line
        # the interpreter halves a value just under a power of two now and then (its float8 cast)
        # and truncates fp32 to bf16 (the norm's sum): most codes, not all, as the torch ops'
        shares = [float(s) for s in re.findall(r"\(([\d.]+)% codes\)", line)]
        assert len(shares) == len(warps) and all(s > 80 for s in shares), line
