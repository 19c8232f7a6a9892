"""mossvox deploy profiles: YAML files resolved into one frozen, strict `Profile` tree.

    from profiles import load_profile
    profile = load_profile("cpu", ["coalescing.max_wait_ms=2"])
    profile.talker.max_running, profile.sha256(), profile.to_yaml()

Shipped profiles live beside this file (`default`, `low-latency`, `high-concurrency`, `cpu`).
"""

from profiles.loader import load_profile, parse_override, profile_summary, shipped_profiles
from profiles.schema import (
    AdmissionConfig,
    ApiConfig,
    ChunkingConfig,
    CoalescingConfig,
    CodecConfig,
    CrossFieldError,
    EngineConfig,
    IpcConfig,
    ModelConfig,
    Profile,
    ProfileError,
    TalkerConfig,
)

__all__ = [
    "AdmissionConfig", "ApiConfig", "ChunkingConfig", "CoalescingConfig", "CodecConfig",
    "CrossFieldError", "EngineConfig", "IpcConfig", "ModelConfig", "Profile", "ProfileError",
    "TalkerConfig", "load_profile", "parse_override", "profile_summary", "shipped_profiles",
]
