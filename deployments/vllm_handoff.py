"""vLLM's own forms of a Qwen tower's outputs (docs/llm-handoff.md "vLLM"): the one tensor per image its Qwen
models produce, and the file its disk encoder-cache connector reads.

* Layout `"vllm"` (`vllm_wire`): per image `[tokens, out_dim * (1 + L)]`, the merger's tokens followed by the
  L DeepStack layers in model order, concatenated on the last dimension (Qwen2-VL, Qwen2.5-VL and Qwen3.5 have
  no DeepStack: the tokens alone). It is what vLLM's `Qwen3VLForConditionalGeneration.embed_multimodal` returns
  per item and what it takes as `image_embeds`; layout `"parts"` is the tokens and the layers apart
  (`deployments.llm_outputs.WireLLM`). The concatenation is of the wire arrays as they are, so bfloat16 bit
  patterns stay bit-identical.
* The disk connector (`ECExampleConnector`): `<shared_storage_path>/<mm_hash>/encoder_cache.safetensors`
  holding that tensor under the key `ec_cache`; vLLM uses a request item's `uuid` as its `mm_hash`.
  `write_ec_cache` writes it atomically (a temporary file in the same directory, then a rename: a reader sees
  no file or the whole file) with numpy alone (the ingress does not import torch): the safetensors format is
  an 8-byte little-endian header length, a JSON header naming each tensor's dtype, shape and byte range, then
  the bytes. bfloat16 is written from its bit patterns (`BF16`), which numpy cannot name.

A uuid becomes a directory name, so it is checked (`check_uuid`): letters, digits, `.`, `_`, `-`, `:`, at
most 255 characters, not starting with `.` (no `..`, no `/`, no hidden or empty names), and the resolved path
must stay inside the cache directory.
"""

from __future__ import annotations

import json
import os
import re
import tempfile

import numpy as np

from deployments.errors import ErrorCode, RequestError
from deployments.llm_outputs import WireLLM, check_dtype

LAYOUTS = ("parts", "vllm")
# tower families whose vLLM model takes `image_embeds` in this layout (Qwen3.5's tower is the qwen3_vl family)
VLLM_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
EC_CACHE_FILE = "encoder_cache.safetensors"
EC_CACHE_KEY = "ec_cache"
_SAFETENSORS_DTYPE = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
_UUID = re.compile(r"[A-Za-z0-9_:-][A-Za-z0-9._:-]{0,254}")


def check_layout(layout: str) -> str:
    if isinstance(layout, str) and layout in LAYOUTS:
        return layout
    raise RequestError(
        f"unknown layout {str(layout)[:40]!r}; expected one of {', '.join(LAYOUTS)}",
        ErrorCode.INVALID_LAYOUT, "embedding_layout",
    )  # fmt: skip


def check_vllm_model(family: str | None, model_name: str, param: str = "embedding_layout") -> None:
    """400 `invalid_layout` unless the served tower is one of vLLM's Qwen VLM towers."""
    if family not in VLLM_FAMILIES:
        raise RequestError(
            f"the vLLM layout is for Qwen VLM towers (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5); the served model "
            f"{model_name!r} is a {family or 'non-Qwen'} tower",
            ErrorCode.INVALID_LAYOUT, param,
        )  # fmt: skip


def vllm_wire(wire: WireLLM) -> WireLLM:
    """One image's `WireLLM` in the vLLM layout: `(tokens ++ deepstack on the last axis, [], grid)`."""
    tokens, deepstack, grid, *facts = wire  # a video's facts (timestamps, second_per_grid_ts) stay after the grid
    if not deepstack:
        return tokens, [], grid, *facts
    return np.concatenate([tokens, *deepstack], axis=1), [], grid, *facts


def check_uuid(uuid: object, where: str = "ec_cache_uuids") -> str:
    """`uuid` as a directory name under the cache directory; 400 `invalid_uuid` naming `where` otherwise."""
    if not isinstance(uuid, str):
        raise RequestError(f"{where}: a uuid must be a string, not {type(uuid).__name__}", ErrorCode.INVALID_UUID,
                           "ec_cache_uuids")  # fmt: skip
    if not _UUID.fullmatch(uuid):
        shown = uuid if len(uuid) <= 60 else uuid[:60] + "..."
        raise RequestError(
            f"{where}: uuid {shown!r} is not a safe directory name: 1 to 255 of A-Z a-z 0-9 . _ - : and not "
            "starting with '.'",
            ErrorCode.INVALID_UUID, "ec_cache_uuids",
        )  # fmt: skip
    return uuid


def check_uuids(uuids: object, n: int, where: str = "ec_cache_uuids") -> list[str]:
    """One checked, distinct uuid per image (`n` of them)."""
    if isinstance(uuids, str) or not isinstance(uuids, list | tuple):
        raise RequestError(f"{where} must be a list of strings, one per image", ErrorCode.INVALID_UUID,
                           "ec_cache_uuids")  # fmt: skip
    if len(uuids) != n:
        raise RequestError(f"{where} has {len(uuids)} uuids for {n} images; give one per image",
                           ErrorCode.INVALID_UUID, "ec_cache_uuids")  # fmt: skip
    checked = [check_uuid(u, f"{where}[{i}]") for i, u in enumerate(uuids)]
    if len(set(checked)) != len(checked):
        seen: set[str] = set()
        dup = next(u for u in checked if u in seen or seen.add(u))
        raise RequestError(f"{where}: uuid {dup!r} is given twice", ErrorCode.INVALID_UUID, "ec_cache_uuids")
    return checked


def ec_cache_path(root: str, uuid: str) -> str:
    """`<root>/<uuid>/encoder_cache.safetensors`, the file vLLM's disk connector reads for `mm_hash` = uuid;
    refused (400 `invalid_uuid`) when the uuid or an existing link would take it outside `root`."""
    check_uuid(uuid)
    base = os.path.realpath(root)
    folder = os.path.realpath(os.path.join(base, uuid))
    if os.path.dirname(folder) != base:
        raise RequestError(f"uuid {uuid!r} resolves outside the cache directory", ErrorCode.INVALID_UUID,
                           "ec_cache_uuids")  # fmt: skip
    return os.path.join(folder, EC_CACHE_FILE)


def safetensors_bytes(array: np.ndarray, dtype: str, key: str = EC_CACHE_KEY) -> tuple[bytes, np.ndarray]:
    """(the safetensors header, the C-contiguous little-endian array) of one tensor `key` in the wire `dtype`
    (`array` as `deployments.llm_outputs.to_wire` gives it: bfloat16 as uint16 bit patterns)."""
    check_dtype(dtype)
    data = np.ascontiguousarray(array)
    want = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}[dtype]
    if data.dtype != want:
        raise ValueError(f"a {dtype} tensor is held as {np.dtype(want).name}, not {data.dtype}")
    data = data.astype(data.dtype.newbyteorder("<"), copy=False)
    meta = {key: {"dtype": _SAFETENSORS_DTYPE[dtype], "shape": list(data.shape), "data_offsets": [0, data.nbytes]}}
    header = json.dumps(meta, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # the data starts 8-byte aligned
    return len(header).to_bytes(8, "little") + header, data


def write_ec_cache(root: str, uuid: str, array: np.ndarray, dtype: str) -> str:
    """Write `array` (one image's vLLM-layout tensor in the wire `dtype`) where vLLM's disk connector reads the
    encoder cache of `mm_hash` = `uuid`; atomic (temporary file, fsync, rename). Returns the file's path."""
    path = ec_cache_path(root, uuid)
    header, data = safetensors_bytes(array, dtype)
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{EC_CACHE_FILE}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(header)
            f.write(memoryview(data).cast("B"))
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; the LLM server may run as another user
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def ec_cache_item(index: int, uuid: str, wire: WireLLM, dtype: str) -> dict:
    """What a caller gets back for one written image (the tensor itself stays on disk; HTTP answers do not
    name the server's paths)."""
    tensor, _, grid = wire
    return {"object": "ec_cache", "index": index, "uuid": uuid, "shape": list(tensor.shape), "dtype": dtype,
            "grid_thw": list(grid)}  # fmt: skip
