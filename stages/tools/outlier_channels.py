"""Outlier channels for random-weight checkpoints: the activation statistics of released LLMs
that float8 scales are sensitive to (`mossvox make-checkpoint --outlier-channels`).

Random weights give every hidden channel the same scale. Released LLM checkpoints do not:
* a few hidden channels are outlier features, 20-100x the rest in every token's normed
  activations (large RMSNorm gains on those channels), the same channels in every layer;
* a few tokens (the first of a turn, delimiters) carry massive activations in the residual
  stream, hundreds to thousands of times the median, in those channels;
* a few intermediate channels of the MLP are far larger than the rest where the down projection
  reads them.
A float8 row scale is set by the row's largest magnitude, so such rows push everything else down
its range. `OutlierChannels.adjust(name, tensor)` gives one Qwen3 backbone tensor of a random
checkpoint these statistics as it is written (`stages.tools.random_weights.write_weights`):

* `*.input_layernorm.weight`, `*.post_attention_layernorm.weight` [H]: `count` hidden channels
  times gains spaced evenly in log from `low` to `high`: q|k|v's and gate|up's inputs carry those
  channels 20-100x the rest at every token;
* `*.embed_tokens.weight` [V, H]: in the rows of `massive_tokens`, those channels set to
  `massive` times the row's RMS: the first layer's q|k|v input at those tokens carries them some
  10^4 times the rest (the gain on top); random layers' updates then swamp the residual, so
  later layers see the outlier features alone;
* `*.mlp.up_proj.weight` [I, H]: `count` intermediate rows times the gains, and
  `*.mlp.down_proj.weight` [H, I]: the same columns divided by them, so down's input carries the
  outliers and its output is the same product.

The channels are chosen by `seed` from the tensor's size, so every layer has the same ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OutlierChannels:
    """Which channels become outliers and how large (module docstring)."""

    count: int = 4  # hidden channels, and intermediate channels
    low: float = 20.0  # the smallest gain
    high: float = 100.0  # the largest gain
    massive: float = 100.0  # massive activations: that many times the embedding row's RMS
    massive_tokens: tuple[int, ...] = ()  # the token ids whose embedding rows carry them
    seed: int = 0

    def channels(self, size: int) -> torch.Tensor:
        """The outlier channels among `size` ([count] int64, the same for every tensor of that size)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + size)
        return torch.randperm(size, generator=g)[:self.count]

    def gains(self) -> torch.Tensor:
        """[count] fp32: `low` to `high`, evenly spaced in log."""
        if self.count == 1:
            return torch.tensor([self.high])
        steps = torch.arange(self.count, dtype=torch.float64) / (self.count - 1)
        return torch.exp(math.log(self.low) + steps * (math.log(self.high) - math.log(self.low))).float()

    def adjust(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (the checkpoint tensor `name`, fp32) with its outliers; other names unchanged."""
        if name.endswith(("input_layernorm.weight", "post_attention_layernorm.weight")):
            tensor[self.channels(tensor.shape[0])] *= self.gains()
        elif name.endswith("embed_tokens.weight") and self.massive_tokens:
            rows = torch.tensor(self.massive_tokens)
            rms = tensor[rows].pow(2).mean(-1, keepdim=True).sqrt()  # [tokens, 1]
            cols = self.channels(tensor.shape[1])
            signs = torch.where(torch.arange(self.count) % 2 == 0, 1.0, -1.0)  # [count]
            tensor[rows[:, None], cols[None, :]] = self.massive * rms * signs
        elif name.endswith("mlp.up_proj.weight"):
            tensor[self.channels(tensor.shape[0])] *= self.gains()[:, None]
        elif name.endswith("mlp.down_proj.weight"):
            tensor[:, self.channels(tensor.shape[1])] /= self.gains()
        return tensor
