"""A Hugging Face Hub cache written by hand, for testing Hub ids without a network.

`populate(cache, repo_id, source)` lays `source`'s files out as huggingface_hub does:
`models--org--name/snapshots/<commit>/<file>` plus `refs/<branch>` holding the commit.
`use_cache(monkeypatch, hf_home, offline)` points this process at it: the environment variables
for subprocesses, and huggingface_hub's constants, which it reads from them once at import.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from huggingface_hub import constants

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def repo_folder(cache: Path, repo_id: str) -> Path:
    return cache / ("models--" + repo_id.replace("/", "--"))


def populate(cache: Path, repo_id: str, source: Path, commit: str = COMMIT, refs: tuple[str, ...] = ("main",)) -> Path:
    """Copy `source`'s files into the cache as the snapshot `commit`; returns the snapshot directory."""
    snapshot = repo_folder(cache, repo_id) / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        shutil.copy(f, snapshot / f.name)
    for ref in refs:
        ref_file = repo_folder(cache, repo_id) / "refs" / ref
        ref_file.parent.mkdir(parents=True, exist_ok=True)
        ref_file.write_text(commit)
    return snapshot


def use_cache(monkeypatch, hf_home: Path, offline: bool = True) -> Path:
    """HF_HOME=hf_home (cache hf_home/hub), HF_HUB_OFFLINE as given, no token; returns the cache dir."""
    cache = hf_home / "hub"
    cache.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1" if offline else "0")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_HOME", str(hf_home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(hf_home / "token"))
    return cache
