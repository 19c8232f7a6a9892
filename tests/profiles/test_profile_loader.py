"""Profile loading: shipped profiles, base inheritance, --set precedence, hashing, round trip."""

import textwrap
from pathlib import Path

import msgspec
import pytest

import profiles
from profiles import Profile, load_profile, parse_override, shipped_profiles


def write(path, text):
    path.write_text(textwrap.dedent(text))
    return path


def test_shipped_profiles_are_the_four_documented_ones():
    assert shipped_profiles() == ["cpu", "default", "high-concurrency", "low-latency"]


@pytest.mark.parametrize("name", ["default", "low-latency", "high-concurrency", "cpu"])
def test_every_shipped_profile_loads(name):
    assert isinstance(load_profile(name), Profile)


def test_default_profile_is_the_schema_defaults():
    assert load_profile() == load_profile("default") == Profile()


def test_cpu_profile_suits_the_tiny_random_weight_model():
    p = load_profile("cpu")
    assert (p.model.device, p.model.dtype, p.model.force_length_from_text) == ("cpu", "float32", True)
    assert not (p.talker.cuda_graphs or p.codec.cuda_graphs or p.engine.mps)
    assert p.talker.max_running < Profile().talker.max_running
    assert p.model.path is None  # the embedded demo model


def test_tuned_profiles_differ_from_default_where_they_say():
    default, low, high = (load_profile(n) for n in ("default", "low-latency", "high-concurrency"))
    assert low.coalescing.max_wait_ms < high.coalescing.max_wait_ms
    assert low.coalescing.min_batch < high.coalescing.min_batch
    assert low.model == default.model == high.model  # inherited untouched


@pytest.mark.parametrize("name", ["default", "low-latency", "high-concurrency", "cpu"])
def test_no_shipped_profile_changes_precision(name):
    """Precision changes are opt-in until `mossvox check-precision` shows them safe: every shipped
    profile serves the model's dtype, no float8 weights or KV cache, the checkpoint's erf GELU."""
    t, c = load_profile(name).talker, load_profile(name).codec
    assert (t.fp8_weights, t.kv_cache_dtype, c.gelu_epilogue) == ("none", "auto", False)
    assert not (t.fp8_fused_swiglu or t.fp8_fused_scales or t.fp8_fused_norms)


def test_the_float8_backbone_stays_one_opt_in_away():
    """high-concurrency's comment names the settings that opt in; with them it loads, its fused
    layers as the float8 kernels need them."""
    text = (Path(profiles.__file__).parent / "high-concurrency.yaml").read_text()
    line = next(x for x in text.splitlines() if "fp8_weights:" in x)
    sets = [f"talker.{kv.strip().replace(': ', '=')}" for kv in line.lstrip("# ").split(",")]
    assert sets == ["talker.fp8_weights=backbone", "talker.fp8_scheme=w8a8", "talker.fp8_fused_swiglu=true",
                    "talker.fp8_fused_scales=true"]
    assert "mossvox check-precision" in text
    p = load_profile("high-concurrency", sets).talker
    assert (p.fp8_weights, p.fp8_scheme, p.fp8_fused_swiglu, p.fp8_fused_scales) == ("backbone", "w8a8", True, True)


def test_base_chain_merges_mappings_and_replaces_scalars_and_lists(tmp_path):
    write(tmp_path / "base.yaml", """
        talker: {max_running: 8, kv_block_size: 32, cuda_graphs: false}
        api: {keys: [a, b], port: 9000}
        chunking: {ramp: [2, 4, 8]}
        model: {device: cpu}
        codec: {cuda_graphs: false}
        engine: {mps: false}
        admission: {max_running: 8}
        """)
    child = write(tmp_path / "child.yaml", """
        base: ./base.yaml
        talker: {max_running: 4}
        api: {keys: [c]}
        chunking: {ramp: [3]}
        admission: {max_running: 4}
        """)
    p = load_profile(str(child))
    assert p.talker.max_running == 4  # scalar replaced by the child
    assert p.talker.kv_block_size == 32  # sibling kept from the base (nested merge)
    assert p.api.keys == ("c",) and p.chunking.ramp == (3,)  # lists replace, never append
    assert p.api.port == 9000 and p.model.device == "cpu"
    assert p.coalescing == Profile().coalescing  # untouched section keeps schema defaults


def test_base_by_shipped_name_and_three_levels(tmp_path):
    mid = write(tmp_path / "mid.yaml", "base: cpu\ntalker: {kv_block_size: 8}\n")
    (tmp_path / "sub").mkdir()
    write(tmp_path / "sub" / "top.yaml", "base: ../mid.yaml\nadmission: {max_queued: 7}\n")
    p = load_profile(str(tmp_path / "sub" / "top.yaml"))
    assert p.model.device == "cpu"  # from cpu, two levels up
    assert p.talker.kv_block_size == 8  # from mid
    assert p.admission.max_queued == 7  # from top
    assert load_profile(str(mid)).admission.max_queued == load_profile("cpu").admission.max_queued


def test_set_beats_the_file_and_its_base_and_later_set_wins(tmp_path):
    write(tmp_path / "base.yaml", "coalescing: {max_wait_ms: 1, min_batch: 2}\n")
    child = write(tmp_path / "child.yaml", "base: base.yaml\ncoalescing: {max_wait_ms: 5}\n")
    assert load_profile(str(child)).coalescing.max_wait_ms == 5
    p = load_profile(str(child), ["coalescing.max_wait_ms=9", "coalescing.min_batch=3"])
    assert (p.coalescing.max_wait_ms, p.coalescing.min_batch) == (9, 3)
    p = load_profile(str(child), ["coalescing.max_wait_ms=9", "coalescing.max_wait_ms=0.25"])
    assert p.coalescing.max_wait_ms == 0.25


def test_override_values_are_yaml(tmp_path):
    p = load_profile("cpu", [
        "api.keys=[k1, k2]", "model.path=/models/moss", "talker.kv_blocks=null",
        "engine.mps=false", "coalescing.max_wait_ms=2e-3", "talker={kv_block_size: 8}",
    ])
    assert p.api.keys == ("k1", "k2")
    assert p.model.path == "/models/moss"
    assert p.talker.kv_blocks is None
    assert p.coalescing.max_wait_ms == 0.002
    assert p.talker.kv_block_size == 8 and p.talker.max_running == 16  # a section set merges
    assert parse_override("model.path=") == (("model", "path"), None)  # empty value is null


def test_profile_is_frozen():
    p = load_profile("cpu")
    with pytest.raises(AttributeError):
        p.talker.max_running = 3  # type: ignore[misc]


def test_sha256_is_stable_and_sensitive(tmp_path):
    a, b = load_profile("cpu"), load_profile("cpu")
    assert a.sha256() == b.sha256() and len(a.sha256()) == 64
    assert load_profile("cpu", ["talker.max_running=16"]).sha256() == a.sha256()  # same values
    assert load_profile("cpu", ["talker.kv_block_size=8"]).sha256() != a.sha256()
    assert load_profile("cpu", ["coalescing.max_wait_ms=0.5"]).sha256() != a.sha256()
    assert load_profile("default").sha256() != a.sha256()


def test_to_yaml_round_trips_to_an_equal_profile(tmp_path):
    p = load_profile("high-concurrency", ["api.keys=[x]", "chunking.ramp=[2, 4]"])
    path = tmp_path / "dump.yaml"
    path.write_text(p.to_yaml())
    again = load_profile(str(path))
    assert again == p and again.sha256() == p.sha256()
    assert msgspec.yaml.decode(path.read_bytes(), type=Profile) == p  # plain msgspec reads it too
