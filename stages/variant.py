"""The variant contract: everything the engine, the workers and the tools may ask of a model family.

A variant serves one kind of checkpoint (its `config.json` `model_type`). A family writes one
subclass of `Variant` in its own folder, naming the model types it serves in `model_types`; that
subclass is the family's registration (`stages.registry` maps a checkpoint to it). The base class
holds what every family shares: the codec's shape read from its directory, the sampling
resolution, the warm-up job, the codec runner, and the checks of the profile.

A family fills in:
- `used_fields`: which of a job's optional fields (`speech.job.OPTIONAL_FIELDS`: references,
  `ref_text`, `instructions`, `language`) it uses. The others are accepted and ignored: callers
  ask `ignored_fields` to report them, and `build_request` clears them before the adapter runs;
- `adapt(job) -> TalkerRequest`: the request adapter, run in the API process (through
  `build_request`): the prompt, the resolved sampling, and the codes the codec decodes first
  (priming), all together, so neither the engine nor the talker worker knows any model's prompt
  layout;
- `make_talker_runner(device)`: the talker runner (loads the weights; worker processes only);
- `processor_class`: its prompt processor (`stages.runtime.prompt.PromptProcessor`);
- and where it needs to: `sampling_defaults`, `warm_up_job()`, `check(...)`, `checkpoints()`,
  `default_speaker(text)`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Literal, Protocol

import numpy as np

from profiles import Profile
from speech.job import OptionalField, SpeechJob
from speech.sampling import SamplingParams
from stages.models.codec.serving import CodecShape, make_codec_runner
from stages.models.qwen3 import Qwen3Config
from stages.runtime.checkpoint import read_config
from stages.runtime.memory_plan import MemoryPlan
from stages.runtime.prompt import PromptProcessor
from stages.runtime.request_sampling import SamplingResolver
from stages.runtime.talker_runner import TalkerRunner

if TYPE_CHECKING:
    from torch import nn

    from stages.models.codec.runner import CodecRunner

Size = Literal["tiny", "full"]


class UnknownModel(ValueError):
    """A checkpoint (or the profile's wish for it) that no registered variant serves."""


class AdapterError(ValueError):
    """A request the variant cannot serve as asked (HTTP 400); the message says what to change."""


@dataclass(frozen=True)
class TalkerRequest:
    """What a variant builds from a `SpeechJob`: everything the talker and the codec need.

    `prime_codes` is left context: codes the codec decodes into the request's slot before its
    first frame, dropping their audio, so the new audio continues them (continuation mode, as
    upstream decodes the whole block and trims the prompt part). None: no priming.
    """

    prompt: np.ndarray                      # [S, 1 + n_vq] int64: text channel + audio channels
    sampling: SamplingParams
    prime_codes: np.ndarray | None = None   # [T, n_vq] int64

    @property
    def prime_frames(self) -> int:
        return 0 if self.prime_codes is None else len(self.prime_codes)

    def payload(self) -> np.ndarray:
        """The rows a submit record carries: the prompt, then the prime codes as rows whose column
        0 is unused (`ipc.messages.Submit.prime_frames` says how many): `[S + T, 1 + n_vq]` int64."""
        if self.prime_codes is None:
            return self.prompt
        rows = np.zeros((len(self.prime_codes), self.prompt.shape[1]), dtype=np.int64)  # [T, 1 + n_vq]
        rows[:, 1:] = self.prime_codes
        return np.concatenate([self.prompt, rows])

    @classmethod
    def from_payload(cls, rows: np.ndarray, sampling: SamplingParams, prime_frames: int) -> TalkerRequest:
        """The request `payload()` carried: rows `[S + T, 1 + n_vq]` with `prime_frames` = T."""
        if not prime_frames:
            return cls(rows, sampling)
        split = len(rows) - prime_frames
        return cls(rows[:split], sampling, rows[split:, 1:])


class TextStream(Protocol):
    """The text of one request arriving while it speaks (`Variant.open_text_stream`): what the
    client submits first and feeds later (`ipc.messages.Submit.open_input`, `Feed`)."""

    text: str    # all text received so far

    def push(self, text: str) -> None:
        """More text, any size, any split."""

    def end(self) -> None:
        """No more text comes."""

    def request(self) -> TalkerRequest | None:
        """The request to submit, once there is text enough for its prompt; None before and after."""

    def take_rows(self) -> np.ndarray:
        """Input rows `[n, 1 + n_vq]` released since `request()` or the last call (n may be 0)."""

    def forced_frames(self) -> int | None:
        """The forced length of all the text so far (random-weight benchmarks), else None."""


@dataclass(frozen=True)
class CheckpointRecipe:
    """How `make-checkpoint` writes one variant: `talker_config(size)` and `codec_config(size)`
    give `config.json` dicts; `talker_module(config)` builds the module whose parameters are the
    checkpoint's tensors (called under `torch.device("meta")`); `finish_config` adds the keys a
    real checkpoint's config carries beyond the model's own (hub bookkeeping, the variant name)."""

    talker_config: Callable[[Size], dict]
    talker_module: Callable[[dict], nn.Module]
    codec_config: Callable[[Size], dict]
    finish_config: Callable[[dict], dict] = lambda config: config


def warm_up_job() -> SpeechJob:
    """A short fixed request, used only to warm a runner up."""
    return SpeechJob(text="warm up", sampling={"seed": 0}, forced_frames=2)


class Variant:
    """One model family as the engine serves it; see the module docstring.

    Cheap to build (config, codec shape, lazily the prompt processor; no weights): every API
    process holds one to build requests, and each worker process builds one to make its runner.
    """

    model_types: ClassVar[tuple[str, ...]] = ()   # config.json `model_type` values served
    description: ClassVar[str] = ""               # the released models, for error messages
    tensor_parallel: ClassVar[bool] = False       # whether `talker.tensor_parallel` > 1 is served
    named_variants: ClassVar[tuple[str, ...]] = ()  # what the profile's `model.variant` may name
    processor_class: ClassVar[type[PromptProcessor]]  # the family's prompt processor
    continues_context: ClassVar[bool] = False     # uses `SpeechJob.context_codes` (the audio
    #                                               spoken just before) as a continuation prompt
    takes_text_while_speaking: ClassVar[bool] = False  # has `open_text_stream`

    name: str                                     # the served model's name
    sampling_defaults: SamplingParams = SamplingParams()
    used_fields: frozenset[OptionalField] = frozenset()  # optional job fields the adapter reads

    def __init__(self, model_dir: str | Path, profile: Profile, config: dict | None = None) -> None:
        self.model_dir = Path(model_dir)
        self.profile = profile
        self.config = read_config(model_dir) if config is None else config
        self.check(self.model_dir, self.config, profile)
        codec = CodecShape.of(self.model_dir, profile)
        self.codec_dir = codec.codec_dir
        self.sample_rate, self.channels = codec.sample_rate, codec.channels
        self.frame_rate = codec.frame_rate
        self.samples_per_frame = codec.samples_per_frame  # per channel
        self.n_vq = self.codebooks()
        self._sampling: SamplingResolver | None = None

    @classmethod
    def check(cls, model_dir: Path, config: dict, profile: Profile) -> None:
        """Refuse a checkpoint or a profile this variant cannot serve (`UnknownModel`, naming the
        key). Families with more to refuse extend it."""
        model_type = config.get("model_type")
        chosen = profile.model.variant
        if chosen is not None and chosen not in cls.named_variants:
            raise UnknownModel(f"model.variant {chosen!r} names a Delay-family variant, but "
                               f"{model_dir}/config.json has model_type {model_type!r}")
        tp = profile.talker.tensor_parallel
        if tp > 1 and not cls.tensor_parallel:
            raise UnknownModel(f"talker.tensor_parallel {tp} splits Delay-family talkers only, but "
                               f"{model_dir}/config.json has model_type {model_type!r}")

    def codebooks(self) -> int:
        """Codebooks per frame (`n_vq`) as the checkpoint's config states them."""
        return int(self.config["n_vq"])

    @cached_property
    def processor(self) -> PromptProcessor:
        """The prompt processor (tokenizer and typed config), read on first use."""
        return self.processor_class.from_dir(self.model_dir)

    # ---- the request adapter (API process) ----------------------------------------------------

    def ignored_fields(self, given: Iterable[OptionalField]) -> tuple[OptionalField, ...]:
        """The fields of `given` this variant does not use (accepted, ignored, reported), in order."""
        return tuple(name for name in given if name not in self.used_fields)

    def build_request(self, job: SpeechJob) -> TalkerRequest:
        """Prompt, sampling and priming of `job`; `AdapterError` / `ValueError` on a bad field.

        The optional fields this variant does not use are cleared first, so the adapter never
        sees them (and no caller gets a refusal for a field the model has no use for)."""
        return self.adapt(self.without_ignored(job))

    def without_ignored(self, job: SpeechJob) -> SpeechJob:
        """`job` with the optional fields this variant does not use cleared."""
        return job.without(self.ignored_fields(job.given_fields()))

    def adapt(self, job: SpeechJob) -> TalkerRequest:
        """The family's request adapter over a job that sets only `used_fields` of the optional
        fields: prompt, sampling (`resolve_sampling`) and priming; `AdapterError` on a field that
        is wrong (malformed, out of range, a required one missing)."""
        raise NotImplementedError

    def open_text_stream(self, job: SpeechJob) -> TextStream:
        """A request whose text arrives while it speaks (`job.text` is ignored); only variants
        with `takes_text_while_speaking` have it. `AdapterError` for fields it cannot serve."""
        raise AdapterError(f"{self.description or self.name} takes whole texts, not text while it speaks")

    def default_speaker(self, text: str) -> str | None:
        """The speaker tag a multi-speaker family gives `text` that carries no speaker tags, else
        None (single-speaker families, or tagged text)."""
        return None

    def resolve_sampling(self, job: SpeechJob) -> SamplingParams:
        """`sampling_defaults` under the job's overrides, seed and forced length
        (`stages.runtime.request_sampling`)."""
        if self._sampling is None:
            self._sampling = SamplingResolver(self.sampling_defaults, self.profile)
        return self._sampling.resolve(job)

    def warm_up_job(self) -> SpeechJob:
        """A short job this variant's adapter accepts (the talker worker's warm-up request)."""
        return warm_up_job()

    def warm_request_path(self) -> None:
        """Build one request (`warm_up_job`) now, so that this process's first real request does
        not pay for what is read on first use: the prompt processor reads the tokenizer (a
        Qwen-sized vocabulary: 0.1-0.2 s, which the first request of every API process added to
        its first audio)."""
        self.build_request(self.warm_up_job())

    # ---- memory (worker processes, before they allocate) ---------------------------------------

    def backbone(self) -> Qwen3Config:
        """The talker's Qwen3 backbone shape (it sizes the KV cache): `qwen3_config` or
        `language_config` of `config.json`, as every shipped family keeps it."""
        return Qwen3Config.from_hf(self.config.get("qwen3_config") or self.config["language_config"])

    def memory_plan(self, device: str, card: int) -> MemoryPlan:
        """This replica's memory plan on a card of `card` bytes (`stages.memory`); raises
        `MemoryPlanError`, naming the settings to change, when the profile does not fit."""
        from stages.memory import replica_memory_plan

        return replica_memory_plan(self, device, card)

    # ---- runners (worker processes) ------------------------------------------------------------

    def make_talker_runner(self, device: str) -> TalkerRunner:
        """The talker runner for this process (loads the talker weights)."""
        raise NotImplementedError

    def make_codec_runner(self, device: str) -> CodecRunner:
        """The codec runner for this process (loads the audio tokenizer) over `n_vq` codebooks."""
        return make_codec_runner(self.codec_dir, self.profile, device, self.n_vq)

    # ---- developer tools -----------------------------------------------------------------------

    @classmethod
    def checkpoints(cls) -> dict[str, CheckpointRecipe]:
        """The random-weight checkpoints `make-checkpoint` can write for this family, by name."""
        return {}
