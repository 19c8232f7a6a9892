"""The schema itself: documented fields and the cross-field checks."""

import re

import msgspec
import pytest

from profiles import CrossFieldError, Profile, ProfileError, load_profile
from profiles.loader import PROFILE_DIR


def test_every_field_has_a_description():
    defs = msgspec.json.schema(Profile)["$defs"]
    sections = defs["Profile"]["properties"]
    assert set(sections) == {"model", "talker", "codec", "chunking", "coalescing", "admission",
                             "api", "stream", "ipc", "engine", "memory"}
    undocumented = [
        f"{section}.{name}"
        for section, ref in sections.items()
        for name, spec in defs[ref["$ref"].rsplit("/", 1)[1]]["properties"].items()
        if len(spec.get("description", "")) < 10
    ]
    assert undocumented == []


# what a measurement reads like: a card, a concurrency level, a ratio, a throughput figure
MEASUREMENT = re.compile(r"\bH[12]00\b|\bC=\d|\b\d+(\.\d+)?x\b|audio-s/s|\bpasses\b|\bmeasured (on|at)\b")


def test_descriptions_and_profile_comments_say_what_not_how_it_was_measured():
    """A setting's description is one or two lines (what it does, when to change it, its unit);
    figures live in docs/performance.md, not in the schema or the profile files."""
    defs = msgspec.json.schema(Profile)["$defs"]
    for section, ref in defs["Profile"]["properties"].items():
        for name, spec in defs[ref["$ref"].rsplit("/", 1)[1]]["properties"].items():
            text = spec["description"]
            assert len(text) <= 300, f"{section}.{name}: {len(text)} characters"
            assert not MEASUREMENT.search(text), f"{section}.{name}: {text}"
    for path in PROFILE_DIR.glob("*.yaml"):
        comments = [line.partition("#")[2] for line in path.read_text().splitlines() if "#" in line]
        found = [c for c in comments if MEASUREMENT.search(c)]
        assert found == [], f"{path.name}: {found}"


@pytest.mark.parametrize("overrides, paths", [
    (["chunking.initial_chunk_frames=20"], ("chunking.initial_chunk_frames", "chunking.chunk_frames")),
    (["chunking.ramp=[2, 30]"], ("chunking.ramp[1]", "chunking.chunk_frames")),
    (["coalescing.min_batch=20"], ("coalescing.min_batch", "coalescing.max_batch")),
    (["coalescing.max_batch=32"], ("coalescing.max_batch", "codec.max_slots")),
    (["admission.max_running=32"], ("admission.max_running", "talker.max_running")),
    (["talker.prefill_chunk_tokens=4096"], ("talker.prefill_chunk_tokens",
                                             "talker.max_prefill_tokens_per_step")),
    (["api.min_ref_seconds=40"], ("api.min_ref_seconds", "api.max_ref_seconds")),
    (["talker.cuda_graphs=true"], ("talker.cuda_graphs", "model.device")),
    (["engine.mps=true"], ("engine.mps", "model.device")),
    (["talker.batch_invariant=true", "talker.attention=padded"], ("talker.batch_invariant", "talker.attention")),
    (["talker.batch_invariant=true", "talker.tensor_parallel=2"], ("talker.batch_invariant",
                                                                   "talker.tensor_parallel")),
    (["codec.split_chunks=true", "codec.decode_lanes=2"], ("codec.split_chunks", "codec.decode_lanes")),
    (["codec.fused_norms=true"], ("codec.fused_norms", "codec.fused_ring_writes")),
    (["codec.fused_attention=true"], ("codec.fused_attention", "codec.fused_ring_writes")),
    (["talker.batch_invariant=true", "talker.local_attention=plain"], ("talker.batch_invariant",
                                                                       "talker.local_attention")),
    (["talker.batch_invariant=true", "talker.fp8_weights=backbone"], ("talker.batch_invariant",
                                                                       "talker.fp8_weights")),
    (["talker.batch_invariant=true", "codec.split_chunks=true"], ("talker.batch_invariant",
                                                                   "codec.split_chunks")),
    (["talker.batch_invariant=true", "codec.decode_lanes=2"], ("talker.batch_invariant",
                                                                "codec.decode_lanes")),
    (["talker.overlap_steps=true", "talker.max_step_ms=20"], ("talker.max_step_ms", "talker.overlap_steps")),
])
def test_cross_field_checks_name_both_fields(overrides, paths):
    with pytest.raises(ProfileError) as info:
        load_profile("cpu", overrides)
    message = str(info.value)
    assert all(path in message for path in paths), message


def test_cross_field_checks_pass_at_the_boundary():
    p = load_profile("cpu", ["chunking.initial_chunk_frames=15", "chunking.ramp=[15]",
                             "coalescing.min_batch=16", "api.min_ref_seconds=30"])
    assert p.chunking.initial_chunk_frames == p.chunking.chunk_frames


def test_replace_reruns_the_cross_field_checks():
    p = load_profile("cpu")
    narrower = msgspec.structs.replace(p, codec=msgspec.structs.replace(p.codec, max_slots=16))
    assert narrower == p
    with pytest.raises(CrossFieldError) as info:
        msgspec.structs.replace(p, codec=msgspec.structs.replace(p.codec, max_slots=4))
    assert info.value.paths == ("coalescing.max_batch", "codec.max_slots")


@pytest.mark.parametrize("name", ["default", "low-latency", "high-concurrency", "cpu"])
def test_batch_invariance_is_off_in_every_shipped_profile_until_measured(name):
    assert load_profile(name).talker.batch_invariant is False
