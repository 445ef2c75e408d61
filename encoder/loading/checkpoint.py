"""Loading vision towers from local Hugging Face checkpoint directories (safetensors only).

Accepted layouts: `config.json` of a full VLM (its `vision_config` is used) or of a vision tower
alone; weights in `model.safetensors` or shards listed in `model.safetensors.index.json`; vision
weights under `visual.`, `model.visual.` or at the top level (a vision tower saved alone). Only
the vision tensors are read, so a 7B VLM checkpoint costs the tower's bytes, not the LLM's.
Qwen-family model types: qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_vl_moe, qwen3_5, qwen3_5_moe (full
VLMs, `*ForConditionalGeneration` saved by transformers 5: tower under `model.visual.`, DeepStack
mergers as `deepstack_merger_list.K.*`) and their `*_vision` tower types (`config.from_hf_dict`).
CLIP / SigLIP: a full `CLIPModel` / `SiglipModel` (vision weights under `vision_model.`, CLIP's
`visual_projection.` at the top level; the text tower is not read) or the vision model alone
(`CLIPVisionModelWithProjection`, `SiglipVisionModel`); the tower class names its own prefixes
(`checkpoint_prefixes`, `checkpoint_top_level`).
Pickled weights (`*.bin`, `*.pt`) are refused: unpickling runs arbitrary code.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import SafetensorError, safe_open

from encoder.config import Dinov2VisionConfig, Dinov3VisionConfig, QwenVisionConfig, VisionConfig, from_hf_dict
from encoder.errors import CheckpointError, ConfigError, reason

if TYPE_CHECKING:  # torch is imported where weights are read: checking a model (`build_app`'s preflight) needs none
    import torch

_PREFIXES = ("model.visual.", "visual.", "vision_tower.", "")


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({reason(exc)})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


# Where a checkpoint keeps its image processor's settings, in the order transformers' AutoImageProcessor reads
# them: transformers 5's processor.save_pretrained writes every processor's settings to one file, the image
# processor's under "image_processor"; transformers 4 (most published checkpoints) wrote them alone.
PROCESSOR_FILE = "processor_config.json"
IMAGE_PROCESSOR_FILE = "preprocessor_config.json"


def read_image_processor(directory: Path) -> tuple[dict, Path] | None:
    """The image processor's settings in a checkpoint directory and the file they came from: the
    "image_processor" entry of processor_config.json when it has one, else preprocessor_config.json;
    None when neither holds them."""
    combined = directory / PROCESSOR_FILE
    if combined.exists():
        nested = read_json(combined).get("image_processor")
        if nested is not None:
            if not isinstance(nested, dict):
                raise CheckpointError(f"{combined}: 'image_processor' must be a JSON object")
            return nested, combined
    alone = directory / IMAGE_PROCESSOR_FILE
    return (read_json(alone), alone) if alone.exists() else None


VIDEO_PROCESSOR_FILE = "video_preprocessor_config.json"


def read_video_processor(directory: Path) -> tuple[dict, Path] | None:
    """The video processor's settings in a checkpoint directory and their file, found as transformers finds them
    (`BaseVideoProcessor.get_video_processor_dict`): the "video_processor" entry of processor_config.json, else
    video_preprocessor_config.json, else the image processor's preprocessor_config.json; None when none exists."""
    combined = directory / PROCESSOR_FILE
    if combined.exists():
        nested = read_json(combined).get("video_processor")
        if nested is not None:
            if not isinstance(nested, dict):
                raise CheckpointError(f"{combined}: 'video_processor' must be a JSON object")
            return nested, combined
    for name in (VIDEO_PROCESSOR_FILE, IMAGE_PROCESSOR_FILE):
        if (directory / name).exists():
            return read_json(directory / name), directory / name
    return None


def load_config(directory: Path) -> VisionConfig:
    raw = read_json(directory / "config.json")
    vision = raw.get("vision_config")
    if isinstance(raw.get("vision_config_dict"), dict):  # older CLIP configs: these values win (as in HF)
        vision = {**(vision if isinstance(vision, dict) else {}), **raw["vision_config_dict"]}
    try:
        if isinstance(vision, dict):
            if raw.get("model_type") == "clip" and raw.get("projection_dim") is not None:
                # CLIPModel's visual projection is sized by the top-level projection_dim
                vision = {**vision, "projection_dim": raw["projection_dim"]}
            return from_hf_dict(vision, model_type=raw.get("model_type"))
        config = from_hf_dict(raw)
    except ConfigError as exc:
        raise CheckpointError(f"{directory / 'config.json'}: {exc}") from None
    return dino_input_size(config, directory) if isinstance(config, Dinov2VisionConfig | Dinov3VisionConfig) else config


def dino_input_size(config: Dinov2VisionConfig | Dinov3VisionConfig, directory: Path):
    """A DINOv2 / DINOv3 tower takes the images its processor makes (transformers resizes DINOv2's position table
    to any grid; DINOv3's rotary embedding needs no table): the square center crop (DINOv2) or square resize (DINOv3)
    of the checkpoint's image processor, when it has one, is the tower's input size."""
    found = read_image_processor(directory)
    raw = found[0] if found is not None else {}
    if isinstance(config, Dinov2VisionConfig):
        crop = raw.get("crop_size") if raw.get("do_center_crop", True) else None
    else:
        crop = raw.get("crop_size") if raw.get("do_center_crop", False) else raw.get("size")
    side = crop if isinstance(crop, int) and not isinstance(crop, bool) else None
    if isinstance(crop, dict) and crop.get("height") == crop.get("width") and isinstance(crop.get("height"), int):
        side = crop["height"]
    if side is None or side < config.patch_size or side == config.image_size:
        return config  # the processor check (`preprocessing.vit.check_matches_model`) explains what does not fit
    return config.model_copy(update={"image_size": side})


def read_weight_map(index: Path) -> dict[str, str]:
    """The `weight_map` (tensor name -> shard file) of a `model.safetensors.index.json`."""
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: missing or empty 'weight_map'")
    bad = next((name for name, shard in weight_map.items() if not isinstance(shard, str) or not shard), None)
    if bad is not None:
        shown = json.dumps(weight_map[bad])
        raise CheckpointError(f"{index}: 'weight_map' must map tensor names to shard file names: {bad!r} to {shown}")
    return weight_map


def vision_shards(weight_map: dict[str, str]) -> list[str]:
    """The shards a vision tower needs: those holding a tensor whose name says vision or visual
    (`model.visual.`, `visual.`, `vision_model.`, `vision_tower.`, CLIP's `visual_projection`), or
    every shard when no name does (a tower saved alone, unprefixed). A 7B VLM's tower lives in one
    or two of its shards: the LLM's are neither downloaded from the Hub nor required on disk."""
    marked = [shard for name, shard in weight_map.items() if "visual" in name or "vision" in name]
    return list(dict.fromkeys(marked or weight_map.values()))


def weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        files = [directory / name for name in vision_shards(read_weight_map(index))]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise CheckpointError(f"{index} lists shards that are missing: {', '.join(missing)}")
        return files
    single = directory / "model.safetensors"
    if single.exists():
        return [single]
    pickled = sorted(p.name for p in directory.glob("*") if p.suffix in {".bin", ".pt", ".pth", ".ckpt"})
    if pickled:
        raise CheckpointError(
            f"{directory}: only pickled weights found ({', '.join(pickled)}); safetensors are required "
            "(convert with transformers' save_pretrained(safe_serialization=True))"
        )
    raise CheckpointError(f"{directory}: no model.safetensors or model.safetensors.index.json")


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot read safetensors file ({reason(exc)})") from None


def read_vision_state(
    directory: Path,
    expected: set[str],
    prefixes: tuple[str, ...] = _PREFIXES,
    top_level: tuple[str, ...] = (),
) -> dict[str, torch.Tensor]:
    """The tensors of the vision tower, keyed by our parameter names (prefix removed).

    `prefixes`: where the tower may live (the one holding most expected names wins); `top_level`:
    expected names stored at the top level whatever the prefix (CLIP's `visual_projection.weight`).
    """
    files = weight_files(directory)
    located: dict[str, list[tuple[Path, str]]] = {p: [] for p in prefixes}
    top: list[tuple[Path, str]] = []
    for path in files:
        with _open(path) as f:
            for key in f.keys():
                if key in top_level:
                    top.append((path, key))
                    continue
                for prefix in prefixes:
                    if key.startswith(prefix) and key[len(prefix) :] in expected:
                        located[prefix].append((path, key))
    # the prefix under which the tower lives: the one holding most of the expected names
    prefix = max(prefixes, key=lambda p: len(located[p]))
    if not located[prefix]:
        example = next(iter(sorted(expected - set(top_level))))
        where = (
            f"'visual.{example}' or 'model.visual.…'"
            if prefixes == _PREFIXES
            else " or ".join(f"'{p}{example}'" for p in prefixes)
        )
        raise CheckpointError(f"{directory}: no vision tower weights found (looked for keys like {where})")
    state: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for path, key in top + located[prefix]:
        by_file.setdefault(path, []).append(key)
    for path, keys in by_file.items():
        with _open(path) as f:
            for key in keys:
                try:
                    state[key if key in top_level else key[len(prefix) :]] = f.get_tensor(key)
                except (SafetensorError, OSError, ValueError) as exc:
                    raise CheckpointError(f"{path}: tensor {key!r} is unreadable ({reason(exc)})") from None
    _check_unexpected(directory, files, prefix, expected | set(top_level))
    return state


def _check_unexpected(directory: Path, files: list[Path], prefix: str, expected: set[str]) -> None:
    """Keys under the vision prefix that the model does not have are an error (wrong model)."""
    # with no prefix (a tower saved alone) every key belongs to the tower
    extra = []
    for path in files:
        with _open(path) as f:
            extra += [k for k in f.keys() if k.startswith(prefix) and k[len(prefix) :] not in expected]
    # non-persistent buffers some exporters still write are harmless
    extra = [k for k in extra if not k.endswith(("inv_freq", "position_ids"))]
    if extra:
        shown = ", ".join(sorted(extra)[:5])
        raise CheckpointError(f"{directory}: unexpected vision weights not in the model: {shown}")


def load_weights(model: torch.nn.Module, directory: Path) -> None:
    """Copy the checkpoint's vision weights into `model`, checking names and shapes."""
    import torch

    params = dict(model.state_dict())
    prefixes = getattr(model, "checkpoint_prefixes", _PREFIXES)
    top_level = getattr(model, "checkpoint_top_level", ())
    state = read_vision_state(directory, set(params), prefixes, top_level)
    missing = sorted(set(params) - set(state))
    if missing:
        shown = ", ".join(missing[:5])
        hint = ""
        if missing == ["visual_projection.weight"]:
            hint = (
                " (a CLIPVisionModel checkpoint has no projection to image_embeds; use a CLIPModel or "
                "CLIPVisionModelWithProjection checkpoint)"
            )
        raise CheckpointError(f"{directory}: missing vision weights ({len(missing)}): {shown}{hint}")
    with torch.no_grad():
        for name, tensor in state.items():
            target = params[name]
            expected = checkpoint_shape(model, name, tuple(target.shape))
            if tensor.shape != target.shape and tensor.shape == expected:
                tensor = tensor.reshape(target.shape)
            if tensor.shape != target.shape:
                raise CheckpointError(
                    f"{directory}: weight {name!r} has shape {tuple(tensor.shape)}, the config expects {expected}"
                )
            target.copy_(tensor)


def checkpoint_shape(model: torch.nn.Module, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape checkpoints store our parameter `name` (of `shape`) in: the patch embedding, a linear
    [D, C*T*P*P] here, is a Conv3d [D, C, T, P, P] there (Qwen), a Conv2d [D, C, P, P] (CLIP / SigLIP).
    Only that layout is reshaped: another of the same size (MLX's channels-last [D, T, P, P, C]) would
    scramble every patch."""
    cfg = getattr(model, "cfg", None)
    if cfg is None or "patch_embed" not in name or not name.endswith(".weight") or len(shape) != 2:
        return shape
    temporal = (cfg.temporal_patch_size,) if isinstance(cfg, QwenVisionConfig) else ()
    return (shape[0], cfg.in_channels, *temporal, cfg.patch_size, cfg.patch_size)
