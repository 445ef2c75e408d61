"""The text tokenizer of a CLIP / SigLIP checkpoint: its `tokenizer.json` read with the `tokenizers` library
(no transformers at run time), every text padded and truncated to the text tower's fixed length.

Token ids equal those of the checkpoint's Hugging Face tokenizer called as the model's processor calls it:
`tokenizer(texts, padding="max_length", max_length=seq_len, truncation=True)` (CLIP 77, SigLIP 64), the
special tokens added by the file's post-processor. The pad token is the one `tokenizer_config.json` (or
`special_tokens_map.json`) names; the padding side is its `padding_side`, else the tokenizer class's default
(left for the Gemma tokenizers of SigLIP2, right for CLIP's).
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


# transformers' tokenizer classes that pad on the left by default (`padding_side = "left"`)
LEFT_PADDING_CLASSES = ("Siglip2Tokenizer", "GemmaTokenizer", "GemmaTokenizerFast")


def _setting(directory: Path, key: str):
    """`key` of tokenizer_config.json, else of special_tokens_map.json; None in neither."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = directory / name
        if path.is_file():
            try:
                value = json.loads(path.read_text()).get(key)
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as exc:
                raise CheckpointError(f"{path}: not a valid JSON object ({reason(exc)})") from None
            if value is not None:
                return value
    return None


def tokenizer_class(directory: Path) -> str | None:
    """The transformers class `tokenizer_config.json` names (None when it names none)."""
    value = _setting(Path(directory), "tokenizer_class")
    return value if isinstance(value, str) else None


def _special_token(directory: Path, key: str) -> str | None:
    return _token_name(_setting(directory, key))


def _side(directory: Path, key: str, default: str) -> str:
    side = _setting(directory, key) or default
    if side not in ("left", "right"):
        raise CheckpointError(f"{directory / 'tokenizer_config.json'}: {key} must be left or right, got {side!r}")
    return side


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
        if pad is None:
            raise CheckpointError(
                f"{directory}: no pad token found in tokenizer_config.json or special_tokens_map.json"
            )
        if pad_id is None:
            raise CheckpointError(f"{directory}: the pad token {pad!r} is not in {path.name}'s vocabulary")
        left = _setting(directory, "tokenizer_class") in LEFT_PADDING_CLASSES
        self.padding_side = _side(directory, "padding_side", "left" if left else "right")
        tok.no_padding()
        tok.enable_truncation(max_length=seq_len, direction=_side(directory, "truncation_side", "right"))
        tok.enable_padding(length=seq_len, pad_id=pad_id, pad_token=pad, direction=self.padding_side)
        self.tokenizer, self.seq_len, self.pad_id, self.path = tok, seq_len, pad_id, path

    def __call__(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts)]

    def with_mask(self, texts: list[str]) -> tuple[list[list[int]], list[list[int]]]:
        """(token ids, attention mask: 1 for a text's tokens, 0 for padding), each [B][seq_len]."""
        encodings = self.tokenizer.encode_batch(texts)
        return [e.ids for e in encodings], [e.attention_mask for e in encodings]

    def token_counts(self, texts: list[str]) -> list[int]:
        """Per text, its real tokens after truncation (special tokens included, pads not): an API's usage count.
        Torch-free, so a process without torch (the ingress) can count what the encoder will run."""
        return [sum(e.attention_mask) for e in self.tokenizer.encode_batch(texts)]


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
