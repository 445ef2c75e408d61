"""The ingress's cache of encoder outputs by content (issue 47 item 3; docs/service.md "Encoder cache").

Per ingress replica, a least-recently-used map from a key to an item's finished output (a pooled vector, a token
matrix, a `WireLLM` tuple in its wire dtype and layout, or a text's vector), bounded in bytes (`cache_mib`; 0:
off). A hit skips decode and encode: the lifecycle (`lifecycle.Lifecycle.encode`) keys every item before anything
is decoded and sends only the misses on.

A key (`CacheKey`) is everything that changes the answer:
* the model (`model_fingerprint`): the served model's facts from the replica's `describe()` (name, its source:
  directory, Hub revision and commit, random weights; family, dtype, quantization, output sizes, the
  preprocessing settings, the text side) and the arguments it was loaded with (model, seed, dtype, attention,
  quantization, device), hashed once;
* the output form (`Form`): image or text, the resolved pooling, the LLM wire dtype (None: float32 vectors) and
  the layout ("parts" / "vllm");
* the content: SHA-256 of the encoded image bytes (a data URL or base64 string is decoded first, so the same
  image as bytes, base64 or a data URL is one entry), of a uint8 array's shape and bytes, or of a text's UTF-8;
  or the client's own key (`uuid`) in place of the hash, scoped by the caller's identity (the API key an HTTP
  request presented, `security.ApiKeyAuth.identity`; handle calls are one scope of their own): a client key is
  the client's promise about its content, so one tenant's key never reads another tenant's entry. Content hashes
  are shared across tenants (the same bytes give the same answer whoever sends them).
Inputs with no content key (an image URL, whose content may change at its source, a PIL image, a malformed
string whose error the decoder will name) are not cached unless they carry a client key.

Stored outputs are copies, made read-only (`freeze`): a stored buffer is never one a caller or a later request
could write, and the handle path hands out writable copies (`handed_out`). Bytes: the arrays' `nbytes` plus
`ENTRY_OVERHEAD` per entry; an entry larger than the bound is not stored, and every store evicts least recently
used entries until the total is within the bound again. Concurrent identical requests compute independently (no
waiting on another request's encode: a failure or cancellation of one never reaches the other); the first result
stored is replaced by the next one of the same key, whose bytes are the same. Everything here runs on the
ingress's event loop (one thread): no locks.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from deployments.errors import ErrorCode, RequestError
from deployments.ingress.inputs import is_url, parse_image_string
from deployments.ingress.limits import check_request_patches

# bytes counted per entry beside its arrays: the key (a tuple of short strings and a 32-byte digest), the
# OrderedDict slot, the entry record and the arrays' headers (measured with sys.getsizeof: ~0.6 KiB)
ENTRY_OVERHEAD = 640
# a client's key: a non-empty string up to this many characters
MAX_UUID_CHARS = 256
# the describe() facts and the AppArgs fields that make the model answer differently
_INFO_FIELDS = (
    "model", "model_info", "family", "dtype", "quantization", "out_dim", "output_dims", "deepstack_layers",
    "preprocess", "text",
)  # fmt: skip
_ARG_FIELDS = ("model", "seed", "dtype", "attention", "quantization", "device")


@dataclass(frozen=True)
class Form:
    """What is asked of an item: `kind` "image" or "text", the resolved `pooling`, `llm` the LLM outputs' wire dtype
    (None: float32 vectors), `layout` of the LLM outputs ("parts" / "vllm")."""

    kind: str
    pooling: str
    llm: str | None = None
    layout: str = "parts"


class CacheKey(NamedTuple):
    model: str  # `model_fingerprint`
    form: Form
    content: tuple  # ("sha256", digest) or ("uuid", scope, uuid)


def model_fingerprint(info: dict, args: Any) -> str:
    """A digest of what makes the served model answer as it does (see the module docstring)."""
    facts = {"info": {k: info.get(k) for k in _INFO_FIELDS}, "args": {k: getattr(args, k, None) for k in _ARG_FIELDS}}
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()


def content_digest(x: Any, max_image_bytes: int | None = None) -> bytes | None:
    """SHA-256 of an input's content: encoded bytes (a data URL / base64 string decoded first), a uint8 array's
    shape and bytes; None for what has no content key (a URL, a PIL image, anything the decoder will refuse)."""
    if isinstance(x, str):
        if is_url(x):
            return None
        try:
            x, _ = parse_image_string(x, max_image_bytes)
        except RequestError:
            return None  # the decoder says what is wrong with it
    if isinstance(x, bytes | bytearray | memoryview):
        return _sha(b"encoded\0", x.tobytes() if isinstance(x, memoryview) and not x.c_contiguous else x)
    if isinstance(x, np.ndarray) and x.dtype == np.uint8 and x.ndim in (2, 3):
        return _sha(f"uint8 array {x.shape}\0".encode(), np.ascontiguousarray(x))
    return None


def _sha(tag: bytes, data) -> bytes:
    h = hashlib.sha256(tag)
    h.update(data)  # hashlib releases the GIL above 2 KiB: large inputs are hashed in a thread
    return h.digest()


def text_digest(text: str) -> bytes:
    return hashlib.sha256(b"text\0" + text.encode("utf-8", "surrogatepass")).digest()


def check_cache_uuids(uuids: Any, n: int, where: str) -> list[str | None]:
    """One client key (or None) per image: a non-empty string of at most `MAX_UUID_CHARS`; 400 `invalid_uuid`."""
    if uuids is None:
        return [None] * n
    if isinstance(uuids, str) or not isinstance(uuids, list | tuple) or len(uuids) != n:
        raise RequestError(f"{where} must be a list of one uuid (or None) per image, {n} of them",
                           ErrorCode.INVALID_UUID, where)  # fmt: skip
    for i, u in enumerate(uuids):
        check_cache_uuid(u, f"{where}[{i}]")
    return list(uuids)


def check_cache_uuid(u: Any, where: str) -> str | None:
    if u is None or (isinstance(u, str) and 0 < len(u) <= MAX_UUID_CHARS):
        return u
    raise RequestError(f"{where}: a cache uuid is a non-empty string of at most {MAX_UUID_CHARS} characters",
                       ErrorCode.INVALID_UUID, where)  # fmt: skip


def _frozen(x: np.ndarray) -> np.ndarray:
    out = np.array(x, copy=True, order="C")
    out.setflags(write=False)
    return out


def freeze(value: Any) -> tuple[Any, int]:
    """(a read-only copy of an output, its arrays' bytes): an array, or a `WireLLM` tuple (tokens, DeepStack
    layers, grid)."""
    if isinstance(value, np.ndarray):
        out = _frozen(value)
        return out, out.nbytes
    tokens, deepstack, grid = value
    tokens, layers = _frozen(tokens), tuple(_frozen(d) for d in deepstack)
    return (tokens, layers, tuple(grid)), tokens.nbytes + sum(d.nbytes for d in layers)


def handed_out(value: Any) -> Any:
    """A writable copy of a stored (read-only) output, as an uncached answer would be; others as they are."""
    if isinstance(value, np.ndarray):
        return value if value.flags.writeable else value.copy()
    if isinstance(value, tuple) and len(value) == 3 and isinstance(value[0], np.ndarray):
        tokens, deepstack, grid = value
        return handed_out(tokens), [handed_out(d) for d in deepstack], grid
    return value


class Entry(NamedTuple):
    value: Any  # frozen (`freeze`)
    count: int  # an image's patches or a text's real tokens (what `usage` counts)
    nbytes: int  # arrays + ENTRY_OVERHEAD


class EncoderCache:
    """The bounded LRU (see the module docstring). `telemetry`: a `metrics.IngressTelemetry` (hits, misses, bytes)."""

    def __init__(self, max_bytes: int, telemetry: Any = None) -> None:
        self.max_bytes = int(max_bytes)
        self._entries: OrderedDict[CacheKey, Entry] = OrderedDict()
        self.bytes = 0
        self.evictions = 0
        self._telemetry = telemetry

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: CacheKey) -> bool:
        return key in self._entries

    def keys(self) -> list[CacheKey]:
        """Least recently used first."""
        return list(self._entries)

    def lookup(self, keys: list[CacheKey | None], kind: str) -> dict[int, Entry]:
        """{position: entry} of the keys stored (each becomes the most recently used); hits and misses counted
        (an item without a key is a miss)."""
        hits = {}
        for i, key in enumerate(keys):
            entry = self._entries.get(key) if key is not None else None
            if entry is not None:
                self._entries.move_to_end(key)
                hits[i] = entry
        if self._telemetry is not None and keys:
            self._telemetry.cache_lookups(kind, len(hits), len(keys) - len(hits))
        return hits

    def put(self, key: CacheKey, value: Any, count: int) -> bool:
        """Store a read-only copy of `value`; False (nothing stored) when it alone exceeds the bound."""
        frozen, nbytes = freeze(value)
        nbytes += ENTRY_OVERHEAD
        if nbytes > self.max_bytes:
            return False
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old.nbytes
        while self._entries and self.bytes + nbytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.bytes -= evicted.nbytes
            self.evictions += 1
        self._entries[key] = Entry(frozen, int(count), nbytes)
        self.bytes += nbytes
        if self._telemetry is not None:
            self._telemetry.cache_held(self.bytes)
        return True

    def snapshot(self) -> dict:
        return {"entries": len(self._entries), "bytes": self.bytes, "max_bytes": self.max_bytes,
                "evictions": self.evictions}  # fmt: skip


# ------------------------------------------------------------------------------------------ one request

# inputs larger than this in all (encoded bytes, base64 text, array bytes) are hashed in a thread
_HASH_INLINE_BYTES = 1 << 20


def item_key(
    model: str, form: Form, x: Any, uuid: str | None, scope: str, max_image_bytes: int | None = None
) -> CacheKey | None:
    """An image's key: the client's `uuid` in `scope`, else its content's digest; None when it has neither."""
    if uuid is not None:
        return CacheKey(model, form, ("uuid", scope, uuid))
    digest = content_digest(x, max_image_bytes)
    return None if digest is None else CacheKey(model, form, ("sha256", digest))


def _size(x: Any) -> int:
    if isinstance(x, bytes | bytearray | memoryview | str):
        return len(x)
    return x.nbytes if isinstance(x, np.ndarray) else 0


async def image_keys(
    model: str, form: Form, images: list, uuids: list | None, scope: str, max_image_bytes: int | None
) -> list[CacheKey | None]:
    """Every image's key (`item_key`); hashed in a thread when the images are large."""
    uuids = uuids or [None] * len(images)

    def keys() -> list[CacheKey | None]:
        return [item_key(model, form, x, u, scope, max_image_bytes) for x, u in zip(images, uuids, strict=True)]

    if sum(_size(x) for x, u in zip(images, uuids, strict=True) if u is None) <= _HASH_INLINE_BYTES:
        return keys()
    return await asyncio.to_thread(keys)


def _where(label: Any, i: int) -> str:
    return label(i) if callable(label) else f"{label}[{i}]"


class Lookup:
    """One request's items against the cache: the hits, what goes on to decode and encode (`misses`), and the
    answer put together again with the misses stored (`finish`)."""

    def __init__(self, cache: EncoderCache, image_keys: list, text_keys: list) -> None:
        self.cache, self.keys = cache, {"image": image_keys, "text": text_keys}
        self.hits = {
            "image": cache.lookup(image_keys, "image") if image_keys else {},
            "text": cache.lookup(text_keys, "text") if text_keys else {},
        }
        self.hit_patches = sum(e.count for e in self.hits["image"].values())

    def misses(self, kind: str, items: list) -> list:
        hits = self.hits[kind]
        return list(items) if not hits else [x for i, x in enumerate(items) if i not in hits]

    def miss_label(self, label: Any) -> Any:
        """How errors name the misses' image j: as the request names the image it is."""
        hits = self.hits["image"]
        if not hits:
            return label
        positions = [i for i in range(len(self.keys["image"])) if i not in hits]
        return lambda j: _where(label, positions[j])

    def admit(self, max_patches: int | None, reserve: Any) -> Any:
        """The decoder's patch admission of the misses, with the request's limit held against all its images
        (hits hold no decode or device work: only the misses are reserved)."""
        hit_patches = self.hit_patches

        def admit(total: int) -> None:
            if max_patches is not None:
                check_request_patches(total + hit_patches, max_patches)
            reserve(total)

        return admit

    def finish(self, kind: str, computed: list, counts: list[int]) -> tuple[list, int]:
        """(every item's output in order: the hits' stored ones and the misses' `computed` ones, which are stored;
        the total of their counts: patches or real tokens)."""
        hits, keys = self.hits[kind], self.keys[kind]
        out, total, fresh = [], 0, iter(zip(computed, counts, strict=True))
        for i, key in enumerate(keys):
            if i in hits:
                value, count = hits[i].value, hits[i].count
            else:
                value, count = next(fresh)
                if key is not None:
                    self.cache.put(key, value, count)
            out.append(value)
            total += count
        return out, total
