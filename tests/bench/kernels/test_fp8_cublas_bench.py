"""`bench.kernels.fp8_cublas --quick` (one tiny shape, torch's float8 matmul on the CPU): every way is
timed and lands near the fp32 product, so a GPU call does not find the bench broken."""

import sys

import pytest
import torch

from bench.kernels import fp8_cublas


@pytest.mark.skipif(torch.cuda.is_available(), reason="the quick run is the CPU's")
def test_the_quick_run_times_every_way_near_the_full_precision_product(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["fp8_cublas", "--quick"])
    fp8_cublas.main()
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("tiny"))
    cells = line.split(" | ")[1:]
    assert [c.split(" us ")[0].rsplit(" ", 1)[0].strip() for c in cells] == list(fp8_cublas.WAYS), cells
    errs = [float(c.rsplit(" e", 1)[1]) for c in cells]
    assert errs[0] < 1e-2 and all(e < 0.1 for e in errs), line  # float8's ~4% a product at most
    assert "nan" not in line
    assert "a decode step's matmuls at  16 rows" in out
