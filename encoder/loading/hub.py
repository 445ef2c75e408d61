"""What a `model=` string names: a preset, a local checkpoint directory, or a Hugging Face Hub id.

`resolve_model(model)` answers before anything heavy is built (no tower, no weights read), so a
service or a CLI can refuse a bad model in well under a second with one line naming what was given
and what would have been accepted. Resolution order:

1. a preset name (`encoder.PRESETS`; random weights, flagged as such);
2. an existing directory (its `config.json` is parsed, its safetensors looked for);
3. a Hub id `org/name` or `org/name@revision` (branch, tag or commit), fetched with `huggingface_hub`
   into its standard cache (`HF_HOME` / `HF_HUB_CACHE`), honouring `HF_HUB_OFFLINE` and `HF_TOKEN`.
   Only `config.json`, the image processor's settings (`processor_config.json`,
   `preprocessor_config.json`), the safetensors index and the shards that hold the vision tower
   (`checkpoint.vision_shards`) are downloaded, and for an image-text model its tokenizer's files and text
   shards (`text_weights.text_side_files`); pickled weights never are.

Anything else that looks like a path (`/x`, `./x`, `~/x`, `x/y/z`), or is a `Path`, is a missing directory; what
follows an `@` is a revision, which may hold `/` (`org/name@refs/pr/12`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import huggingface_hub
from huggingface_hub import constants as hub_constants
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import validate_repo_id

from encoder.config import VisionConfig
from encoder.errors import CheckpointError, ConfigError, reason
from encoder.loading.checkpoint import IMAGE_PROCESSOR_FILE, PROCESSOR_FILE, load_config, read_weight_map, vision_shards
from encoder.loading.presets import PRESETS
from encoder.loading.text_weights import text_side_files

CONFIG_FILES = ("config.json", PROCESSOR_FILE, IMAGE_PROCESSOR_FILE, "model.safetensors.index.json")
SINGLE_WEIGHTS = "model.safetensors"
PICKLED_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
# org/name with Hub-legal characters, then an optional @revision (branch and tag names may hold '/')
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")
_LIBRARY = "vision-encoding-service"


# the presets an error names as examples (a tiny one, one per family); the rest are in `encoder.PRESETS`
_SHOWN_PRESETS = ("tiny", "qwen2.5-vl-7b", "qwen3-vl-8b", "clip-vit-l-14")


def accepted() -> str:
    """The sentence every resolution error ends with: what `model=` would have accepted (a few presets and a
    pointer to the rest, not all of them)."""
    shown = ", ".join(p for p in _SHOWN_PRESETS if p in PRESETS)
    return (
        f"expected a preset ({shown}, ...: {len(PRESETS)} in `encoder.PRESETS`), a directory with config.json and "
        "*.safetensors, or a Hugging Face Hub id org/name[@revision]"
    )


@dataclass(frozen=True)
class ResolvedModel:
    """Where a model's config and weights come from; `path` is None for presets."""

    given: str  # the string the caller passed
    kind: Literal["preset", "dir", "hub"]
    name: str  # what the model is called: the preset, the directory, the repo id
    config: VisionConfig
    path: Path | None = None  # the checkpoint directory (a Hub snapshot for "hub")
    random_weights: bool = False
    revision: str | None = None  # hub: the revision asked for (None: the default branch)
    commit: str | None = None  # hub: the snapshot's commit
    # False only for a Hub model checked with download_weights=False whose weights are not cached yet
    # (`encoder.load` of it downloads them)
    weights_on_disk: bool = True

    def info(self) -> dict:
        """JSON-ready facts for logs and `/v1/models`: name, kind, random_weights, path, revision, commit."""
        out = {"name": self.name, "kind": self.kind, "random_weights": self.random_weights}
        if self.path is not None:
            out["path"] = str(self.path)
        if self.kind == "hub":
            out.update(revision=self.revision, commit=self.commit)
        return out


def parse_hub_id(model: str) -> tuple[str, str | None] | None:
    """(repo id, revision or None) when `model` has the form of a Hub id, else None."""
    match = _HUB_ID.match(model)
    if match is None:
        return None
    try:
        validate_repo_id(match["repo"])
    except HFValidationError:
        return None
    return match["repo"], match["revision"]


def _looks_like_path(model: str) -> bool:
    name = model.split("@", 1)[0]  # a Hub revision may hold '/' (refs/pr/12, feature/x)
    return model.startswith(("/", "./", "../", "~", ".\\")) or name.count("/") > 1 or "\\" in model


def resolve_model(model: str | Path, *, download_weights: bool = True) -> ResolvedModel:
    """The preset, directory or Hub snapshot `model` names, checked; raises ConfigError (unknown name,
    missing path, unknown/gated Hub id, offline and not cached) or CheckpointError (no safetensors,
    bad config.json), each one line.

    `download_weights=False` fetches only a Hub model's small files (config, index) and checks that
    the repository has safetensors without downloading them: the check a service's driver makes
    before its replicas, which download the weights themselves, start.
    """
    if not isinstance(model, str | os.PathLike):
        raise ConfigError(f"model must be a str or a path, got {type(model).__name__}; {accepted()}")
    given = os.fspath(model)
    if not given.strip():
        raise ConfigError(f"model is empty; {accepted()}")
    if given in PRESETS:
        return ResolvedModel(given, "preset", given, PRESETS[given], random_weights=True)
    path = Path(given).expanduser()
    if path.is_dir():
        return ResolvedModel(given, "dir", given, _check_directory(path, given), path=path)
    if path.exists():
        raise ConfigError(f"model {given!r} is a file, not a checkpoint directory; {accepted()}")
    if _looks_like_path(given) or isinstance(model, os.PathLike):  # a Path names a directory, never a Hub id
        raise ConfigError(f"model {given!r}: no such directory; {accepted()}")
    hub = parse_hub_id(given)
    if hub is None:
        raise ConfigError(f"unknown preset {given!r} (and no such directory or Hub id); {accepted()}")
    return _resolve_hub(given, *hub, download_weights=download_weights)


def _check_directory(path: Path, given: str) -> VisionConfig:
    """The config of a checkpoint directory, after checking it has safetensors (not the tensors themselves)."""
    if not (path / "config.json").exists():
        raise CheckpointError(
            f"model {given!r}: {path / 'config.json'}: file not found; a checkpoint directory needs config.json "
            "and model.safetensors (or model.safetensors.index.json and its shards)"
        )
    config = load_config(path)
    if not _has_safetensors(path, given):
        pickled = sorted(p.name for p in path.iterdir() if p.suffix in PICKLED_SUFFIXES)
        raise CheckpointError(f"model {given!r}: {path} {_no_safetensors(pickled)}")
    return config


def _has_safetensors(path: Path, given: str) -> bool:
    """A single model.safetensors, or an index whose vision shards are all there."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        missing = [s for s in vision_shards(read_weight_map(index)) if not (path / s).exists()]
        if missing:
            raise CheckpointError(f"model {given!r}: {index} lists shards that are missing: {', '.join(missing)}")
        return True
    return (path / SINGLE_WEIGHTS).exists()


def _no_safetensors(pickled: list[str]) -> str:
    if pickled:
        return (
            f"has only pickled weights ({', '.join(pickled[:5])}); safetensors are required (convert with "
            "transformers' save_pretrained(safe_serialization=True))"
        )
    return "has no model.safetensors or model.safetensors.index.json"


def _resolve_hub(given: str, repo_id: str, revision: str | None, *, download_weights: bool) -> ResolvedModel:
    small = _snapshot(given, repo_id, revision, list(CONFIG_FILES))
    if not (small / "config.json").exists():
        raise CheckpointError(f"model {given!r}: the Hub repository {repo_id} has no config.json")
    config = load_config(small)
    index = small / "model.safetensors.index.json"
    shards = vision_shards(read_weight_map(index)) if index.exists() else [SINGLE_WEIGHTS]
    if download_weights:
        path = _snapshot(given, repo_id, revision, [*CONFIG_FILES, *shards])
        if not all((path / s).exists() for s in shards):
            _explain_missing_weights(given, repo_id, revision, path)
        _fetch_text_side(given, repo_id, revision, path)
    else:
        path = small
        if not all((path / s).exists() for s in shards):
            _check_remote_weights(given, repo_id, revision, shards)
    on_disk = all((path / s).exists() for s in shards)
    return ResolvedModel(
        given, "hub", repo_id, config, path=path, revision=revision, commit=path.name, weights_on_disk=on_disk
    )


def _fetch_text_side(given: str, repo_id: str, revision: str | None, path: Path) -> None:
    """The tokenizer files and text shards of an image-text model (`text_weights.text_side_files`), into the
    same snapshot. Optional: a repository without them, or an offline cache lacking them, serves images only."""
    files = text_side_files(path)
    if files:
        try:
            _snapshot(given, repo_id, revision, files)
        except ConfigError:
            pass


def _snapshot(given: str, repo_id: str, revision: str | None, patterns: list[str]) -> Path:
    """`snapshot_download` of these files into the Hub cache; its errors become one-line ConfigErrors."""
    try:
        folder = huggingface_hub.snapshot_download(
            repo_id, revision=revision, allow_patterns=patterns, library_name=_LIBRARY
        )
    except GatedRepoError:
        raise ConfigError(
            f"model {given!r}: the Hub repository {repo_id} is gated; accept its terms on "
            f"https://huggingface.co/{repo_id} and set HF_TOKEN (or run `hf auth login`)"
        ) from None
    except RevisionNotFoundError:
        raise ConfigError(f"model {given!r}: the Hub repository {repo_id} has no revision {revision!r}") from None
    except RepositoryNotFoundError:
        raise ConfigError(
            f"model {given!r}: no Hub repository {repo_id} (or it is private: set HF_TOKEN); {accepted()}"
        ) from None
    except LocalEntryNotFoundError:
        raise ConfigError(f"model {given!r}: {_not_cached(revision)}; {accepted()}") from None
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "?"
        raise ConfigError(f"model {given!r}: the Hub answered HTTP {status} for {repo_id}") from None
    except OSError as exc:  # disk full, unwritable cache, connection reset mid-download
        what = f"{type(exc).__name__}: {reason(exc)}"
        raise ConfigError(f"model {given!r}: downloading {repo_id} failed ({what})") from None
    return Path(folder)


def _not_cached(revision: str | None) -> str:
    at = f" at revision {revision!r}" if revision else ""
    where = f"the Hub cache {hub_constants.HF_HUB_CACHE}"
    if hub_constants.is_offline_mode():
        return f"not in {where}{at} and HF_HUB_OFFLINE is set (download it once online)"
    return f"not in {where}{at} and the Hub cannot be reached"


def _explain_missing_weights(given: str, repo_id: str, revision: str | None, path: Path) -> None:
    """After a snapshot without its safetensors: offline with a partial cache, or a repo without any."""
    if hub_constants.is_offline_mode():
        raise ConfigError(
            f"model {given!r}: the Hub cache has the config of {repo_id} but not its safetensors ({path}) and "
            "HF_HUB_OFFLINE is set (download them once online)"
        )
    _check_remote_weights(given, repo_id, revision, [])


def _check_remote_weights(given: str, repo_id: str, revision: str | None, shards: list[str]) -> None:
    """Ask the Hub which weight files the repository has (offline: refuse, the weights are not cached)."""
    if hub_constants.is_offline_mode():
        raise ConfigError(
            f"model {given!r}: the safetensors of {repo_id} are not in the Hub cache and HF_HUB_OFFLINE is set"
        )
    try:
        files = set(huggingface_hub.list_repo_files(repo_id, revision=revision))
    except (HfHubHTTPError, OSError) as exc:
        raise ConfigError(f"model {given!r}: cannot list the files of {repo_id} ({type(exc).__name__})") from None
    if shards and all(s in files for s in shards):
        return
    pickled = sorted(f for f in files if f.endswith(PICKLED_SUFFIXES))
    raise CheckpointError(f"model {given!r}: the Hub repository {repo_id} {_no_safetensors(pickled)}")
