"""Random-weight checkpoints: seeded per-tensor weights, sharding + index, loadable by the loaders,
a tokenizer whose special ids match the config, and the embedded demo model."""

import hashlib
import json
import logging

import pytest
import torch
from safetensors import safe_open

from cli.main import main as cli_main
from stages.models.codec.loader import load_codec
from stages.models.local_v15.loader import load_talker
from stages.models.local_v15.processor import LocalV15Processor
from stages.runtime.checkpoint import INDEX_FILE, read_state_dict
from stages.runtime.tokenizer import TextTokenizer
from stages.tools import demo_model
from stages.tools.demo_model import demo_key, ensure_demo_model
from stages.tools.make_checkpoint import (
    CODEC_DIR,
    DEFAULT_SHARD_BYTES,
    _meta_talker,
    codec_config,
    make_checkpoint,
    talker_config,
    write_codec,
    write_talker,
)
from stages.tools.random_weights import (TensorSpec, module_specs, plan_shards, random_tensor, tensor_seed,
                                         write_weights)
from stages.tools.tokenizer_builder import build_tokenizer, write_tokenizer_files
from tests.conftest import golden_dir

QWEN_IDS = dict(
    pad_token_id=151643, im_start_token_id=151644, im_end_token_id=151645,
    audio_start_token_id=151669, audio_end_token_id=151670, audio_user_slot_token_id=151654,
    audio_assistant_slot_token_id=151656, audio_assistant_gen_slot_token_id=151656, n_vq=12,
    audio_pad_token_id=1024,
)


def test_tensor_values_depend_only_on_seed_and_name():
    spec = TensorSpec("a.weight", (4, 8), "matrix")
    a = random_tensor(spec, 7, "talker", torch.float32)
    assert torch.equal(a, random_tensor(spec, 7, "talker", torch.float32))
    assert not torch.equal(a, random_tensor(spec, 8, "talker", torch.float32))
    assert not torch.equal(a, random_tensor(TensorSpec("b.weight", (4, 8), "matrix"), 7, "talker", torch.float32))
    assert tensor_seed(7, "a.weight") == int(hashlib.sha256(b"7:a.weight").hexdigest()[:8], 16)


def test_init_rules():
    big = (512, 256)
    norm = random_tensor(TensorSpec("n.weight", (4096,), "norm_weight"), 0, "talker", torch.float32)
    assert abs(norm.mean() - 1) < 0.01 and abs(norm.std() - 0.1) < 0.01
    codec_w = random_tensor(TensorSpec("l.weight", big, "matrix"), 0, "codec", torch.float32)
    assert abs(codec_w.std() - 256 ** -0.5) < 0.003
    talker_w = random_tensor(TensorSpec("t.weight", (64, 32), "matrix"), 0, "talker", torch.float32)
    assert abs(talker_w.std() - 0.1) < 0.01  # tiny: the golden N(0, 0.1^2)
    g = random_tensor(TensorSpec("c.parametrizations.weight.original0", (64, 1, 1), "wn_g"), 0, "codec", torch.float32)
    assert (g > 0).all()
    bf = random_tensor(TensorSpec("t.weight", (64, 32), "matrix"), 0, "talker", torch.bfloat16)
    assert bf.dtype == torch.bfloat16 and torch.equal(bf, talker_w.to(torch.bfloat16))


def test_plan_shards_respects_the_limit_and_keeps_order():
    specs = [TensorSpec(f"t{i}", (100,), "bias") for i in range(10)]  # 400 bytes each in fp32
    shards = plan_shards(specs, torch.float32, 1000)
    assert [len(s) for s in shards] == [2, 2, 2, 2, 2]
    assert [s.name for shard in shards for s in shard] == [s.name for s in specs]
    one_big = plan_shards([TensorSpec("big", (1000,), "bias")], torch.float32, 10)
    assert len(one_big) == 1  # a tensor larger than the limit gets a shard of its own


@pytest.fixture(scope="module")
def codec_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("codec")
    cfg = codec_config("tiny")
    single = write_codec(root / "single", cfg, seed=3, dtype=torch.float32, max_shard_bytes=1 << 30)
    sharded = write_codec(root / "sharded", cfg, seed=3, dtype=torch.float32, max_shard_bytes=300_000)
    return root, single, sharded


def test_threads_do_not_change_the_written_values(tmp_path):
    specs = [TensorSpec(f"layer{i}.weight", (64, 48 + i), "matrix") for i in range(6)]
    specs.append(TensorSpec("norm.weight", (48,), "norm_weight"))
    for threads in (1, 3):
        (tmp_path / str(threads)).mkdir()
        write_weights(specs, tmp_path / str(threads), seed=5, style="talker", dtype=torch.bfloat16,
                      max_shard_bytes=20_000, threads=threads)
    files = sorted(p.name for p in (tmp_path / "1").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "3").iterdir()) and len(files) > 2  # shards + index
    for name in files:
        assert (tmp_path / "1" / name).read_bytes() == (tmp_path / "3" / name).read_bytes(), name


def test_codec_shards_and_index(codec_dirs):
    root, single, sharded = codec_dirs
    assert single.files == ("model.safetensors",)
    assert len(sharded.files) > 2 and sharded.files[0] == f"model-00001-of-{len(sharded.files):05d}.safetensors"
    assert not (root / "single" / INDEX_FILE).exists()
    index = json.loads((root / "sharded" / INDEX_FILE).read_text())
    assert sorted(set(index["weight_map"].values())) == list(sharded.files)
    assert index["metadata"]["total_size"] == sharded.total_bytes == single.total_bytes
    for name, file in list(index["weight_map"].items())[:20]:
        with safe_open(str(root / "sharded" / file), framework="pt") as f:
            assert name in f.keys()


def test_codec_loads_strictly_and_sharding_does_not_change_values(codec_dirs):
    root, _, _ = codec_dirs
    raw = read_state_dict(root / "single")
    names = list(safe_open(str(root / "single" / "model.safetensors"), framework="pt").keys())
    assert any(n.endswith("parametrizations.weight.original0") for n in names)  # weight-normed 1x1 convs
    a, b = load_codec(root / "single"), load_codec(root / "sharded")
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name
    assert set(a.state_dict()) == set(raw)
    cfg = json.loads((root / "single" / "config.json").read_text())
    assert cfg["number_channels"] == 2 and cfg["sampling_rate"] == 48000 and cfg["codec_weight_dtype"] == "fp32"
    codes = a.encode(torch.randn(1, 2, 3840 * 3)).codes  # [nq, B, T]
    assert codes.shape[-1] == 3 and torch.isfinite(a.decode(codes[:12])).all()


def test_tokenizer_for_full_size_ids():
    tok = build_tokenizer(QWEN_IDS)
    assert tok.get_vocab_size() == 151671
    assert tok.token_to_id("<|audio_start|>") == 151669 and tok.token_to_id("<|im_end|>") == 151645
    assert tok.id_to_token(151654) == "<|audio_user_slot|>" and tok.id_to_token(151652) == "<|vision_start|>"
    text = "Hello world, [pause 1.5s] ünïcode!"
    ids = tok.encode(text).ids
    assert max(ids) < 2000 and tok.decode(ids) == text
    assert tok.encode("\n").ids == [198]


def test_tokenizer_files_drive_the_processor(tmp_path):
    golden_cfg = json.loads((golden_dir("moss_tts_local_v1_5") / "config.json").read_text())
    write_tokenizer_files(golden_cfg, tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(golden_cfg))
    tok = TextTokenizer.from_dir(tmp_path)
    assert tok.vocab_size <= golden_cfg["vocab_size"]
    prompt = LocalV15Processor.from_dir(tmp_path).build_prompt("Hello there.", language="English")
    assert prompt[0, 0] == golden_cfg["im_start_token_id"] and prompt[-1, 0] == golden_cfg["audio_start_token_id"]
    assert tok.decode(prompt[:, 0].tolist()).count("<|im_start|>") == 2
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["eos_token"] == "<|im_end|>"
    assert build_tokenizer(golden_cfg).to_str() == build_tokenizer(golden_cfg).to_str()  # deterministic


# ---------------------------------------------------------------- the whole Local-v1.5 checkpoint


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny") / "ckpt"
    summary = make_checkpoint(out, variant="local-v1.5", size="tiny", seed=5)
    return out, summary


def test_tiny_checkpoint_loads_strictly_through_both_loaders(tiny_dir):
    out, summary = tiny_dir
    talker = load_talker(out)
    assert sum(p.numel() for p in talker.parameters()) == summary.talker.num_params
    codec = load_codec(out / CODEC_DIR)
    assert codec.cfg.channels == 2 and codec.cfg.quantizer.codebook_size == talker.config.codebook_size
    assert not any((out / f).exists() for f in (INDEX_FILE, CODEC_DIR + "/" + INDEX_FILE))


def test_tiny_config_mirrors_the_golden_layout(tiny_dir):
    out, _ = tiny_dir
    golden = json.loads((golden_dir("moss_tts_local_v1_5") / "config.json").read_text())
    config = json.loads((out / "config.json").read_text())
    assert set(config) == set(golden)
    assert set(config["qwen3_config"]) == set(golden["qwen3_config"])
    assert set(config["gpt2_config"]) == set(golden["gpt2_config"])
    assert config["dtype"] == "float32" and config["model_type"] == "moss_tts_local"
    tied = ("text_lm_head.weight", "audio_lm_heads.0.weight")
    names = set(safe_open(str(out / "model.safetensors"), framework="pt").keys())
    assert names.isdisjoint(tied) and "transformer.embed_tokens.weight" in names


def test_tiny_tokenizer_special_ids_match_the_config(tiny_dir):
    out, _ = tiny_dir
    config = json.loads((out / "config.json").read_text())
    tok = TextTokenizer.from_dir(out)
    assert tok.vocab_size <= config["vocab_size"]
    for key in ("pad_token_id", "im_start_token_id", "im_end_token_id", "audio_start_token_id",
                "audio_end_token_id", "audio_user_slot_token_id", "audio_assistant_slot_token_id"):
        assert tok.decode([config[key]]).startswith("<|"), key
    processor = LocalV15Processor.from_dir(out)
    prompt = processor.build_prompt("A short sentence.", language="English")
    assert prompt[-1, 0] == config["audio_start_token_id"] and prompt[:, 0].max() < config["vocab_size"]


def test_talker_shards_load_like_one_file(tiny_dir, tmp_path):
    out, _ = tiny_dir
    written = write_talker(tmp_path, talker_config("tiny"), seed=5, dtype=torch.float32, max_shard_bytes=400_000)
    assert len(written.files) >= 3 and (tmp_path / INDEX_FILE).is_file()
    a, b = load_talker(out), load_talker(tmp_path)
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name


def test_full_size_shapes_count_about_4_13_b_talker_parameters():
    # meta device only: names and shapes, no memory
    specs = module_specs(_meta_talker(talker_config("full")), "talker")
    total = sum(s.numel() for s in specs)
    assert 4.12e9 < total < 4.14e9
    shards = plan_shards(specs, torch.bfloat16, DEFAULT_SHARD_BYTES["full"])
    assert len(shards) >= 4 and all(sum(s.numel() * 2 for s in sh) <= DEFAULT_SHARD_BYTES["full"] for sh in shards[:-1])
    tok = build_tokenizer(talker_config("full"))
    assert tok.get_vocab_size() <= talker_config("full")["vocab_size"]


def test_cli_writes_a_checkpoint(tmp_path, capsys):
    out = tmp_path / "cli"
    assert cli_main(["make-checkpoint", "--size", "tiny", "--out", str(out), "--seed", "1"]) == 0
    assert "random weights" in capsys.readouterr().out
    load_talker(out)
    assert cli_main(["make-checkpoint", "--size", "tiny", "--out", str(out)]) == 2  # not empty


@pytest.mark.parametrize("variant", ["delay", "voice-generator", "realtime"])
def test_other_variants_load_through_their_own_loaders(variant, tmp_path):
    from stages.models.codec.config import CodecConfig
    from stages.models.delay.model import DelayModel
    from stages.models.realtime.model import RealtimeModel

    summary = make_checkpoint(tmp_path, variant=variant, size="tiny", seed=2)
    model = (RealtimeModel if variant == "realtime" else DelayModel).from_dir(tmp_path)
    assert sum(p.numel() for p in model.parameters()) == summary.talker.num_params
    codec = load_codec(tmp_path / CODEC_DIR)
    assert codec.cfg == CodecConfig.from_json(codec_config("tiny", variant))
    assert codec.cfg.channels == 1 and codec.cfg.sampling_rate == 24000  # the v1 codec
    tok = TextTokenizer.from_dir(tmp_path)
    assert tok.encode("<|im_start|>") == [606] and tok.encode("<|im_end|>") == [607]


def test_full_size_moss_tts_8b_counts_8_49_b_parameters():
    specs = module_specs(_meta_talker(talker_config("full", "delay"), "delay"), "talker")
    assert 8.48e9 < sum(s.numel() for s in specs) < 8.50e9  # docs/model_facts.md, "Delay family": 8.490 B


# ---------------------------------------------------------------- the embedded demo model


def test_demo_model_is_created_once_atomically_and_warns(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="stages.tools.demo_model"):
        first = ensure_demo_model(tmp_path / "cache")
    assert "RANDOM weights" in caplog.text
    assert first.parent == tmp_path / "cache" and demo_key() in first.name
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [first.name]  # no temp dir left
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert ensure_demo_model(tmp_path / "cache") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp  # reused, not rewritten
    load_talker(first)


def test_demo_key_follows_the_generator_version(monkeypatch):
    key = demo_key()
    monkeypatch.setattr(demo_model, "GENERATOR_VERSION", demo_model.GENERATOR_VERSION + "+changed")
    assert demo_key() != key


def test_demo_model_creation_race_keeps_one_complete_copy(tmp_path, monkeypatch):
    """Another process renames its copy into place while this one is writing: ours is dropped."""
    import stages.tools.make_checkpoint as mc

    real = mc.make_checkpoint
    target = tmp_path / f"demo-local-v1.5-{demo_key()}"

    def racing(out, **kwargs):
        real(target, **kwargs)  # the other process finishes first
        return real(out, **kwargs)

    monkeypatch.setattr(mc, "make_checkpoint", racing)
    assert ensure_demo_model(tmp_path) == target
    assert [p.name for p in tmp_path.iterdir()] == [target.name]
    load_talker(target)
