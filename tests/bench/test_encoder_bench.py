"""`bench.encoder`: the encoder's FLOP count against a hand count of the full v2 codec's stages,
and the tool run end to end on the tiny codec (CPU, eager)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("torch")

from bench.codec import CONFIGS  # noqa: E402
from bench.encoder import encoder_flops  # noqa: E402
from stages.models.codec.config import CodecConfig  # noqa: E402


def test_the_full_v2_encoder_costs_about_150_gflop_a_second_of_audio() -> None:
    """Five 768-wide stages of 12 layers at 400, 200, 100, 50 and 25 positions a second, then 32
    1280-wide layers at 12.5: ~14.2 MFLOP a position a 768 layer (~39 MFLOP at 1280) in matmuls,
    plus windowed attention and the projections."""
    cfg = CodecConfig.from_json(CONFIGS[("v2", "full")]())
    matmuls = sum(12 * 24 * 768**2 * rate for rate in (400, 200, 100, 50, 25)) + 32 * 24 * 1280**2 * 12.5
    one = encoder_flops(cfg, 1.0)
    assert matmuls < one < 1.3 * matmuls
    # the window: scores grow with the clip until it fills the context, then linearly
    assert encoder_flops(cfg, 20.0) == pytest.approx(20 * one, rel=0.35)


def test_the_tool_prints_a_line_a_batch_and_the_loop_beside_it() -> None:
    out = subprocess.run([sys.executable, "-m", "bench.encoder", "--batches", "1,2", "--seconds", "0.5",
                          "--modes", "eager", "--iters", "1", "--beside", "0.2"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    lines = [line for line in out.splitlines() if "ms a clip" in line]
    assert [line.split("batch")[1].split(":")[0].strip() for line in lines] == ["1", "2"]
    assert "small loop alone" in out and "beside eager encodes of batch 2" in out
