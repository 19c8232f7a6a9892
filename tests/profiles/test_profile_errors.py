"""Every way a profile can be wrong yields a ProfileError naming the key path and its source."""

import textwrap

import pytest

from profiles import ProfileError, load_profile


def write(path, text):
    path.write_text(textwrap.dedent(text))
    return str(path)


def error(name_or_path, overrides=()):
    with pytest.raises(ProfileError) as info:
        load_profile(name_or_path, overrides)
    return info.value


def test_unknown_key_names_its_path_its_file_and_a_suggestion(tmp_path):
    path = write(tmp_path / "p.yaml", "base: cpu\ncoalescing:\n  max_wait_msec: 3\n")
    exc = error(path)
    assert exc.key_path == "coalescing.max_wait_msec"
    assert exc.sources == (path,)
    assert path in str(exc) and "did you mean coalescing.max_wait_ms" in str(exc)


def test_unknown_key_in_a_base_names_the_base_file_not_the_child(tmp_path):
    base = write(tmp_path / "base.yaml", "talker: {turbo: true}\n")
    child = write(tmp_path / "child.yaml", "base: base.yaml\ntalker: {max_running: 4}\n")
    exc = error(child)
    assert exc.key_path == "talker.turbo" and exc.sources == (base,)


def test_unknown_section(tmp_path):
    exc = error(write(tmp_path / "p.yaml", "scheduler: {x: 1}\n"))
    assert exc.key_path == "scheduler" and "unknown key" in str(exc)


def test_bad_type_names_the_file_that_set_the_value(tmp_path):
    base = write(tmp_path / "base.yaml", "talker: {max_running: many}\n")
    child = write(tmp_path / "child.yaml", "base: base.yaml\ntalker: {kv_block_size: 8}\n")
    exc = error(child)
    assert exc.key_path == "talker.max_running" and exc.sources == (base,)
    assert "Expected `int`, got `str`" in str(exc)


def test_bad_list_item_names_its_index(tmp_path):
    exc = error(write(tmp_path / "p.yaml", "api: {keys: [ok, 3]}\n"))
    assert exc.key_path == "api.keys[1]"


def test_constraint_violation(tmp_path):
    path = write(tmp_path / "p.yaml", "coalescing: {max_wait_ms: -1}\n")
    exc = error(path)
    assert exc.key_path == "coalescing.max_wait_ms" and ">= 0" in str(exc) and path in str(exc)


def test_value_outside_a_literal_choice():
    exc = error("default", ["model.device=tpu"])
    assert exc.key_path == "model.device" and "tpu" in str(exc)
    assert exc.sources == ("--set model.device=tpu",)


def test_bad_override_value_names_the_override():
    exc = error("cpu", ["talker.max_running=0"])
    assert exc.key_path == "talker.max_running" and "--set talker.max_running=0" in str(exc)


@pytest.mark.parametrize("override, key_path", [
    ("talker.max_runing=3", "talker.max_runing"),
    ("nosuch.section=1", "nosuch.section"),
    ("talker.max_running.deeper=1", "talker.max_running.deeper"),
])
def test_unknown_override_path_is_named(override, key_path):
    exc = error("cpu", [override])
    assert exc.key_path == key_path and exc.sources == (f"--set {override}",)
    assert key_path in str(exc) and override in str(exc)


@pytest.mark.parametrize("override", ["talker.max_running", "=3", "talker..max_running=3",
                                      "talker.max_running=[1, 2"])
def test_malformed_override(override):
    exc = error("cpu", [override])
    assert "malformed override" in str(exc) and repr(override) in str(exc)


def test_missing_base_file_names_the_referrer(tmp_path):
    child = write(tmp_path / "child.yaml", "base: ./nowhere.yaml\n")
    exc = error(child)
    assert "nowhere.yaml" in str(exc) and child in str(exc)


def test_unknown_base_name_lists_the_shipped_profiles(tmp_path):
    exc = error(write(tmp_path / "child.yaml", "base: turbo\n"))
    assert "'turbo'" in str(exc) and "low-latency" in str(exc)


def test_unknown_profile_name_and_missing_path():
    assert "unknown profile 'nope'" in str(error("nope"))
    assert "not found" in str(error("/no/such/profile.yaml"))


def test_cycle_in_base_names_the_chain(tmp_path):
    a = write(tmp_path / "a.yaml", "base: b.yaml\n")
    b = write(tmp_path / "b.yaml", "base: a.yaml\n")
    message = str(error(a))
    assert "cycle in base" in message and f"{a} -> {b} -> {a}" in message


def test_self_reference_is_a_cycle(tmp_path):
    a = write(tmp_path / "a.yaml", "base: a.yaml\n")
    assert f"cycle in base: {a} -> {a}" in str(error(a))


def test_base_must_be_a_string(tmp_path):
    assert "base" in str(error(write(tmp_path / "p.yaml", "base: [cpu]\n")))


def test_profile_must_be_a_mapping(tmp_path):
    assert "must be a mapping" in str(error(write(tmp_path / "p.yaml", "- cpu\n")))


def test_yaml_syntax_error_names_the_file(tmp_path):
    path = write(tmp_path / "p.yaml", "talker: {max_running: 3\n")
    assert path in str(error(path))


def test_cross_field_error_names_both_fields_and_their_sources(tmp_path):
    path = write(tmp_path / "p.yaml", "base: cpu\ncoalescing: {min_batch: 12}\n")
    exc = error(path, ["coalescing.max_batch=8"])
    message = str(exc)
    assert "coalescing.min_batch (12)" in message and "coalescing.max_batch (8)" in message
    assert exc.sources == (path, "--set coalescing.max_batch=8")


def test_duplicate_key_in_one_file_is_an_error_not_a_silent_override(tmp_path):
    path = write(tmp_path / "p.yaml", """
        talker:
          max_running: 8
          max_running: 4
        """)
    message = str(error(path))
    assert "duplicate key 'max_running'" in message and path in message


def test_same_key_in_base_and_child_is_not_a_duplicate(tmp_path):
    write(tmp_path / "base.yaml", "talker: {kv_block_size: 8}\n")
    child = write(tmp_path / "child.yaml", "base: base.yaml\ntalker: {kv_block_size: 32}\n")
    assert load_profile(child).talker.kv_block_size == 32
