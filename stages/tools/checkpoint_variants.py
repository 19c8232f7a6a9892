"""What `make-checkpoint` writes for each variant: talker config, talker module, codec config.

Every entry reads its sizes from the model owners' config helpers and builds the owners' module
classes, so a checkpoint written here has exactly the tensors their loaders expect.

| variant | talker | codec |
|---|---|---|
| local-v1.5 | MOSS-TTS-Local-Transformer-v1.5 (4B) | v2, 48 kHz stereo |
| delay | MOSS-TTS (8B, n_vq 32) | v1, 24 kHz mono |
| ttsd, sound-effect | MOSS-TTSD / MOSS-SoundEffect (8B, n_vq 16) | v1 |
| voice-generator | MOSS-VoiceGenerator (1.7B, n_vq 16) | v1 |
| realtime | MOSS-TTS-Realtime (1.7B, 16 codebooks) | v1 |

Tiny Delay-family talkers keep the variant's real codebook count (the tiny v1 codec has 32).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from torch import nn

Size = Literal["tiny", "full"]


@dataclass(frozen=True)
class VariantWriter:
    """One variant: `talker_config(size)` and `codec_config(size)` give `config.json` dicts;
    `talker_module(config)` builds the module whose parameters are the checkpoint's tensors (call
    it under `torch.device("meta")`); `finish_config` adds the hub bookkeeping keys."""

    talker_config: Callable[[Size], dict]
    talker_module: Callable[[dict], nn.Module]
    codec_config: Callable[[Size], dict]
    finish_config: Callable[[dict], dict] = lambda config: config


def _v2_codec(size: Size) -> dict:
    from stages.models.codec.config import full_size_v2_config, tiny_v2_config

    return full_size_v2_config() if size == "full" else tiny_v2_config()


def _v1_codec(size: Size) -> dict:
    from stages.models.codec.config import full_size_v1_config, tiny_v1_config

    return full_size_v1_config() if size == "full" else tiny_v1_config()


def _local_v15_config(size: Size) -> dict:
    from stages.models.local_v15.config import full_size_config, tiny_config

    return full_size_config() if size == "full" else tiny_config()


def _local_v15_module(config: dict) -> nn.Module:
    from stages.models.local_v15.loader import build_talker_module

    return build_talker_module(config)


def _local_v15_finish(config: dict) -> dict:
    from stages.models.local_v15.hub_keys import with_local_v15_hub_keys

    return with_local_v15_hub_keys(config)


def _delay_config(name: str) -> Callable[[Size], dict]:
    def config(size: Size) -> dict:
        from stages.models.delay.config import VARIANT_N_VQ, full_size_config, tiny_config

        return full_size_config(name) if size == "full" else tiny_config(n_vq=VARIANT_N_VQ[name])

    return config


def _delay_finish(name: str) -> Callable[[dict], dict]:
    """Record which Delay variant this is: 16-codebook configs cannot tell TTSD, SoundEffect and
    VoiceGenerator apart (read by `stages.models.delay.variant`)."""
    return lambda config: {**config, "mossvox_variant": name}


def _delay_module(config: dict) -> nn.Module:
    from stages.models.delay.config import DelayConfig
    from stages.models.delay.model import DelayModel

    return DelayModel(DelayConfig.from_dict(config))


def _realtime_config(size: Size) -> dict:
    from stages.models.realtime.config import full_size_config, tiny_config

    return full_size_config() if size == "full" else tiny_config()


def _realtime_module(config: dict) -> nn.Module:
    from stages.models.realtime.config import RealtimeConfig
    from stages.models.realtime.model import RealtimeModel

    return RealtimeModel(RealtimeConfig.from_dict(config))


VARIANTS: dict[str, VariantWriter] = {
    "local-v1.5": VariantWriter(_local_v15_config, _local_v15_module, _v2_codec, _local_v15_finish),
    "delay": VariantWriter(_delay_config("moss-tts"), _delay_module, _v1_codec, _delay_finish("moss-tts")),
    "ttsd": VariantWriter(_delay_config("ttsd"), _delay_module, _v1_codec, _delay_finish("ttsd")),
    "sound-effect": VariantWriter(_delay_config("sound-effect"), _delay_module, _v1_codec,
                                  _delay_finish("sound-effect")),
    "voice-generator": VariantWriter(_delay_config("voice-generator"), _delay_module, _v1_codec,
                                     _delay_finish("voice-generator")),
    "realtime": VariantWriter(_realtime_config, _realtime_module, _v1_codec),
}
