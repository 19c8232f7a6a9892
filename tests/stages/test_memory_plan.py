"""The GPU memory plan: every shipped GPU profile fits an 80 GB H100 and a 141 GB H200 with the
full-size Local-v1.5 checkpoint's shapes; smaller cards are refused at once, naming the settings.

The checkpoint here has the real configs and full-size safetensors headers over sparse files (no
weights are written: the plan reads only headers).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from profiles import load_profile
from stages.memory import replica_memory_needs, tensor_bytes
from stages.registry import load_variant
from stages.runtime.memory_plan import GIB, MIN_TOKENS_PER_STREAM, MemoryNeeds, MemoryPlanError, plan_memory
from stages.tools import make_checkpoint as mc

H100 = 85_029_158_912  # what CUDA reports as an H100 80 GB HBM3's total memory
H200 = 150_012_297_216  # an H200 141 GB
GPU_PROFILES = ("default", "low-latency", "high-concurrency")


def _header_only(module, path: Path) -> int:
    """A safetensors file of `module`'s tensors in bf16 whose data is a hole (sparse); its size."""
    header, offset = {}, 0
    for name, t in module.state_dict().items():
        n = t.numel() * 2
        header[name] = {"dtype": "BF16", "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        f.truncate(8 + len(raw) + offset)
    return offset


@pytest.fixture(scope="module")
def full_size(tmp_path_factory) -> tuple[Path, int, int]:
    """(checkpoint dir, talker bytes, codec bytes) of a shapes-only full-size Local-v1.5."""
    out = tmp_path_factory.mktemp("l15")
    rec = mc.recipe("local-v1.5")
    config = rec.finish_config(dict(rec.talker_config("full"), dtype="bfloat16"))
    (out / "config.json").write_text(json.dumps(config))
    talker = _header_only(mc._meta_talker(config), out / "model.safetensors")
    codec_dir = out / "audio_tokenizer"
    codec_dir.mkdir()
    codec_config = rec.codec_config("full")
    (codec_dir / "config.json").write_text(json.dumps(codec_config))
    codec = _header_only(mc._meta_codec(codec_config), codec_dir / "model.safetensors")
    return out, talker, codec


def test_weights_are_read_from_the_headers(full_size) -> None:
    model_dir, talker, codec = full_size
    variant = load_variant(model_dir, load_profile("default"))
    needs = replica_memory_needs(variant, "cuda:0")
    assert needs.talker_weights == talker  # the audio tokenizer's file is not the talker's
    assert needs.codec_weights == codec == tensor_bytes([model_dir / "audio_tokenizer" / "model.safetensors"], 2)
    assert 7 * GIB < talker < 8.5 * GIB and 3.5 * GIB < codec < 4.5 * GIB  # ~4.1 B and ~2.1 B parameters


@pytest.mark.parametrize("card", [H100, H200], ids=["H100", "H200"])
@pytest.mark.parametrize("name", GPU_PROFILES)
def test_every_gpu_profile_plans_on_h100_and_h200(full_size, name: str, card: int) -> None:
    profile = load_profile(name)
    plan = load_variant(full_size[0], profile).memory_plan("cuda:0", card)
    assert plan.talker.total + plan.codec.total <= plan.usable <= card
    assert plan.kv_tokens >= profile.talker.max_running * MIN_TOKENS_PER_STREAM
    assert plan.kv_tokens == plan.kv_blocks * profile.talker.kv_block_size
    assert plan.codec.state >= profile.codec.max_slots * 100 * 2**20  # ~120 MB of ring caches a slot
    assert f"{card / GIB:.1f} GiB card" in plan.describe()


@pytest.mark.parametrize(("name", "gb"), [(name, 24) for name in GPU_PROFILES]
                         + [("default", 48), ("high-concurrency", 48)])
def test_a_card_too_small_is_refused_naming_what_to_change(full_size, name: str, gb: int) -> None:
    with pytest.raises(MemoryPlanError) as refused:
        load_variant(full_size[0], load_profile(name)).memory_plan("cuda:0", gb * 10**9)
    message = str(refused.value)
    for setting in ("talker.max_running", "codec.max_slots", "memory.gpu_utilization"):
        assert setting in message


def test_low_latency_fits_a_48_gb_card(full_size) -> None:
    """64 streams and their 64 decode slots leave a 48 GB card room for a KV cache."""
    plan = load_variant(full_size[0], load_profile("low-latency")).memory_plan("cuda:0", 48 * 10**9)
    assert plan.kv_tokens >= 64 * MIN_TOKENS_PER_STREAM


def test_the_plan_is_the_same_whoever_computes_it(full_size) -> None:
    """Both workers (and a restarted one) plan from the card's total, not from what is free."""
    variant = load_variant(full_size[0], load_profile("high-concurrency"))
    assert variant.memory_plan("cuda:0", H100) == variant.memory_plan("cuda:0", H100)


def _needs(**kw) -> MemoryNeeds:
    base = dict(talker_weights=8 * GIB, talker_workspace=2 * GIB, kv_block_bytes=GIB // 64, kv_block_tokens=16,
                max_running=4, codec_weights=4 * GIB, codec_state=2 * GIB, codec_workspace=2 * GIB)
    return MemoryNeeds(**(base | kw))


def test_the_kv_cache_is_what_the_rest_leaves() -> None:
    # codec 4 + 2 + 2 + 1 (context), talker 8 + 2 + 1 (context): 20 GiB usable leave no KV cache
    with pytest.raises(MemoryPlanError, match="KV cache needs at least"):
        plan_memory(_needs(), card=40 * GIB, utilization=0.5)
    plan = plan_memory(_needs(), card=40 * GIB, utilization=0.75)  # 30 GiB usable: 10 GiB of KV
    assert plan.codec.total == 9 * GIB
    assert plan.talker.state == 10 * GIB and plan.kv_blocks == 640 and plan.kv_tokens == 640 * 16
    assert plan.talker.total + plan.codec.total == plan.usable


def test_fixed_kv_blocks_must_fit() -> None:
    plan = plan_memory(_needs(kv_blocks=64), card=40 * GIB, utilization=0.75)
    assert plan.kv_blocks == 64 and plan.talker.state == GIB
    with pytest.raises(MemoryPlanError, match="talker.kv_blocks 6400"):
        plan_memory(_needs(kv_blocks=6400), card=40 * GIB, utilization=0.75)
