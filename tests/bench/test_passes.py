"""`bench.passes`: a device run's measured passes, server against server."""

import json

from bench.passes import read_passes, table


def _write(root, stem, concurrency, rate, ttfa, smooth=1.0, failed=False):
    run = {"concurrency": concurrency, "failed": failed, "audio_s_per_s": rate, "ttfa_ms": {"mean": ttfa},
           "share_smooth": smooth}
    (root / f"{stem}.json").write_text(json.dumps({"tool": "mossvox bench serve", "runs": [run]}))


def test_passes_are_grouped_by_server_and_level_with_ratios_against_the_shipped_server(tmp_path):
    _write(tmp_path, "shipped_warm_c128", 128, 100.0, 900.0)  # the discarded first pass
    _write(tmp_path, "shipped_c128", 128, 400.0, 150.0)
    _write(tmp_path, "shipped_r2_c128", 128, 420.0, 130.0, smooth=0.93)
    _write(tmp_path, "alt_c128", 128, 460.0, 120.0)
    _write(tmp_path, "alt_r2_c128", 128, 462.0, 126.0)
    _write(tmp_path, "alt_c64", 64, 300.0, 80.0)
    _write(tmp_path, "alt_r3_c64", 64, 1.0, 1.0, failed=True)  # a failed pass is not a figure
    (tmp_path / "timeline_alt_c128.json").write_text(json.dumps([{"window_s": 1.0}]))  # not a pass

    passes = read_passes(tmp_path)
    assert [(p.server, p.concurrency, p.index) for p in passes] == [
        ("alt", 64, 1), ("alt", 128, 1), ("alt", 128, 2), ("shipped", 128, 1), ("shipped", 128, 2)]
    rows = table(passes).splitlines()[2:]
    assert rows[0].startswith("| 64 | alt | 300.00; 80.0 ms; 100% |") and rows[0].endswith("| baseline |")
    assert rows[1].startswith("| 128 | shipped | 400.00; 150.0 ms; 100% / 420.00; 130.0 ms; 93% | 410.00 | 140.0 ms")
    assert rows[1].endswith("| baseline |")
    assert rows[2].endswith("| 461.00 | 123.0 ms | 1.12x audio-s/s, 0.88x TTFA |")  # 461 / 410, 123 / 140
    assert table(passes, baseline="alt").splitlines()[4].endswith("| 0.89x audio-s/s, 1.14x TTFA |")
