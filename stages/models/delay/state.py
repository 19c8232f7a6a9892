"""Per-sequence generation state of the Delay talker: upstream `generate`'s rules, one row at a time.

Each step produces one row `[text, code_0 .. code_{n_vq-1}]` (docs/model_facts.md, "Delay family"). The state decides
what the text channel may be and which audio channels are sampled; `advance` applies the text
token that was chosen. Host-side and scalar: the runner turns the decisions of a batch into
device tensors in one go.

Rules (upstream, kept exactly):
* text: forced `pad` once stopping; forced `delay_slot` while draining (`delayed < n_vq`);
  forced `audio_end` when `delayed == n_vq`; otherwise sampled. Outside audio, pad / gen_slot /
  delay_slot / audio_end are banned; inside audio only gen_slot and delay_slot are allowed. At
  step 0 the delay slot is banned; while `step <= n_vq`, im_end is banned.
* audio: channel k is sampled iff `k < audio_len` and (not draining or `k >= delayed`), a
  contiguous range `[lo, hi)`; other channels carry the pad code.
* the first delay slot is *sampled* and starts the drain of n_vq - 1 forced delay slots; the row
  that carries it still samples channel 0 (frames = gen slots + 1).
"""

from __future__ import annotations

from dataclasses import dataclass

from stages.models.delay.config import DelayConfig

OUTSIDE_AUDIO, INSIDE_AUDIO = 0, 1


@dataclass(frozen=True)
class TextRule:
    """How this step's text token is chosen: `forced` (an id) or sampled under a mask."""

    forced: int | None
    mode: int = OUTSIDE_AUDIO  # which base mask (OUTSIDE_AUDIO / INSIDE_AUDIO)
    ban_delay_slot: bool = False
    ban_im_end: bool = False


@dataclass
class DelayState:
    """Upstream's per-sequence variables. `delayed is None` is upstream's INT64_MAX (not draining)."""

    n_vq: int
    audio_len: int = 0
    delayed: int | None = None
    is_audio: bool = False
    stopping: bool = False
    step: int = 0
    frames: int = 0  # frames whose codebook 0 this generation sampled

    @classmethod
    def for_prompt(cls, text_column: list[int], config: DelayConfig) -> DelayState:
        """Continuation prompts (ending on audio_start or a gen slot) start inside audio."""
        state = cls(config.n_vq)
        if text_column and text_column[-1] in (config.audio_start, config.gen_slot):
            last_start = len(text_column) - 1 - text_column[::-1].index(config.audio_start) \
                if config.audio_start in text_column else -1
            if last_start >= 0:
                state.audio_len = len(text_column) - last_start
                state.is_audio = True
        return state

    @property
    def draining(self) -> bool:
        return self.delayed is not None

    def text_rule(self, config: DelayConfig) -> TextRule:
        if self.stopping:
            return TextRule(forced=config.pad_token_id)
        if self.delayed is not None and self.delayed < self.n_vq:
            return TextRule(forced=config.delay_slot)
        if self.delayed == self.n_vq:
            return TextRule(forced=config.audio_end)
        return TextRule(
            forced=None,
            mode=INSIDE_AUDIO if self.is_audio else OUTSIDE_AUDIO,
            ban_delay_slot=self.step == 0,
            ban_im_end=self.step <= self.n_vq,
        )

    def audio_channels(self) -> tuple[int, int]:
        """Channels sampled this step: the range [lo, hi) (empty when lo >= hi)."""
        lo = self.delayed if self.delayed is not None else 0
        return lo, min(self.audio_len, self.n_vq)

    def advance(self, text: int, config: DelayConfig) -> None:
        """Apply the row's text token (after the audio channels of this row were sampled)."""
        lo, hi = self.audio_channels()
        if lo == 0 and hi > 0:
            self.frames += 1
        if text == config.audio_start:
            self.is_audio = True
        if text == config.im_end:
            self.stopping = True
        if text in (config.audio_start, config.gen_slot, config.delay_slot):
            self.audio_len += 1
        if text == config.audio_end:
            self.audio_len = 0
            self.is_audio = False
        if self.delayed is None and text == config.delay_slot:
            self.delayed = 0
        if self.delayed is not None:
            self.delayed += 1
            if self.delayed > self.n_vq:
                self.delayed = None
        self.step += 1

    @property
    def block_complete(self) -> bool:
        """True right after the last forced delay slot: every frame of the audio block is out."""
        return self.delayed == self.n_vq

    def length_override(self, config: DelayConfig, frame_limit: int, forced: bool) -> int | None:
        """A text token that enforces a frame budget, or None to leave the choice to the model.

        Inside audio and not draining, the row that samples frame number `frame_limit` must be
        the first delay slot, and (with `forced`) every row before it a gen slot. With `forced`,
        a sequence outside audio that has produced no frame yet opens audio right away.
        """
        rule = self.text_rule(config)
        if rule.forced is not None:
            return None
        if self.is_audio and self.audio_len > 0:
            if self.frames + 1 >= frame_limit:
                return config.delay_slot
            return config.gen_slot if forced else None
        if forced and not self.is_audio and self.frames == 0:
            return config.audio_start
        return None
