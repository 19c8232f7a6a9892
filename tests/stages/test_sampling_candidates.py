"""The candidate path (`sample_tokens(..., candidates=True)`) draws the full path's tokens, both
draw the legacy sampler's tokens, and the cheaper noise hash is the legacy one, value for value."""

import numpy as np
import torch

from bench.kernels.sampling import legacy_noise, legacy_sample_tokens
from stages.runtime.sampling import K_CAP, RowSampling, _mix32, exponential_noise, noise_key, sample_tokens

V = 1024


def mixed_rows(batch: int, gen: torch.Generator, *, top_k: list[int]) -> RowSampling:
    def pick(values, dtype):
        return torch.tensor(values, dtype=dtype)[torch.randint(len(values), (batch,), generator=gen)]

    return RowSampling(
        temperature=pick([0.6, 1.0, 1.7, 2.5, 0.0], torch.float32),  # 0: greedy
        top_k=pick(top_k, torch.long),
        top_p=pick([0.3, 0.8, 0.95, 1.0, 0.0], torch.float32),
        repetition_penalty=pick([1.0, 1.0, 1.1, 1.5], torch.float32),
        greedy=torch.rand(batch, generator=gen) < 0.1,
        seed=torch.randint(-(2**62), 2**62, (batch,), generator=gen),
    )


def draws(logits, rows, frame, stream, seen, **kw):
    return sample_tokens(logits, rows, frame, stream, seen, **kw)


def test_candidate_path_matches_full_path_and_legacy():
    gen = torch.Generator().manual_seed(0)
    batch = 96
    rows = mixed_rows(batch, gen, top_k=[1, 2, 5, 25, 50, K_CAP])
    for step in range(6):
        logits = torch.randn(batch, V, generator=gen) * (1 + step)
        seen = torch.rand(batch, V, generator=gen) < 0.05
        frame = torch.randint(0, 10_000, (batch,), generator=gen)
        for stream, s in ((step % 13, seen), (12, None)):
            full = draws(logits, rows, frame, stream, s)
            assert torch.equal(draws(logits, rows, frame, stream, s, candidates=True), full)
            assert torch.equal(legacy_sample_tokens(logits, rows, frame, stream, s), full)


def test_ties_rank_by_index_on_both_paths():
    """bfloat16 logits tie often; ties rank by vocabulary index on both paths (top-p cuts them alike)."""
    gen = torch.Generator().manual_seed(1)
    batch = 128
    rows = mixed_rows(batch, gen, top_k=[1, 5, 25, 50])
    for step in range(4):
        logits = (torch.randn(batch, V, generator=gen) * 3).to(torch.bfloat16)
        frame = torch.full((batch,), step)
        seen = torch.rand(batch, V, generator=gen) < 0.05
        for s in (None, seen):
            full = draws(logits, rows, frame, 0, s)
            assert torch.equal(draws(logits, rows, frame, 0, s, candidates=True), full)
            assert torch.equal(draws(logits.float(), rows, frame, 0, s), full)  # no cast needed first
    # integer logits: ties everywhere. Rows whose k-th value ties the (K_CAP + 1)-th are the
    # documented exception (the full path keeps every tied entry); all others must match.
    coarse = (torch.randn(batch, V, generator=gen) * 3).round()
    rows = RowSampling(**{**vars(rows), "top_k": torch.full((batch,), 5), "temperature": torch.ones(batch)})
    ranked = coarse.sort(-1, descending=True).values
    exact = ranked[:, 4] != ranked[:, K_CAP]
    assert exact.float().mean() > 0.8
    full = draws(coarse, rows, frame, 0, None)
    assert torch.equal(draws(coarse, rows, frame, 0, None, candidates=True)[exact], full[exact])
    greedy = RowSampling(**{**vars(rows), "greedy": torch.ones(batch, dtype=torch.bool)})
    assert torch.equal(draws(coarse, greedy, frame, 0, None, candidates=True), coarse.argmax(-1))


def test_rows_outside_the_cap_are_exact_on_the_full_path():
    gen = torch.Generator().manual_seed(2)
    batch = 64
    rows = mixed_rows(batch, gen, top_k=[0, -1, K_CAP + 1, 300, V, V + 5])
    logits = torch.randn(batch, V, generator=gen) * 2
    seen = torch.rand(batch, V, generator=gen) < 0.05
    frame = torch.arange(batch)
    assert torch.equal(draws(logits, rows, frame, 4, seen), legacy_sample_tokens(logits, rows, frame, 4, seen))


def test_small_heads_take_the_candidate_path_for_any_top_k():
    """A head of V <= K_CAP entries (the 2-entry stop head) is ranked whole: exact for every k."""
    gen = torch.Generator().manual_seed(3)
    batch = 256
    rows = mixed_rows(batch, gen, top_k=[0, 1, 2, 50])
    for vocab in (2, 17, K_CAP):
        logits = torch.randn(batch, vocab, generator=gen)
        frame = torch.arange(batch) + vocab
        full = draws(logits, rows, frame, 12, None)
        assert torch.equal(draws(logits, rows, frame, 12, None, candidates=True), full)
        assert torch.equal(legacy_sample_tokens(logits, rows, frame, 12), full)


def test_a_filtered_entry_with_zero_noise_is_never_drawn():
    """U rounds to 1 for 2**-24 of the entries (noise -0.0); the legacy sampler then scored a
    filtered entry 0 / -0.0 = NaN and drew it. Seed 124, frame 886, stream 3 has one at 683."""
    seed, frame = torch.tensor([124]), torch.tensor([886])
    noise = exponential_noise(seed, frame, 3, V)
    assert noise[0, 683].item() == 0.0 and torch.equal(noise, legacy_noise(seed, frame, 3, V))
    logits = torch.zeros(1, V)
    logits[0, :10] = 5.0  # top-k 10 keeps 0..9 only
    rows = RowSampling(temperature=torch.ones(1), top_k=torch.tensor([10]), top_p=torch.ones(1),
                       repetition_penalty=torch.ones(1), greedy=torch.zeros(1, dtype=torch.bool), seed=seed)
    assert legacy_sample_tokens(logits, rows, frame, 3, zero_noise_fix=False).item() == 683
    for candidates in (False, True):
        assert sample_tokens(logits, rows, frame, 3, candidates=candidates).item() < 10


def test_noise_by_index_equals_the_full_noise_gathered():
    gen = torch.Generator().manual_seed(4)
    seed = torch.randint(-(2**62), 2**62, (32,), generator=gen)
    frame = torch.randint(0, 2**40, (32,), generator=gen)
    full = exponential_noise(seed, frame, 7, V)
    assert torch.equal(full, legacy_noise(seed, frame, 7, V))
    index = torch.randint(0, V, (32, K_CAP), generator=gen)
    assert torch.equal(exponential_noise(seed, frame, 7, index), full.gather(-1, index))
    keys = noise_key(seed, frame, torch.arange(13))  # [B, 13]: every stream of a frame at once
    assert torch.equal(keys[:, 7], noise_key(seed, frame, 7))
    assert torch.equal(exponential_noise(seed, frame, 7, index, key=keys[:, 7]), full.gather(-1, index))
    rows = mixed_rows(32, gen, top_k=[5, 25])
    logits = torch.randn(32, V, generator=gen)
    rows = RowSampling(**{**vars(rows), "seed": seed})
    assert torch.equal(sample_tokens(logits, rows, frame, 7, candidates=True, key=keys[:, 7]),
                       sample_tokens(logits, rows, frame, 7))


def test_wrapping_multiply_hash_equals_the_split_multiply():
    gen = torch.Generator().manual_seed(5)
    x = torch.cat([torch.randint(0, 2**32, (100_000,), generator=gen),
                   torch.tensor([0, 1, 2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1])])
    from bench.kernels.sampling import _mix32 as split_mix32

    assert torch.equal(_mix32(x), split_mix32(x))


# pinned before the change: noise_key(seed, frame, 5) and the 32-bit hash at indices 0, 1, 2, 511, 1023
PIN_SEED = [0, 1, 123456789, 2**40 + 5, -7]
PIN_FRAME = [0, 3, 77, 1000, 2**33 + 1]
PIN_KEYS = [1548080446, 3434345294, 4216071243, 1786666335, 3551797435]
PIN_HASH = [[0x4FB46240, 0xF3A97008, 0xBBA2F368, 0x9039E343, 0x199914A],
            [0x70F38345, 0xC7B358B3, 0xE7AC0E77, 0x9606C68D, 0x37670B08],
            [0x3C1E12F4, 0xF3DCCBAB, 0x145A1283, 0x6110F486, 0x67926757],
            [0xDA2C3F9D, 0x29ADAF2, 0x327D8C5F, 0x16DAF616, 0xF471B98D],
            [0x1FD61216, 0xEA4211CE, 0x2EA3FA31, 0x61A7A3AF, 0x5A08E522]]
PIN_NOISE = [["0x1.2ab6acp+0", "0x1.94a6e0p-5", "0x1.3e2074p-2", "0x1.25c876p-1", "0x1.44d0eap+2"],
             ["0x1.a2ede8p-1", "0x1.fca354p-3", "0x1.990104p-4", "0x1.119864p-1", "0x1.87d248p+0"],
             ["0x1.72e99ap+0", "0x1.8de8dep-5", "0x1.4418c4p+1", "0x1.f08784p-1", "0x1.cf508ep-1"],
             ["0x1.47744ep-3", "0x1.259e42p+2", "0x1.9f96bcp+0", "0x1.353f46p+1", "0x1.7a63e0p-5"],
             ["0x1.0ad348p+1", "0x1.6b8950p-4", "0x1.b3e4a0p+0", "0x1.ed6f1ap-1", "0x1.0b83ecp+0"]]


def test_noise_values_are_pinned():
    seed, frame = torch.tensor(PIN_SEED), torch.tensor(PIN_FRAME)
    key = noise_key(seed, frame, 5)
    assert key.tolist() == PIN_KEYS
    index = torch.tensor([0, 1, 2, 511, 1023])
    assert _mix32(_mix32(key[:, None] ^ index)).tolist() == PIN_HASH
    noise = exponential_noise(seed, frame, 5, V)[:, index]
    # the hash above fixes every draw exactly; the float32 log of it is within one ulp of the pin
    # (torch's vectorised log differs by an ulp in places between CPU instruction sets, AVX2 and
    # AVX-512)
    pinned = np.array([[float.fromhex(v) for v in row] for row in PIN_NOISE], dtype=np.float32)
    assert (np.abs(noise.numpy() - pinned) <= np.spacing(pinned)).all()
    by_index = exponential_noise(seed, frame, 5, index.expand(5, -1).contiguous())
    assert by_index.tolist() == noise.tolist()
