"""One table of a device run's measured passes, server against server.

    python -m bench.passes RESULTS_DIR [--baseline shipped]

`bench/device_runs.sh` writes each measured pass of `mossvox bench serve` as `NAME_cC.json`, the
server's later passes as `NAME_r2_cC.json`, `NAME_r3_cC.json`, ..., and the discarded first pass
as `NAME_warm_cC.json` (left out here). Per concurrency C this prints every server's passes
(audio-s/s; mean TTFA; smooth share), their means, and each server's mean audio-s/s and mean TTFA
as ratios of the baseline server's: the comparison a default is flipped on (a win beyond the
spread between servers, ~8%, or over several passes).
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from pathlib import Path

_NAME = re.compile(r"^(?P<server>.+?)(?:_r(?P<rep>\d+))?(?P<warm>_warm)?_c(?P<c>\d+)$")


@dataclass(frozen=True)
class Pass:
    """One measured pass of one server at one concurrency."""

    server: str
    concurrency: int
    index: int  # 1 for NAME_cC, N for NAME_rN_cC
    audio_s_per_s: float
    ttfa_mean_ms: float
    smooth: float  # share of requests with no stall over 100 ms


def read_passes(root: Path) -> list[Pass]:
    """Every measured pass under `root` (discarded first passes and other files left out)."""
    out = []
    for path in sorted(root.glob("*_c*.json")):
        m = _NAME.match(path.stem)
        if m is None or m["warm"]:
            continue
        doc = json.loads(path.read_text())
        if not isinstance(doc, dict) or "runs" not in doc:  # a timeline summary, not a pass
            continue
        for run in doc["runs"]:
            if run.get("failed"):
                continue
            out.append(Pass(m["server"], int(run["concurrency"]), int(m["rep"] or 1), float(run["audio_s_per_s"]),
                            float(run["ttfa_ms"]["mean"]), float(run["share_smooth"])))
    return sorted(out, key=lambda p: (p.concurrency, p.server, p.index))


def table(passes: list[Pass], baseline: str | None = None) -> str:
    """Markdown, one row per (C, server): passes, means, ratios against `baseline` (default the
    server named "shipped", else the first server by name) at the same C."""
    lines = ["| C | server | passes: audio-s/s; TTFA mean; smooth | mean audio-s/s | mean TTFA | ratio |",
             "|---:|---|---|---:|---:|---|"]
    for c in sorted({p.concurrency for p in passes}):
        at_c = [p for p in passes if p.concurrency == c]
        servers = sorted({p.server for p in at_c})
        base = baseline if baseline in servers else ("shipped" if "shipped" in servers else servers[0])

        def means(server: str) -> tuple[float, float]:
            mine = [p for p in at_c if p.server == server]
            return (sum(p.audio_s_per_s for p in mine) / len(mine), sum(p.ttfa_mean_ms for p in mine) / len(mine))

        base_rate, base_ttfa = means(base)
        for server in sorted(servers, key=lambda s: (s != base, s)):
            mine = [p for p in at_c if p.server == server]
            rate, ttfa = means(server)
            each = " / ".join(f"{p.audio_s_per_s:.2f}; {p.ttfa_mean_ms:.1f} ms; {100 * p.smooth:.0f}%" for p in mine)
            ratio = "baseline" if server == base else f"{rate / base_rate:.2f}x audio-s/s, {ttfa / base_ttfa:.2f}x TTFA"
            lines.append(f"| {c} | {server} | {each} | {rate:.2f} | {ttfa:.1f} ms | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", type=Path, help="a device run's results folder (bench/device_runs.sh: $OUT/r)")
    ap.add_argument("--baseline", default=None, help="the server the ratios are against (default: shipped)")
    args = ap.parse_args(argv)
    passes = read_passes(args.root)
    print(table(passes, args.baseline) if passes else f"no measured passes under {args.root}")


if __name__ == "__main__":
    main()
