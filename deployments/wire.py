"""The request record from the ingress to the encoder replica, and the one way records are grouped.

`EncodeRequest` is one request as both sides hold it: resized uint8 images, their patch counts, the output form
(`pooling`, already resolved: never None; `llm`: the LLM-ready outputs in that wire dtype instead of pooled
vectors, with pooling "none") and the caller's deadline. The ingress makes one per caller
(`ingress.encoder_calls.EncoderClient`), merges callers' records into one encoder call and cuts a big one into
packs (`pack`); each goes over the wire as `call()` says: `encode_pixels(pixels, pooling=..., num_patches=n,
num_images=k, deadline=d)` or `encode_llm_pixels(pixels, dtype=..., ...)` (routers read `num_patches` and
`num_images` from the keyword arguments without deserialising the pixels). The replica makes the same record from
the pixels it checked (`replica.deployment.EncoderReplica`) and batches records (`replica.pipeline`).

`TextRequest` is the same for texts (`encode_texts(texts, pooling=..., num_tokens=n, num_texts=k, deadline=d)`):
its size is tokens, not patches: the text tower runs every text at its fixed length (`seq_len`: CLIP 77,
SigLIP 64), so a text costs `seq_len` tokens whatever its length, and `counts` holds that per text. Texts are
tokenized on the replica (it holds the tokenizer with the text weights; see `replica.pipeline`), which answers
per text `(vector, real tokens)`: the real count (the tokenizer's attention mask, special tokens included, pads
not) is what `usage.prompt_tokens` adds up. A text record's form is `("text", pooling)`, never an image form,
so no text is merged into an image batch.

`group(requests)`: records merged by output form, on both sides: the ingress sends one encoder call per form
of the callers it merged, the replica runs one engine call per form of a batch; `Group.scatter` hands the
merged outputs (one per image) back to each record by its image count.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np


class Counted:
    """What the batchers read of a request record: its size (`patches`: an image's patches, a text's tokens) and
    its item count (`images`: images, or texts), both from its `counts`."""

    counts: list[int]

    @property
    def patches(self) -> int:
        return sum(self.counts)

    @property
    def images(self) -> int:
        return len(self.counts)


@dataclass
class EncodeRequest(Counted):
    """One request's images and the output they want (see the module docstring)."""

    arrays: list[np.ndarray]  # uint8 [H, W, 3] (a video: [n, H, W, 3]), sides multiples of patch_size * merge_size
    counts: list[int]  # patches per image
    pooling: str  # resolved (the ingress resolves a request's None to the service's vector pooling)
    llm: str | None = None  # LLM-ready outputs in this wire dtype (`deployments.llm_outputs`) instead of pooling
    deadline: float | None = None  # time.time() past which nobody waits for it (the replica drops it unrun)
    queued_at: float = field(default_factory=time.perf_counter)  # made (in the replica: entered its queue)

    @property
    def form(self) -> tuple[str, str | None]:
        """What its outputs are: records of one form run in one encoder call."""
        return self.pooling, self.llm

    def pack(self, start: int, end: int) -> EncodeRequest:
        """Images [start, end) as a request of their own (same form and deadline)."""
        return EncodeRequest(self.arrays[start:end], self.counts[start:end], self.pooling, self.llm, self.deadline)

    def call(self) -> tuple[str, dict[str, Any]]:
        """The encoder replica's method and its keyword arguments for this request (the pixels go positionally)."""
        size = {"num_patches": self.patches, "num_images": self.images, "deadline": self.deadline}
        if self.llm is not None:
            return "encode_llm_pixels", {"dtype": self.llm, **size}
        return "encode_pixels", {"pooling": self.pooling, **size}


def patch_count(x: np.ndarray, patch_size: int, temporal_patch_size: int = 1) -> int:
    """Patches of one resized item: an image uint8 [H, W, 3] (H/P x W/P), or a video's sampled frames uint8
    [n, H, W, 3] (ceil(n / T) x H/P x W/P: an odd count is padded with the last frame, as the video processor)."""
    if x.ndim == 4:
        return -(-x.shape[0] // temporal_patch_size) * (x.shape[1] // patch_size) * (x.shape[2] // patch_size)
    return (x.shape[0] // patch_size) * (x.shape[1] // patch_size)


class Group(NamedTuple):
    """Records of one output form, merged: `members` (their positions) and `merged` (all their images, in order)."""

    members: list[int]
    merged: EncodeRequest | TextRequest

    def scatter(self, outputs: Sequence, requests: Sequence[EncodeRequest | TextRequest], into: list) -> None:
        """`outputs` of `merged` (one per image, in order) into `into[i]` for each member i, by its image count."""
        pos = 0
        for i in self.members:
            n = requests[i].images
            into[i] = outputs[pos : pos + n]
            pos += n


@dataclass
class TextRequest(Counted):
    """One request's texts and the output they want (see the module docstring): the text counterpart of
    `EncodeRequest`, read by the same batchers (`counts`, `patches`, `images`) with tokens for patches."""

    texts: list[str]
    counts: list[int]  # tokens per text as the batchers size it: the text tower's fixed length
    pooling: str  # resolved: "model" or "model-l2"
    deadline: float | None = None
    queued_at: float = field(default_factory=time.perf_counter)

    @property
    def form(self) -> tuple[str, str]:
        return "text", self.pooling

    def pack(self, start: int, end: int) -> TextRequest:
        return TextRequest(self.texts[start:end], self.counts[start:end], self.pooling, self.deadline)

    def call(self) -> tuple[str, dict[str, Any]]:
        """`encode_texts` and its keyword arguments (routers read `num_tokens` and `num_texts`)."""
        size = {"num_tokens": self.patches, "num_texts": self.images, "deadline": self.deadline}
        return "encode_texts", {"pooling": self.pooling, **size}


def merge(requests: Sequence[EncodeRequest | TextRequest], deadline: float | None) -> EncodeRequest | TextRequest:
    """Records of one form as one record (their items in order) with `deadline`."""
    first = requests[0]
    counts = [n for r in requests for n in r.counts]
    if isinstance(first, TextRequest):
        return TextRequest([t for r in requests for t in r.texts], counts, first.pooling, deadline)
    return EncodeRequest([x for r in requests for x in r.arrays], counts, first.pooling, first.llm, deadline)


def group(requests: Sequence[EncodeRequest | TextRequest]) -> list[Group]:
    """`requests` grouped by output form, in order of first appearance; a group's merged request is wanted until
    its last member's deadline (none when a member has none)."""
    forms: dict[tuple[str, str | None], list[int]] = {}
    for i, r in enumerate(requests):
        forms.setdefault(r.form, []).append(i)
    groups = []
    for members in forms.values():
        deadlines = [requests[i].deadline for i in members]
        merged = merge([requests[i] for i in members], None if None in deadlines else max(deadlines))
        groups.append(Group(members, merged))
    return groups
