"""`bench.kernels.codec_ring` on the tiny codec: every way of the streaming attention (copy and mask, the
in-place kernel with its default tiles and with given tiles) gives the same output, and the report
adds each stage's layers up per decode call. On CPU the kernel runs in Triton's interpreter
(TRITON_INTERPRET=1 set before triton is imported, as in the codec's ring-attention tests)."""

import torch

from tests import triton_cpu  # noqa: E402, F401  (before triton: its CPU interpreter)

import pytest  # noqa: E402

pytest.importorskip("triton")

from bench.kernels.codec_ring import bench_stage, parse_tiles, report  # noqa: E402
from stages.models.codec.config import CodecConfig, TransformerStage, tiny_v2_config  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_every_way_agrees_and_the_report_sums_layers():
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    stages = [s for s in CodecConfig.from_json(tiny_v2_config()).decoder if isinstance(s, TransformerStage)]
    tiles = parse_tiles("16,16,4,1 32,32,4,2")
    with torch.inference_mode():  # the two smallest stages (the interpreter runs every program in numpy)
        results = [bench_stage(s, i, 2, frames, 15, tiles, 1, device, torch.float32)
                   for frames in (1, 6) for i, s in enumerate(stages[:2])]
    for r in results:
        assert r.max_error < 1e-4, r
        assert r.copy_ms > 0 and r.in_place_ms > 0 and set(r.tiles_ms) == set(tiles)
    lines = report(results[:2], 1)
    copy = sum(r.copy_ms * r.layers for r in results[:2])
    assert f"copy {copy:.2f} ms" in lines[-1] and len(lines) == 4
    with pytest.raises(ValueError, match="block_m,block_n"):
        parse_tiles("16,16,4")
