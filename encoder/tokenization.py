"""The text tokenizer of a CLIP / SigLIP checkpoint: its `tokenizer.json` read with the `tokenizers` library
(no transformers at run time), every text padded and truncated to the text tower's fixed length.

Token ids equal those of the checkpoint's Hugging Face tokenizer called as the model's processor calls it:
`tokenizer(texts, padding="max_length", max_length=seq_len, truncation=True)` (CLIP 77, SigLIP 64), the
special tokens added by the file's post-processor. The pad token is the one `tokenizer_config.json` (or
`special_tokens_map.json`) names.
"""

from __future__ import annotations

import json
from pathlib import Path

from encoder.errors import CheckpointError, InvalidArgumentError, reason

TOKENIZER_FILE = "tokenizer.json"


def has_tokenizer(directory: Path | None) -> bool:
    return directory is not None and (Path(directory) / TOKENIZER_FILE).is_file()


def _token_name(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _special_token(directory: Path, key: str) -> str | None:
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = directory / name
        if path.is_file():
            try:
                token = _token_name(json.loads(path.read_text()).get(key))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as exc:
                raise CheckpointError(f"{path}: not a valid JSON object ({reason(exc)})") from None
            if token is not None:
                return token
    return None


class TextTokenizer:
    """Texts -> token ids, [B, seq_len] (as a list of lists: torch-free)."""

    def __init__(self, directory: Path, seq_len: int):
        from tokenizers import Tokenizer

        directory = Path(directory)
        path = directory / TOKENIZER_FILE
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # the library raises plain Exception subclasses for unreadable files
            raise CheckpointError(f"{path}: cannot read the tokenizer ({reason(exc)})") from None
        pad = _special_token(directory, "pad_token") or _special_token(directory, "eos_token")
        pad_id = tok.token_to_id(pad) if pad is not None else None
        if pad_id is None:
            raise CheckpointError(
                f"{directory}: no pad token found in tokenizer_config.json or special_tokens_map.json"
            )
        tok.no_padding()
        tok.enable_truncation(max_length=seq_len)
        tok.enable_padding(length=seq_len, pad_id=pad_id, pad_token=pad)
        self.tokenizer, self.seq_len, self.pad_id, self.path = tok, seq_len, pad_id, path

    def __call__(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts)]


def check_texts(texts) -> list[str]:
    """`texts` as a list of non-empty strings; InvalidArgumentError naming the first bad index."""
    if isinstance(texts, str) or not isinstance(texts, list | tuple):
        raise InvalidArgumentError(f"texts must be a list of strings, got {type(texts).__name__}")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise InvalidArgumentError(f"texts[{i}] must be a string, got {type(text).__name__}")
        if not text:
            raise InvalidArgumentError(f"texts[{i}] is an empty string")
    return list(texts)
