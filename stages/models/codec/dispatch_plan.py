"""How one codec dispatch's chunks are split into decode calls: fewest modelled milliseconds.

A dispatch holds one chunk per stream, of mixed lengths (first chunks of 1 frame, ramp chunks,
steady chunks of 15, final partial chunks). The streaming decoder takes rows of different real
lengths in one call, padded to the call's length T (`StreamingDecoder.decode(valid=...)`), so the
chunks could always go in one call; but a padded frame costs as much as a real one. A call costs
about `fixed + per_row * B + per_row_frame * B * T` (B = the rows' batch bucket), measured on an
H200 for the full-size v2 codec from CUDA-graph replays (docs/performance-history.md): a fixed ~10 ms per
call (thousands of small kernels), ~0.06 ms per row whatever T (reading the row's ring caches) and
~0.046 ms per row and frame. So a few 1-frame chunks padded to 15 frames cost more than a second
call, and many of them cost less. `plan` sorts the chunks by length and picks the contiguous
groups that minimise the modelled total (an exact search over the distinct lengths).
`plan_pieces` may also cut a chunk into rows of a shorter call (its pieces, one slot), when that
models cheaper than padding its neighbours to its length.

With decode lanes (`CodecRunner`'s `decode_lanes`) the calls of a dispatch replay side by side,
one lane each in turn, and a dispatch takes about its longest lane's time, not the sum: `spread`
then splits the costliest call's rows in halves (same length) while calls are fewer than lanes
and the halves, side by side, model shorter than the whole. Without it a dispatch planned into
one call would leave every other lane idle.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CallCost:
    """Modelled milliseconds of one decode call of B rows (a batch bucket) padded to T frames."""

    fixed_ms: float = 10.0
    row_ms: float = 0.06
    row_frame_ms: float = 0.046

    def __call__(self, rows: int, frames: int) -> float:
        return self.fixed_ms + rows * (self.row_ms + self.row_frame_ms * frames)

    @classmethod
    def fit(cls, small: tuple[int, int, float], wide: tuple[int, int, float],
            long: tuple[int, int, float]) -> CallCost:
        """The model through three timed calls (rows, frames, ms): `small` and `wide` of one frame
        length and different row counts, `long` with `wide`'s rows and more frames. Negative
        terms (timing noise) are clipped to zero."""
        (b1, t1, ms1), (b2, t2, ms2), (b3, t3, ms3) = small, wide, long
        if b1 == b2 or t2 == t3 or t1 != t2 or b2 != b3:
            raise ValueError("fit needs two row counts at one length and two lengths at one row count")
        row_frame = max(0.0, (ms3 - ms2) / (b2 * (t3 - t2)))
        per_row = max(0.0, (ms2 - ms1) / (b2 - b1) - row_frame * t1)
        fixed = max(0.0, ms1 - b1 * (per_row + row_frame * t1))
        return cls(fixed, per_row, row_frame)


def _by_length(lengths: Sequence[int], longest: int) -> tuple[dict[int, list[int]], list[int], list[int]]:
    """The chunks by length: ({length: indices}, the distinct lengths ascending, their counts);
    ValueError for a length outside 1..longest (the longest call)."""
    if min(lengths) < 1 or max(lengths) > longest:
        raise ValueError(f"chunk lengths {sorted(set(lengths))} outside 1..{longest}")
    by_length: dict[int, list[int]] = {}
    for index, n in enumerate(lengths):
        by_length.setdefault(n, []).append(index)
    distinct = sorted(by_length)
    return by_length, distinct, [len(by_length[n]) for n in distinct]


def plan(lengths: Sequence[int], call_frames: Sequence[int], bucket: Callable[[int], int],
         cost: CallCost) -> list[tuple[int, list[int]]]:
    """Split chunks of these `lengths` (each 1 <= length <= max(call_frames)) into calls:
    [(T, indices into lengths)], T taken from `call_frames` (the lengths with graphs), each call
    padding its chunks to T. The calls come shortest first."""
    frames = sorted(set(call_frames))
    if not lengths:
        return []
    by_length, distinct, counts = _by_length(lengths, frames[-1])

    def call_length(longest: int) -> int:
        return next(t for t in frames if t >= longest)

    # best[j]: least cost of the first j distinct lengths; cut[j]: where its last call starts
    best = [0.0] + [float("inf")] * len(distinct)
    cut = [0] * (len(distinct) + 1)
    for j in range(1, len(distinct) + 1):
        rows = 0
        for i in range(j - 1, -1, -1):  # the last call takes distinct lengths i..j-1
            rows += counts[i]
            total = best[i] + cost(bucket(rows), call_length(distinct[j - 1]))
            if total < best[j]:
                best[j], cut[j] = total, i
    calls: list[tuple[int, list[int]]] = []
    j = len(distinct)
    while j > 0:
        i = cut[j]
        calls.append((call_length(distinct[j - 1]), [x for n in distinct[i:j] for x in by_length[n]]))
        j = i
    return calls[::-1]


Piece = tuple[int, int, int]  # (chunk index, first frame within the chunk, frames): one row of a call


def plan_pieces(lengths: Sequence[int], call_frames: Sequence[int], bucket: Callable[[int], int],
                cost: CallCost, max_rows: int, max_span: int) -> list[tuple[int, list[Piece]]]:
    """As `plan`, but a call may be shorter than its chunks: a chunk of n frames goes into a call
    of T < n frames as ceil(n / T) rows of its slot, its pieces in order (`StreamingDecoder.decode`
    with `offset`), so 1-frame and 15-frame chunks can share a call of 2 frames instead of every
    short chunk padding to 15 (a padded frame costs as much as a real one). Every chunk stays in
    one call. Each call holds at most `max_rows` rows; T is any of `call_frames` such that a cut
    chunk's rows, the last one padded to T, span at most `max_span` frames (the decoder's ring
    headroom, `StreamingDecoder.headroom_frames`). Returns
    [(T, [(chunk index, first frame, frames), ...])], the calls shortest first."""
    frames = sorted(set(call_frames))
    if not lengths:
        return []
    if len(lengths) > max_rows:
        raise ValueError(f"{len(lengths)} chunks exceed {max_rows} rows a call")
    by_length, distinct, counts = _by_length(lengths, frames[-1])

    # best[j]: least cost of the first j distinct lengths; choice[j]: (start of its last call, T)
    best = [0.0] + [float("inf")] * len(distinct)
    choice = [(0, frames[-1])] * (len(distinct) + 1)
    for j in range(1, len(distinct) + 1):
        for i in range(j - 1, -1, -1):  # the last call takes distinct lengths i..j-1
            for T in frames:
                if T < distinct[j - 1] and -(-distinct[j - 1] // T) * T > max_span:
                    continue  # the longest would span past the headroom (shorter ones span less)
                rows = sum(counts[k] * -(-distinct[k] // T) for k in range(i, j))
                if rows > max_rows:
                    continue
                total = best[i] + cost(bucket(rows), T)
                if total < best[j]:
                    best[j], choice[j] = total, (i, T)
    calls: list[tuple[int, list[Piece]]] = []
    j = len(distinct)
    while j > 0:
        i, T = choice[j]
        calls.append((T, [(m, first, min(T, n - first)) for n in distinct[i:j] for m in by_length[n]
                          for first in range(0, n, T)]))
        j = i
    return sorted(calls[::-1], key=lambda call: call[0])


def spread(calls: list[tuple[int, list[int]]], lanes: int, bucket: Callable[[int], int],
           cost: CallCost) -> list[tuple[int, list[int]]]:
    """`plan`'s calls for `lanes` lanes side by side: while there are fewer calls than lanes, the
    costliest one with two or more rows is split into two halves of the same length T when the
    slower half models shorter than the whole call. The calls come shortest first."""
    calls = list(calls)
    while len(calls) < lanes:
        splittable = [i for i, (_, members) in enumerate(calls) if len(members) > 1]
        if not splittable:
            break
        k = max(splittable, key=lambda i: cost(bucket(len(calls[i][1])), calls[i][0]))
        T, members = calls[k]
        first, second = members[: (len(members) + 1) // 2], members[(len(members) + 1) // 2:]
        if cost(bucket(len(first)), T) >= cost(bucket(len(members)), T):
            break
        calls[k: k + 1] = [(T, first), (T, second)]
    return calls
