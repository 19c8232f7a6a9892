"""Reference-code cache: content addressing, single flight, sharing through the directory."""

from __future__ import annotations

import asyncio
import multiprocessing as mp

import numpy as np
import pytest

from api.ref_cache import ReferenceCodeCache, codec_namespace

N_VQ = 4


class CountingEncoder:
    """Deterministic codes from the samples; counts calls (the codec worker's stand-in)."""

    def __init__(self, delay: float = 0.0) -> None:
        self.calls = 0
        self.delay = delay

    async def __call__(self, wav: np.ndarray) -> np.ndarray:
        self.calls += 1
        await asyncio.sleep(self.delay)
        frames = max(1, wav.shape[1] // 100)
        base = int(abs(wav).sum() * 1000) % 1000
        return (np.arange(frames * N_VQ).reshape(frames, N_VQ) + base).astype(np.int64)


def make_cache(tmp_path, encoder, namespace=codec_namespace("m", N_VQ, 24000, 1)):
    return ReferenceCodeCache(tmp_path / "ref_codes", namespace, N_VQ, encoder)


async def test_second_lookup_is_a_hit_and_does_not_encode(tmp_path):
    encoder = CountingEncoder()
    cache = make_cache(tmp_path, encoder)
    wav = np.random.default_rng(0).standard_normal((1, 1000)).astype(np.float32)
    first, hit1 = await cache.get_or_encode("d1", wav)
    second, hit2 = await cache.get_or_encode("d1", wav)
    assert (hit1, hit2) == (False, True)
    assert encoder.calls == 1
    np.testing.assert_array_equal(first, second)
    assert first.dtype == np.int64 and first.shape == (10, N_VQ)


async def test_concurrent_misses_share_one_encode(tmp_path):
    encoder = CountingEncoder(delay=0.05)
    cache = make_cache(tmp_path, encoder)
    wav = np.ones((1, 500), np.float32)
    results = await asyncio.gather(*(cache.get_or_encode("same", wav) for _ in range(10)))
    assert encoder.calls == 1
    assert sorted(hit for _, hit in results) == [False] + [True] * 9
    assert cache.misses == 1 and cache.hits == 9


async def test_another_cache_on_the_same_directory_sees_the_entry(tmp_path):
    """As a second API process or a restarted one would."""
    writer_encoder, reader_encoder = CountingEncoder(), CountingEncoder()
    wav = np.ones((1, 700), np.float32)
    codes, _ = await make_cache(tmp_path, writer_encoder).get_or_encode("clip", wav)
    again, hit = await make_cache(tmp_path, reader_encoder).get_or_encode("clip", wav)
    assert hit and reader_encoder.calls == 0
    np.testing.assert_array_equal(codes, again)
    # No temporary files are left beside the entry.
    assert [p.suffix for p in (tmp_path / "ref_codes").rglob("*") if p.is_file()] == [".npy"]


def _read_in_child(directory, digest, queue):
    async def main():
        cache = ReferenceCodeCache(directory, codec_namespace("m", N_VQ, 24000, 1), N_VQ, CountingEncoder())
        codes, hit = await cache.get_or_encode(digest, np.ones((1, 700), np.float32))
        queue.put((hit, codes.tolist()))
    asyncio.run(main())


async def test_entry_written_here_is_a_hit_in_another_process(tmp_path):
    codes, _ = await make_cache(tmp_path, CountingEncoder()).get_or_encode("xproc", np.ones((1, 700), np.float32))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_read_in_child, args=(tmp_path / "ref_codes", "xproc", queue))
    child.start()
    hit, child_codes = await asyncio.to_thread(queue.get, True, 60)
    child.join(10)
    assert hit is True
    assert child_codes == codes.tolist()


async def test_other_model_namespace_misses(tmp_path):
    wav = np.ones((1, 300), np.float32)
    await make_cache(tmp_path, CountingEncoder()).get_or_encode("d", wav)
    other = CountingEncoder()
    _, hit = await make_cache(tmp_path, other, codec_namespace("m", N_VQ, 48000, 2)).get_or_encode("d", wav)
    assert not hit and other.calls == 1


async def test_corrupt_or_mis_shaped_file_is_re_encoded(tmp_path):
    encoder = CountingEncoder()
    cache = make_cache(tmp_path, encoder)
    wav = np.ones((1, 300), np.float32)
    path = cache.path(cache.key("bad"))
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a numpy file")
    _, hit = await cache.get_or_encode("bad", wav)
    assert not hit and encoder.calls == 1
    cache.path(cache.key("shape")).parent.mkdir(parents=True, exist_ok=True)
    np.save(cache.path(cache.key("shape")), np.zeros((3, N_VQ + 1), np.int64))
    _, hit = await make_cache(tmp_path, encoder).get_or_encode("shape", wav)
    assert not hit and encoder.calls == 2


async def test_failed_encode_reaches_every_waiter_and_is_retried_later(tmp_path):
    class Failing(CountingEncoder):
        async def __call__(self, wav):
            if self.calls == 0:
                self.calls += 1
                await asyncio.sleep(0.02)
                raise RuntimeError("codec worker gone")
            return await super().__call__(wav)

    encoder = Failing()
    cache = make_cache(tmp_path, encoder)
    wav = np.ones((1, 300), np.float32)
    results = await asyncio.gather(*(cache.get_or_encode("f", wav) for _ in range(3)), return_exceptions=True)
    assert all(isinstance(r, RuntimeError) for r in results)
    _, hit = await cache.get_or_encode("f", wav)
    assert not hit and encoder.calls == 2


async def test_wrong_shape_from_encoder_is_an_error_not_a_cache_entry(tmp_path):
    async def bad_encode(wav):
        return np.zeros((5, N_VQ + 2), np.int64)

    cache = make_cache(tmp_path, bad_encode)
    with pytest.raises(RuntimeError, match="expected"):
        await cache.get_or_encode("w", np.ones((1, 10), np.float32))
    assert not list((tmp_path / "ref_codes").rglob("*.npy"))


async def test_waveform_function_runs_only_on_a_miss(tmp_path):
    """A hit skips preparing the codec waveform (resampling costs ~40 ms per clip here)."""
    calls = []

    def prepare():
        calls.append(1)
        return np.ones((1, 300), np.float32)

    encoder = CountingEncoder()
    cache = make_cache(tmp_path, encoder)
    _, hit1 = await cache.get_or_encode("lazy", prepare)
    _, hit2 = await make_cache(tmp_path, encoder).get_or_encode("lazy", prepare)
    assert (hit1, hit2) == (False, True) and len(calls) == 1 and encoder.calls == 1


async def test_a_waiter_that_leaves_does_not_take_the_encode_from_the_others(tmp_path):
    """The request that started an encode is cancelled (its client left) while another waits on
    the same clip: the encode goes on, once, and the other gets its codes; so does a third that
    arrives after the first left."""

    class Slow(CountingEncoder):
        async def __call__(self, wav):
            await asyncio.sleep(0.2)
            return await super().__call__(wav)

    encoder = Slow()
    cache = make_cache(tmp_path, encoder)
    wav = np.ones((1, 300), np.float32)
    first = asyncio.ensure_future(cache.get_or_encode("left", wav))
    await asyncio.sleep(0.01)
    second = asyncio.ensure_future(cache.get_or_encode("left", wav))
    await asyncio.sleep(0.01)
    first.cancel()
    third = asyncio.ensure_future(cache.get_or_encode("left", wav))
    (codes, hit), (again, hit_again) = await second, await third
    assert first.cancelled() and hit and hit_again and encoder.calls == 1
    np.testing.assert_array_equal(codes, again)
    assert (await cache.get_or_encode("left", wav))[1] and cache.path(cache.key("left")).exists()


async def test_codes_that_cannot_be_written_are_still_served(tmp_path):
    cache = make_cache(tmp_path, CountingEncoder())
    cache.path(cache.key("ro")).parent.write_bytes(b"")  # a file where its folder would go
    codes, hit = await cache.get_or_encode("ro", np.ones((1, 300), np.float32))
    assert not hit and codes.shape[1] == N_VQ
