"""`python -m bench.agent_latency` against a real server (tiny demo model, cpu profile): every
protocol's agent speaks its replies, the same audio for each, and each reply has its figure.
CPU times mean nothing here; the GPU figures are in docs/performance.md."""

from __future__ import annotations

import json

import pytest

from bench.agent_latency import PROTOCOLS, main
from tests.api.server_process import ServerProcess

KEY = "bench-agents"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ServerProcess(tmp_path_factory.mktemp("data"), "--api-key", KEY).start()
    yield s
    s.stop()


def test_every_protocol_speaks_the_same_replies_and_times_them(server, tmp_path, capsys):
    out = tmp_path / "agents.json"
    assert main(["--url", server.url, "--key", KEY, "--concurrency", "2", "--replies", "2",
                 "--word-ms", "5", "--no-warmup", "--json", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["protocol"] for r in runs] == list(PROTOCOLS)
    assert all(r["failed"] == 0 and r["replies"] == 4 for r in runs)
    assert len({r["audio_s"] for r in runs}) == 1 and runs[0]["audio_s"] > 0  # the same texts, lengths
    assert all(rec["first_audio_ms"] > 0 for r in runs for rec in r["records"])
    table = capsys.readouterr().out
    assert all(f"| {p} | 2 | 4 | 0 |" in table for p in PROTOCOLS)
