"""What every family's prompt processor shares: a checkpoint's tokenizer and typed config, and the
rows of plain text in a 2-D prompt `[S, 1 + n_vq]` (text channel, then audio channels).

A family's processor subclasses `PromptProcessor` with its `config_class` (a typed `config.json`
with `from_dict`) and builds its own prompt layouts.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from stages.runtime.checkpoint import read_config
from stages.runtime.tokenizer import TextTokenizer


def text_rows(ids: Sequence[int], n_vq: int, audio_pad: int) -> np.ndarray:
    """Rows `[n, 1 + n_vq]` int64 of text tokens `ids`: each id in column 0, `audio_pad` elsewhere."""
    rows = np.full((len(ids), n_vq + 1), audio_pad, dtype=np.int64)  # [n, 1 + n_vq]
    rows[:, 0] = np.asarray(ids, dtype=np.int64)
    return rows


class PromptProcessor:
    """A tokenizer and a typed config; `from_dir` reads both from a checkpoint directory."""

    config_class: ClassVar[Any]  # has `from_dict(config.json dict)`

    def __init__(self, tokenizer: TextTokenizer, config: Any) -> None:
        self.tokenizer = tokenizer
        self.config = config

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Any:
        return cls(TextTokenizer.from_dir(model_dir), cls.config_class.from_dict(read_config(model_dir)))
