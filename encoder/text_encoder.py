"""The text side of an image-text model (CLIP, SigLIP2): tokenizer, text tower and the zero-shot head's
scalars, behind `VisionEncoder.encode_text` and `supports_text`.

Poolings: "model" (the default: CLIP `text_embeds`, SigLIP `pooler_output`, what transformers'
`get_text_features` returns) and "model-l2" (divided by its L2 norm). Zero-shot logits of L2-normalised
image and text embeddings: `logits(image, text) = image @ text.T * exp(logit_scale) (+ logit_bias, SigLIP)`,
as transformers' `logits_per_image`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from encoder.errors import CheckpointError, ConfigError, InvalidArgumentError, named
from encoder.loading.checkpoint import read_json
from encoder.loading.text_weights import read_text_state, text_side_files
from encoder.models.text import TextTower, build_text_tower
from encoder.text_config import TextConfig, text_config_from_hf
from encoder.tokenization import TextTokenizer, check_texts, has_tokenizer, tokenizer_class

TEXT_POOLINGS = ("model", "model-l2")
# tokenizers transformers runs in Python over a sentencepiece model, not from tokenizer.json: SigLIP's
# canonicalises each text first (lowercase, punctuation removed, whitespace collapsed). A checkpoint with one
# serves images only.
SENTENCEPIECE_ONLY = ("SiglipTokenizer",)


def check_text_pooling(pooling) -> str:
    if pooling is None:
        return "model"
    if not isinstance(pooling, str) or pooling not in TEXT_POOLINGS:
        raise InvalidArgumentError(f"unknown text pooling {named(pooling)}; expected one of {', '.join(TEXT_POOLINGS)}")
    return pooling


def pool_text(out: torch.Tensor, pooling: str) -> list[torch.Tensor]:
    """[B, out_dim] float32 CPU embeddings -> per text, as the (checked) `pooling` asks."""
    if pooling == "model-l2":
        out = torch.nn.functional.normalize(out, dim=-1)
    return list(out.unbind(0))


class TextEncoder:
    """A text tower with its tokenizer; `encode` runs it eagerly on fixed [B, seq_len] token batches."""

    def __init__(self, config: TextConfig, tower: TextTower, tokenizer: TextTokenizer,
                 logit_scale: float | None = None, logit_bias: float | None = None):  # fmt: skip
        self.config, self.tower, self.tokenizer = config, tower, tokenizer
        self.logit_scale, self.logit_bias = logit_scale, logit_bias

    @property
    def device(self) -> torch.device:
        return next(self.tower.parameters()).device

    def tokenize(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """([B, seq_len] int64 token ids, [B, seq_len] int64 attention mask), on the CPU."""
        ids, mask = self.tokenizer.with_mask(check_texts(texts))
        shape = (-1, self.config.seq_len)
        return torch.tensor(ids, dtype=torch.int64).view(shape), torch.tensor(mask, dtype=torch.int64).view(shape)

    def token_counts(self, texts: list[str]) -> list[int]:
        """Per text, the real (non-pad) tokens the tower runs on after truncation: `usage.prompt_tokens`."""
        return self.tokenizer.token_counts(check_texts(texts))

    def check_ids(self, ids, mask) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-tokenized input checked as the tower needs it: `ids` and `mask` [B, seq_len] int64 tensors, ids in
        the vocabulary (an id past it is a device-side assert on CUDA: the process's context is lost), mask 0 / 1
        with a token in every row (a row of pads only has nothing to attend to: NaN). InvalidArgumentError naming
        the input (and the row) otherwise."""
        s, vocab = self.config.seq_len, self.config.vocab_size
        for name, t in (("ids", ids), ("mask", mask)):
            if not isinstance(t, torch.Tensor):
                raise InvalidArgumentError(f"{name} must be a torch.Tensor [B, {s}] int64, got {type(t).__name__}")
            if t.dtype != torch.int64 or t.dim() != 2 or t.shape[1] != s:
                raise InvalidArgumentError(
                    f"{name} must be a [B, {s}] int64 tensor (texts padded to the model's {s} tokens), got "
                    f"{list(t.shape)} {t.dtype}"
                )
        if ids.shape != mask.shape:
            raise InvalidArgumentError(f"ids {list(ids.shape)} and mask {list(mask.shape)} differ in shape")
        if ids.numel():
            bad = ((ids < 0) | (ids >= vocab)).any(1).nonzero()
            if bad.numel():
                i = int(bad[0])
                raise InvalidArgumentError(f"ids[{i}] has a token id outside the vocabulary [0, {vocab})")
            bad = ((mask != 0) & (mask != 1)).any(1).nonzero()
            if bad.numel():
                raise InvalidArgumentError(f"mask[{int(bad[0])}] has values other than 0 and 1")
            empty = (mask.sum(1) == 0).nonzero()
            if empty.numel():
                raise InvalidArgumentError(f"mask[{int(empty[0])}] has no token (every position is padding)")
        return ids, mask

    @torch.inference_mode()
    def encode(self, texts: list[str], pooling: str | None = None) -> list[torch.Tensor]:
        pooling = check_text_pooling(pooling)
        texts = check_texts(texts)
        if not texts:
            return []
        return self.encode_ids(*self.tokenize(texts), pooling)

    @torch.inference_mode()
    def encode_ids(self, ids: torch.Tensor, mask: torch.Tensor, pooling: str | None = None) -> list[torch.Tensor]:
        """`encode` of pre-tokenized texts (`tokenize`'s ids and mask, [B, seq_len] int64), eagerly."""
        pooling = check_text_pooling(pooling)
        ids, mask = self.check_ids(ids, mask)
        if ids.shape[0] == 0:
            return []
        out = self.tower(ids.to(self.device), mask.to(self.device)).float().cpu()  # [B, out_dim]
        return pool_text(out, pooling)

    def logits(self, image_embeds: torch.Tensor, text_embeds: torch.Tensor) -> torch.Tensor:
        """[n_images, n_texts] zero-shot logits from un-normalised embeddings (transformers' `logits_per_image`)."""
        if self.logit_scale is None:
            raise InvalidArgumentError("this checkpoint has no logit_scale")
        img = torch.nn.functional.normalize(image_embeds.float(), dim=-1)
        txt = torch.nn.functional.normalize(text_embeds.float(), dim=-1)
        out = img @ txt.T * torch.tensor(self.logit_scale).exp()
        return out + self.logit_bias if self.logit_bias is not None else out


def load_text_encoder(config: TextConfig, directory: Path, device: torch.device, dtype: torch.dtype) -> TextEncoder:
    """The text tower of a checkpoint directory with its tokenizer (`tokenizer.json`)."""
    tokenizer = TextTokenizer(directory, config.seq_len)
    with torch.device("meta"):
        tower = build_text_tower(config)
    tower = tower._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device="cpu"))
    state, scalars = read_text_state(directory, tower)
    with torch.no_grad():
        for name, tensor in tower.state_dict().items():
            tensor.copy_(state[name])
    tower = tower.to(device=device, dtype=dtype).eval()
    return TextEncoder(config, tower, tokenizer, scalars.get("logit_scale"), scalars.get("logit_bias"))


def text_config_of(directory: Path) -> TextConfig | None:
    """The text tower's config in a checkpoint directory's `config.json`; None for a model without one."""
    try:
        return text_config_from_hf(read_json(Path(directory) / "config.json"))
    except ConfigError as exc:
        raise CheckpointError(f"{Path(directory) / 'config.json'}: {exc}") from None


def load_text_side(directory: Path, device, dtype) -> TextEncoder | None:
    """The text encoder of a checkpoint that has a text tower and its tokenizer, else None (images only: the
    text config is not even read)."""
    if not has_tokenizer(directory) or tokenizer_class(directory) in SENTENCEPIECE_ONLY:
        return None
    shards = [f for f in text_side_files(Path(directory)) if f.endswith(".safetensors")]
    if not all((Path(directory) / f).exists() for f in shards):  # a partial Hub cache: images only
        return None
    config = text_config_of(directory)
    return None if config is None else load_text_encoder(config, directory, device, dtype)
