"""`bench.kernels.paged_attention` on a tiny shape: every variant (cache dtype, keys per tile, warps,
stages, key splits) gives the reference's output over the values its cache holds, and the report names each
with its bytes read; on the CPU through Triton's interpreter."""

import torch

from tests import triton_cpu  # noqa: F401  (before triton: its CPU interpreter)

import pytest  # noqa: E402

pytest.importorskip("triton")

from bench.kernels.paged_attention import Variant, report, run  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_every_variant_matches_the_reference_and_is_reported():
    variants = [Variant.parse(t) for t in ("bf16,-,4,-", "bf16,16,4,2", "bf16,16,4,-,4", "fp8,-,4,-",
                                           "fp8,32,4,3", "fp8,16,4,-,2")]
    results = run(seqs=3, context=37, heads=4, kv_heads=2, head_dim=32, block_size=4,
                  variants=variants, iters=1, device=DEVICE)
    assert [r.variant for r in results] == variants
    for r in results:
        assert r.max_error < 2e-2, r  # bf16 outputs against the reference over the same stored values
        # keys and values of 38 positions (37 and the decode row's own) x 3 sequences x 2 KV heads x 32
        assert r.bytes_read == 2 * 3 * 38 * 2 * 32 * (1 if r.variant.cache == "fp8" else 2)
    text = report(results, 3, 37)
    assert "fp8,32,4,3" in text and "bf16,16,4,-,4" in text and "1.00x the first" in text


def test_a_variant_is_parsed_with_its_defaults_and_bad_ones_refused():
    assert Variant.parse("fp8,-,8,-") == Variant("fp8", None, 8, None, None)
    assert Variant.parse("bf16,-,4,-,4") == Variant("bf16", None, 4, None, 4)
    assert str(Variant.parse("bf16,64,4,2")) == "bf16,64,4,2"
    assert str(Variant.parse("bf16,64,4,-,8")) == "bf16,64,4,-,8"
    for bad in ("fp16,64,4,2", "bf16,64,4", "bf16,64,4,2,2,2"):
        with pytest.raises(ValueError):
            Variant.parse(bad)
