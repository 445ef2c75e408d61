"""The text tower's weights of a full CLIPModel / SiglipModel / Siglip2Model checkpoint (under `text_model.`,
CLIP's `text_projection.weight` at the top level) and the zero-shot head's scalars (`logit_scale`, SigLIP's
`logit_bias`). Safetensors only, as for the vision tower (`encoder.loading.checkpoint`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import SafetensorError

from encoder.errors import CheckpointError, reason
from encoder.loading.checkpoint import _open, read_weight_map

if TYPE_CHECKING:
    import torch

HEAD_SCALARS = ("logit_scale", "logit_bias")
# the tokenizer's files (`encoder.tokenization`), fetched from the Hub with the text tower's shards
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
TEXT_MODEL_TYPES = ("clip", "siglip", "siglip2")
_IGNORED = ("position_ids",)  # non-persistent buffers some exporters still write


def _is_text_key(name: str) -> bool:
    return name.startswith("text_") or name in HEAD_SCALARS


def text_side_files(directory: Path) -> list[str]:
    """What the text side of a checkpoint whose `config.json` and index (if sharded) are in `directory` needs
    beyond the vision tower's files: the tokenizer's files and the shards holding text weights; [] for a
    checkpoint without a text tower (a vision model alone, a VLM)."""
    from encoder.loading.checkpoint import read_json

    raw = read_json(directory / "config.json")
    if raw.get("model_type") not in TEXT_MODEL_TYPES or not isinstance(raw.get("text_config"), dict):
        return []
    index = directory / "model.safetensors.index.json"
    shards = [s for k, s in read_weight_map(index).items() if _is_text_key(k)] if index.exists() else []
    return [*TOKENIZER_FILES, *dict.fromkeys(shards)]


def _text_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_weight_map(index)
        names = [s for k, s in weight_map.items() if _is_text_key(k)]
        files = [directory / s for s in dict.fromkeys(names)]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise CheckpointError(f"{index} lists shards that are missing: {', '.join(missing)}")
        return files
    return [directory / "model.safetensors"]


def read_text_state(directory: Path, model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """(the text tower's tensors keyed by our parameter names, the head's scalars present) of a checkpoint;
    CheckpointError for a missing, unexpected or misshapen weight."""
    params = dict(model.state_dict())
    prefix, top = model.checkpoint_prefix, set(model.checkpoint_top_level)
    state: dict[str, torch.Tensor] = {}
    scalars: dict[str, float] = {}
    extra: list[str] = []
    for path in _text_files(directory):
        with _open(path) as f:
            for key in f.keys():
                name = key if key in top else key[len(prefix) :] if key.startswith(prefix) else None
                if name is None and key not in HEAD_SCALARS:
                    continue
                try:
                    tensor = f.get_tensor(key)
                except (SafetensorError, OSError, ValueError) as exc:
                    raise CheckpointError(f"{path}: tensor {key!r} is unreadable ({reason(exc)})") from None
                if key in HEAD_SCALARS:
                    scalars[key] = float(tensor.float().reshape(-1)[0])
                elif name in params:
                    state[name] = tensor
                elif not name.endswith(_IGNORED):
                    extra.append(key)
    if extra:
        raise CheckpointError(f"{directory}: unexpected text weights not in the model: {', '.join(sorted(extra)[:5])}")
    missing = sorted(set(params) - set(state))
    if missing:
        raise CheckpointError(f"{directory}: missing text weights ({len(missing)}): {', '.join(missing[:5])}")
    for name, tensor in state.items():
        if tensor.shape != params[name].shape:
            raise CheckpointError(
                f"{directory}: text weight {name!r} has shape {tuple(tensor.shape)}, the config expects "
                f"{tuple(params[name].shape)}"
            )
    return state, scalars
