"""`model=` resolution: presets, directories and Hugging Face Hub ids, offline, and every way they fail.

Hub ids are resolved from a cache this file writes in the Hub's layout (`hub_cache.populate`), with
HF_HUB_OFFLINE=1; Hub errors come from a local HTTP server answering as the Hub does (its
`X-Error-Code` header), so huggingface_hub's own classification is what gets mapped.
"""

from __future__ import annotations

import fnmatch
import http.server
import shutil
import threading
import time
import warnings
from pathlib import Path

import huggingface_hub
import numpy as np
import pytest
import torch
from huggingface_hub import constants

import encoder
from encoder import CheckpointError, ConfigError, RandomWeightsWarning
from encoder.loading.checkpoint import read_weight_map, vision_shards
from tests.hf_models import write_checkpoint
from tests.hub_cache import COMMIT, populate, use_cache

REPO = "tiny-org/tiny-vl"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ckpt")
    write_checkpoint(directory, "qwen2_5_vl", "full")
    return directory


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A full VLM in 60 KB shards: the LLM's tensors fill shards the tower does not need."""
    directory = tmp_path_factory.mktemp("sharded")
    write_checkpoint(directory, "qwen2_5_vl", "full-sharded")
    return directory


@pytest.fixture
def offline_cache(monkeypatch, tmp_path):
    return use_cache(monkeypatch, tmp_path / "hf_home", offline=True)


def image(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (56, 84, 3), dtype=np.uint8)


def one_line_error(exc_info) -> str:
    message = str(exc_info.value)
    assert "\n" not in message, message
    assert "object at 0x" not in message, message
    return message


# ------------------------------------------------------------------------------------------ Hub ids


def test_hub_id_resolves_from_the_offline_cache(offline_cache, checkpoint):
    snapshot = populate(offline_cache, REPO, checkpoint)
    resolved = encoder.resolve_model(REPO)
    assert (resolved.kind, resolved.name, resolved.path, resolved.commit) == ("hub", REPO, snapshot, COMMIT)
    assert resolved.random_weights is False
    assert resolved.info() == {"name": REPO, "kind": "hub", "random_weights": False, "path": str(snapshot),
                               "revision": None, "commit": COMMIT}  # fmt: skip
    from_hub = encoder.load(REPO, device="cpu")
    from_dir = encoder.load(str(checkpoint), device="cpu")
    assert from_hub.name == REPO and from_hub.model_info()["kind"] == "hub"
    torch.testing.assert_close(from_hub.encode([image()], pooling="mean")[0], from_dir.encode([image()], "mean")[0])


def test_hub_revision_branch_and_commit(offline_cache, checkpoint):
    # a revision may hold '/': a branch feature/x, a pull request's refs/pr/12 (the cache keeps refs/refs/pr/12)
    snapshot = populate(offline_cache, REPO, checkpoint, refs=("main", "v1", "feature/x", "refs/pr/12"))
    for revision in ("main", "v1", COMMIT, "feature/x", "refs/pr/12"):
        resolved = encoder.resolve_model(f"{REPO}@{revision}")
        assert (resolved.name, resolved.path, resolved.revision) == (REPO, snapshot, revision)
    with pytest.raises(ConfigError) as info:
        encoder.resolve_model(f"{REPO}@v9")
    message = one_line_error(info)
    assert f"'{REPO}@v9'" in message and "revision 'v9'" in message and "HF_HUB_OFFLINE" in message


def test_unknown_hub_id_offline_fails_fast_in_one_line(offline_cache):
    start = time.monotonic()
    with pytest.raises(ConfigError) as info:
        encoder.load("Qwen/Qwen2.5-VL-7B-Instruct", device="cpu")
    assert time.monotonic() - start < 5  # broken: a download attempt or a tower built first
    message = one_line_error(info)
    assert "'Qwen/Qwen2.5-VL-7B-Instruct'" in message and "HF_HUB_OFFLINE" in message
    assert str(offline_cache) in message  # where it looked
    assert "qwen2.5-vl-7b" in message and "org/name" in message  # what would have been accepted


def test_cached_config_without_safetensors_offline(offline_cache, checkpoint, tmp_path):
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    shutil.copy(checkpoint / "config.json", config_only)
    populate(offline_cache, REPO, config_only)
    for download in (True, False):
        with pytest.raises(ConfigError) as info:
            encoder.resolve_model(REPO, download_weights=download)
        message = one_line_error(info)
        assert REPO in message and "safetensors" in message and "HF_HUB_OFFLINE" in message


def test_validation_without_weights_accepts_a_full_cache(offline_cache, checkpoint):
    populate(offline_cache, REPO, checkpoint)
    resolved = encoder.resolve_model(REPO, download_weights=False)
    assert resolved.kind == "hub" and (resolved.path / "config.json").exists()
    assert resolved.config.family == "qwen2_5_vl"


# ------------------------------------------------------------------------- presets and directories


@pytest.mark.parametrize("given", ["/nonexistent/dir", "./missing-checkpoint", "a/b/c", "~/no-such-model-dir"])
def test_missing_path(given):
    start = time.monotonic()
    with pytest.raises(ConfigError) as info:
        encoder.load(given, device="cpu")
    assert time.monotonic() - start < 5
    message = one_line_error(info)
    assert f"'{given}'" in message and "no such directory" in message
    assert "tiny" in message and "config.json" in message and "org/name" in message


def test_a_missing_path_object_is_a_missing_directory_not_a_hub_id(fake_download):
    """`load(model: str | Path)`: a `Path` names a directory. A missing `Path("org/name")` was sent to the Hub
    as the repository org/name (here the fake Hub's KeyError; online, a download attempt)."""
    _, calls = fake_download
    with pytest.raises(ConfigError) as info:
        encoder.resolve_model(Path("checkpoints/qwen"))
    assert "'checkpoints/qwen': no such directory" in one_line_error(info)
    assert calls == []


def test_unknown_name_and_empty_model():
    with pytest.raises(ConfigError, match=r"unknown preset 'nope'.*tiny.*org/name"):
        encoder.resolve_model("nope")
    with pytest.raises(ConfigError, match="model is empty"):
        encoder.resolve_model("")


@pytest.mark.parametrize("given", ["nope", "/nonexistent/dir", "org/name/extra"])
def test_errors_point_to_the_presets_instead_of_listing_them_all(given):
    """Broken: every resolution error appended all 21 preset names. Now a few, and where the rest are."""
    with pytest.raises(ConfigError) as info:
        encoder.resolve_model(given)
    message = one_line_error(info)
    assert f"expected a preset (tiny, qwen2.5-vl-7b, qwen3-vl-8b, clip-vit-l-14, ...: {len(encoder.PRESETS)} in " \
        "`encoder.PRESETS`)" in message, message  # fmt: skip
    assert sum(name in message.split("(", 1)[1] for name in encoder.PRESETS if name != "tiny") <= 4, message
    assert len(message) < 400, message


def test_a_file_is_not_a_checkpoint(checkpoint):
    with pytest.raises(ConfigError, match="is a file, not a checkpoint directory"):
        encoder.resolve_model(str(checkpoint / "config.json"))


def test_directory_without_safetensors(checkpoint, tmp_path):
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(checkpoint / "config.json", pickled)
    (pickled / "pytorch_model.bin").write_bytes(b"never unpickled")
    with pytest.raises(CheckpointError) as info:
        encoder.resolve_model(str(pickled))
    assert "only pickled weights (pytorch_model.bin)" in one_line_error(info)
    (pickled / "pytorch_model.bin").unlink()
    with pytest.raises(CheckpointError, match="has no model.safetensors or model.safetensors.index.json"):
        encoder.resolve_model(str(pickled))


def test_directory_resolves_without_reading_weights(checkpoint):
    resolved = encoder.resolve_model(str(checkpoint))
    assert (resolved.kind, resolved.path, resolved.random_weights) == ("dir", checkpoint, False)
    assert resolved.config.family == "qwen2_5_vl"


def test_only_the_vision_shards_are_needed(sharded, tmp_path):
    shards = sorted(set(read_weight_map(sharded / "model.safetensors.index.json").values()))
    needed = vision_shards(read_weight_map(sharded / "model.safetensors.index.json"))
    assert 0 < len(needed) < len(shards)  # the tiny LLM fills shards of its own
    tower_only = tmp_path / "tower_only"
    tower_only.mkdir()
    for f in sharded.iterdir():
        if f.suffix != ".safetensors" or f.name in needed:
            shutil.copy(f, tower_only / f.name)
    full = encoder.load(str(sharded), device="cpu").encode([image(1)], pooling="mean")[0]
    torch.testing.assert_close(encoder.load(str(tower_only), device="cpu").encode([image(1)], pooling="mean")[0], full)


# --------------------------------------------------------------------------------- random weights


def test_preset_warns_once_that_its_weights_are_random():
    with pytest.warns(RandomWeightsWarning) as record:
        enc = encoder.load("tiny-clip", device="cpu")
    messages = [str(w.message) for w in record if issubclass(w.category, RandomWeightsWarning)]
    assert len(messages) == 1
    assert "'tiny-clip'" in messages[0] and "RANDOM" in messages[0]
    assert "Qwen/Qwen2.5-VL-7B-Instruct" in messages[0] and "checkpoint directory" in messages[0]
    assert enc.random_weights is True
    assert enc.model_info() == {"name": "tiny-clip", "kind": "preset", "random_weights": True}


def test_checkpoint_does_not_warn(checkpoint):
    with warnings.catch_warnings():
        warnings.simplefilter("error", RandomWeightsWarning)
        enc = encoder.load(str(checkpoint), device="cpu")
    assert enc.random_weights is False and enc.model_info()["kind"] == "dir"


def test_presets_resolve_without_building_a_tower():
    resolved = encoder.resolve_model("qwen2.5-vl-7b")  # a 670M-parameter tower, not built here
    assert (resolved.kind, resolved.path, resolved.random_weights) == ("preset", None, True)
    assert resolved.config.out_dim == 3584


# ------------------------------------------------------------------ a Hub that answers with errors


class FakeHub(http.server.BaseHTTPRequestHandler):
    """Answers every request with the error the test chose, as the Hub's API does; records tokens."""

    status, error_code, seen_auth = 404, "RepoNotFound", []

    def do_GET(self):  # noqa: N802 - the http.server API
        FakeHub.seen_auth.append(self.headers.get("Authorization"))
        self.send_response(FakeHub.status)
        self.send_header("X-Error-Code", FakeHub.error_code)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    do_HEAD = do_GET

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_hub(monkeypatch, tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    use_cache(monkeypatch, tmp_path / "hf_home", offline=False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    FakeHub.seen_auth = []
    yield FakeHub
    server.shutdown()


@pytest.mark.parametrize(
    "status, code, given, expected",
    [
        (404, "RepoNotFound", "org/absent", "no Hub repository org/absent (or it is private: set HF_TOKEN)"),
        (403, "GatedRepo", "org/gated", "org/gated is gated; accept its terms on https://huggingface.co/org/gated"),
        (404, "RevisionNotFound", "org/model@nope", "org/model has no revision 'nope'"),
    ],
)
def test_hub_errors_become_one_sentence(fake_hub, status, code, given, expected):
    fake_hub.status, fake_hub.error_code = status, code
    with pytest.raises(ConfigError) as info:
        encoder.resolve_model(given)
    message = one_line_error(info)
    assert message.startswith(f"model '{given}': ") and expected in message
    assert "Request ID" not in message and "Client Error" not in message


def test_hf_token_is_sent(fake_hub, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_testtoken")
    with pytest.raises(ConfigError):
        encoder.resolve_model("org/private")
    assert "Bearer hf_testtoken" in fake_hub.seen_auth


# ------------------------------------------- downloads: which files are asked for (the Hub replaced)


@pytest.fixture
def fake_download(monkeypatch, tmp_path):
    """`snapshot_download` copying, from a directory standing for the remote repo, the files that
    match `allow_patterns` into the cache, as the real one does; records the patterns asked for."""
    cache = use_cache(monkeypatch, tmp_path / "hf_home", offline=False)
    calls: list[list[str]] = []
    remotes = {}

    def snapshot_download(repo_id, *, revision=None, allow_patterns=None, **kwargs):
        calls.append(list(allow_patterns))
        snapshot = cache / f"models--{repo_id.replace('/', '--')}" / "snapshots" / COMMIT
        snapshot.mkdir(parents=True, exist_ok=True)
        for f in remotes[repo_id].iterdir():
            if any(fnmatch.fnmatch(f.name, p) for p in allow_patterns):
                shutil.copy(f, snapshot / f.name)
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(huggingface_hub, "list_repo_files", lambda repo_id, **kw: sorted(
        f.name for f in remotes[repo_id].iterdir()))  # fmt: skip
    return remotes, calls


def test_download_fetches_config_then_only_the_vision_shards(fake_download, sharded):
    remotes, calls = fake_download
    remotes["org/sharded"] = sharded
    resolved = encoder.resolve_model("org/sharded")
    needed = vision_shards(read_weight_map(sharded / "model.safetensors.index.json"))
    # the image processor's settings where transformers 5 and 4 save them (checkpoint.read_image_processor)
    assert calls[0] == ["config.json", "processor_config.json", "preprocessor_config.json",
                        "model.safetensors.index.json"]  # fmt: skip
    assert sorted(calls[1][len(calls[0]) :]) == sorted(needed)
    assert sorted(p.name for p in resolved.path.glob("*.safetensors")) == sorted(needed)
    encoder.load(resolved, device="cpu").encode([image()], pooling="mean")


def test_validation_only_downloads_no_weights(fake_download, sharded):
    remotes, calls = fake_download
    remotes["org/sharded"] = sharded
    resolved = encoder.resolve_model("org/sharded", download_weights=False)
    assert len(calls) == 1 and not list(resolved.path.glob("*.safetensors"))
    assert resolved.weights_on_disk is False
    enc = encoder.load(resolved, device="cpu")  # what a replica does with the driver's answer: download, load
    assert len(calls) == 3 and enc.source.weights_on_disk and enc.name == "org/sharded"


def test_hub_repo_with_pickles_only(fake_download, checkpoint, tmp_path):
    remotes, _ = fake_download
    remotes["org/pickled"] = tmp_path / "remote"
    remotes["org/pickled"].mkdir()
    shutil.copy(checkpoint / "config.json", remotes["org/pickled"])
    (remotes["org/pickled"] / "pytorch_model.bin").write_bytes(b"never unpickled")
    for download in (True, False):
        with pytest.raises(CheckpointError) as info:
            encoder.resolve_model("org/pickled", download_weights=download)
        message = one_line_error(info)
        assert "org/pickled" in message and "only pickled weights (pytorch_model.bin)" in message
