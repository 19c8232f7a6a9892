"""Same seed, same audio, through the server (`talker.batch_invariant`): seeded requests give the
same PCM bytes sent one at a time, again once the prefix cache holds their voice's prompt rows,
all together, and mixed into other requests (other texts, lengths and seeds) that share their
talker steps (decode rows beside prompt chunks cut differently by the step's budget) and their
codec dispatches. One seeded request clones a voice the server has not heard, so its solo run
computes the voice's prompt rows and its repeat takes them from the prefix cache: computed and
cached prefixes give the same audio.

CPU: the tiny demo model (random weights) on the `cpu` profile with the mode on, its Triton
kernels under Triton's CPU interpreter in the workers (TRITON_INTERPRET=1), small prompt chunks
and step budgets so a prompt's chunks fall differently with other prompts in the step; few frames
(the interpreter runs every kernel program in numpy). GPU: Local-v1.5 at full size (random bf16
weights) on the shipped `high-concurrency` profile with the mode on and what the mode needs off;
eight requests mixed into 64 others; run on a device with

    BUDGET=590 TESTS=tests/api/test_batch_invariant_server.py bash bench/device_runs.sh gputests
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from tests import triton_cpu  # noqa: F401  (before triton: this process collects modules that need its interpreter)

import httpx
import numpy as np
import pytest
import torch

from tests.api.helpers import data_url, metric, tone_wav
from tests.api.server_process import ServerProcess

pytest.importorskip("triton")

# (text, seed, forced frames): the requests whose audio must not depend on their company
SEEDED = [("The quick brown fox jumps over the lazy dog again.", 101, 3),
          ("Same seed, same audio, at any load at all.", 202, 6),
          ("A third request, with words of its own to speak here.", 303, 4),
          ("Four small words, then a longer pause before the end.", 404, 7)]
# a voice no warm-up has cached (its prompt rows are computed by its solo run, cached after)
NEW_VOICE = data_url(tone_wav(1.2, hz=290.0))
CLONED = ("A voice of its own, cloned from a clip never heard before.", 505, 4, NEW_VOICE)
# the company: longer prompts (more prompt chunks) and other lengths
OTHERS = [("Another request in the mix, rather longer, to keep the talker's prefill busy for a while.", 7, 7),
          ("Short and sweet, thirty characters.", 8, 2),
          ("A third companion that arrives with the seeded ones and stays a little longer.", 9, 8),
          ("The last of the others, of middling length here.", 10, 4)]


def timeout(seconds: int):
    """pytest-timeout's limit for one test where the plugin is installed (a GPU image may lack it,
    and an unknown mark fails the collection under --strict-markers)."""
    try:
        import pytest_timeout  # noqa: F401
    except ImportError:
        return lambda test: test
    return pytest.mark.timeout(seconds)


def speech(client: httpx.Client, text: str, seed: int, frames: int, ref_audio: str | None = None) -> np.ndarray:
    """The whole PCM (s16, 24 kHz mono) of one seeded request with a forced length, in the default
    voice or cloned from ``ref_audio``."""
    voice = {"ref_audio": ref_audio} if ref_audio else {"voice": "default"}
    r = client.post("/v1/audio/speech", json={"model": "mossvox", **voice, "input": text,
                                              "response_format": "pcm", "stream": False, "seed": seed,
                                              "forced_frames": frames})
    assert r.status_code == 200, r.text
    return np.frombuffer(r.content, np.int16)


def all_at_once(client: httpx.Client, requests: list[tuple]) -> list[np.ndarray]:
    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(lambda req: speech(client, *req), requests))


def cached_rows(client: httpx.Client) -> float:
    return metric(client.get("/metrics").text, "mossvox_engine_talker_cached_rows_total")


def differences(alone: list[np.ndarray], got: list[np.ndarray]) -> list[int | str]:
    """Each request's max |difference| in s16 LSB against its solo run (or its lengths)."""
    return [int(np.abs(a.astype(np.int32) - g.astype(np.int32)).max()) if a.shape == g.shape
            else f"{len(a)} vs {len(g)} samples" for a, g in zip(alone, got)]


def one_at_a_time(client: httpx.Client, requests: list[tuple]) -> tuple[list[np.ndarray], list[float]]:
    """Each request's PCM, sent one after another, and the prompt rows each took from the prefix
    cache."""
    pcms, hits = [], []
    for req in requests:
        before = cached_rows(client)
        pcms.append(speech(client, *req))
        hits.append(cached_rows(client) - before)
    return pcms, hits


def check_same_pcm_at_any_load(url: str, seeded: list, others: list) -> None:
    """The seeded requests alone, alone again (their own prompts' full blocks now in the prefix
    cache too; the default voice's template rows are cached from warm-up already, the cloned
    voice's only from its solo run on), together, and mixed: identical PCM bytes."""
    with httpx.Client(base_url=url, timeout=900) as client:
        alone, first_hits = one_at_a_time(client, seeded)
        assert all(len(pcm) for pcm in alone)
        assert len({pcm.tobytes() for pcm in alone}) == len(seeded)  # each its own audio
        again, hits = one_at_a_time(client, seeded)
        assert sum(hits) > 0, "the repeats took no prompt rows from the prefix cache"
        for req, first, hit in zip(seeded, first_hits, hits):
            if len(req) > 3:  # a new voice: its solo run computed the rows its repeat took from the cache
                assert hit > first, f"the cloned voice's repeat took {hit:.0f} cached rows, its first run {first:.0f}"
        first_hit = sum(first_hits)
        together = all_at_once(client, seeded)
        half = len(others) // 2
        mixed = all_at_once(client, others[:half] + seeded + others[half:])[half: half + len(seeded)]
    found = {name: differences(alone, got) for name, got in
             (("again (prefix cache)", again), ("together", together), ("mixed", mixed))}
    assert all(d == 0 for ds in found.values() for d in ds), (
        f"max |difference| against each request alone, s16 LSB (rows the solo runs took from the "
        f"prefix cache: {first_hit:.0f}): {found}")


@pytest.mark.slow  # minutes: the talker's kernels under Triton's interpreter
@timeout(1500)
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU build of the check (the GPU one is below)")
def test_seeded_requests_same_pcm_alone_cached_together_and_mixed_cpu(tmp_path):
    server = ServerProcess(tmp_path, sets=("talker.batch_invariant=true", "talker.prefill_chunk_tokens=24",
                                           "talker.max_prefill_tokens_per_step=48",
                                           "engine.ready_timeout_s=900"),  # warm-up in the interpreter
                           env={"TRITON_INTERPRET": "1"}, start_timeout_s=900).start()
    try:
        check_same_pcm_at_any_load(server.url, SEEDED + [CLONED], OTHERS)
    finally:
        server.stop()


def gpu_requests(first_seed: int, n: int, frames: tuple[int, int]) -> list[tuple[str, int, int]]:
    """n requests of 30-100 characters, seeded from `first_seed`, forced lengths in `frames`."""
    rng = np.random.default_rng(first_seed)
    words = "the a quick voice speaks of rivers and stone under morning light while distant bells ring".split()
    out = []
    for i in range(n):
        text = ""
        target = int(rng.integers(30, 101))
        while len(text) < target:
            text += words[int(rng.integers(len(words)))] + " "
        out.append((text[:target].strip().capitalize() + ".", first_seed + i, int(rng.integers(*frames))))
    return out


@pytest.mark.gpu
@timeout(570)  # a full-size checkpoint written, a high-concurrency server started, 88 requests
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_seeded_requests_same_pcm_alone_cached_together_and_mixed_gpu(tmp_path):
    from stages.tools.make_checkpoint import make_checkpoint

    make_checkpoint(tmp_path / "l15", variant="local-v1.5", size="full", seed=0)
    server = ServerProcess(tmp_path / "data", str(tmp_path / "l15"), profile="high-concurrency", sets=(
        "talker.batch_invariant=true", "talker.local_attention=sdpa", "codec.split_chunks=false"),
        start_timeout_s=900).start()
    try:
        check_same_pcm_at_any_load(server.url, gpu_requests(1000, 8, (30, 80)) + [CLONED],
                                   gpu_requests(5000, 64, (20, 100)))
    finally:
        server.stop()
