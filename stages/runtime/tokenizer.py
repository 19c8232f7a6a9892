"""Text tokenizer of a talker checkpoint: its `tokenizer.json`, read with the `tokenizers` library.

Only plain text goes through here. The special ids a prompt needs (im_start, audio_start, slot
tokens, ...) always come from the model's `config.json`, never from looking up token strings, so
a checkpoint whose tokenizer spells them differently still builds the same prompt.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

TOKENIZER_FILE = "tokenizer.json"


class TextTokenizer:
    """Byte-level BPE text tokenizer: text -> ids without any added BOS/EOS, and back."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> TextTokenizer:
        """Load `<model_dir>/tokenizer.json`; raises FileNotFoundError naming the path."""
        path = Path(model_dir) / TOKENIZER_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no tokenizer file in the checkpoint")
        return cls(Tokenizer.from_file(str(path)))

    @property
    def vocab_size(self) -> int:
        """Number of ids, added (special) tokens included."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Ids of `text`, no special tokens added (upstream `encode(..., add_special_tokens=False)`)."""
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], *, skip_special_tokens: bool = False) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
