"""What is checked on the driver before any replica starts: the arguments, the model, the HTTP port.

A bad `model=` used to be found only inside the encoder replicas, which Serve restarts: three tracebacks and
42 s later `serve run` exited 0. Here it fails in seconds, once, with one line, and a non-zero exit.

`AppConfigError` is also a `click.ClickException` so that the Serve CLI (`serve run`, `serve build`, which are
click commands calling `build_app`) prints it as one `Error: ...` line and exits with its `exit_code` instead
of a traceback; for Python callers it is an ordinary `encoder.errors.ConfigError`.
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

import click

from encoder.config import BUILTIN_ATTENTION, DTYPE_NAMES, VisionConfig, attention_kinds
from encoder.errors import CheckpointError, ConfigError, named
from encoder.loading.checkpoint import load_config
from encoder.loading.hub import ResolvedModel, resolve_model

# the batch CLI's status for bad arguments, so both CLIs agree (README "Exit status")
USAGE_EXIT = 2


class AppConfigError(ConfigError, click.ClickException):
    """Bad application arguments, a model that cannot be loaded, or a taken port: one line."""

    exit_code = USAGE_EXIT

    def __init__(self, message: str):
        click.ClickException.__init__(self, message)

    def __str__(self) -> str:
        return self.message


def check_model(model: str, *, weights_elsewhere: bool = False) -> ResolvedModel:
    """`encoder.loading.hub.resolve_model` without downloading weights (the replicas fetch them), as an AppConfigError.

    `weights_elsewhere`: the replicas may run on other nodes than this process (`serve deploy`: the
    controller builds the app on a head node, which in cluster.yaml holds only the checkpoint's config
    files), so a directory with a valid config.json but without safetensors is accepted here.
    """
    try:
        return resolve_model(model, download_weights=False)
    except CheckpointError as exc:
        path = Path(model).expanduser()
        if not (weights_elsewhere and path.is_dir() and (path / "config.json").is_file()):
            raise AppConfigError(str(exc)) from None
        try:  # the config must still be right: a bad config.json is refused here too
            config = load_config(path)
        except (ConfigError, CheckpointError) as bad_config:
            raise AppConfigError(str(bad_config)) from None
        return ResolvedModel(model, "dir", model, config, path=path, weights_on_disk=False)
    except ConfigError as exc:
        raise AppConfigError(str(exc)) from None


def check_encoder_options(config: VisionConfig, buckets=None, dtype=None, attention=None, max_images=None) -> None:
    """What a driver can check of the encoder's options without torch, before replicas or actors start: the
    dtype's and the attention backends' names and the bucket spec (parsed on the model's merge unit, as the
    engine parses it). Whether the replicas' device can run a backend is theirs to say. Raises AppConfigError."""
    import sys

    from workspace.buckets import BucketError, BucketTable

    if dtype is not None and dtype not in DTYPE_NAMES:
        raise AppConfigError(f"dtype {dtype!r}: expected one of {', '.join(DTYPE_NAMES)}")
    registry = sys.modules.get("encoder.attention.registry")  # loaded: backends registered here count too
    names = ["auto", *(registry.backend_names() if registry else BUILTIN_ATTENTION)]
    given = attention.values() if isinstance(attention, dict) else [attention]
    for name in given:  # None or "" is "auto", as in `encoder.load`
        if name not in (None, "") and name not in names:
            raise AppConfigError(f"attention {named(name)}: expected one of {', '.join(names)}")
    if isinstance(attention, dict):
        kinds = attention_kinds(config)
        unknown = [named(kind) for kind in attention if kind not in kinds]
        if unknown:
            raise AppConfigError(f"attention names layer kinds {', '.join(unknown)}: this model has {', '.join(kinds)}")
    if isinstance(buckets, str):
        try:
            BucketTable.parse(buckets, granule=config.merge_unit, max_images=max_images)
        except BucketError as exc:
            raise AppConfigError(f"buckets {buckets!r}: {exc}") from None


def check_port_free(host: str, port: int) -> None:
    """Refuse a port something already listens on. Ray Serve's proxy binds with SO_REUSEPORT, so a second
    service started on a taken port shares it silently and the kernel splits the connections between the two;
    a plain bind (no SO_REUSEPORT) fails on any listener, ours or not. With SO_REUSEADDR, as the proxy also
    binds, only a listener counts: the TIME_WAIT / FIN_WAIT connections a service just stopped leaves on its
    port (~65 s after a stop with a client connected) do not."""
    bind_host = "0.0.0.0" if host in ("", "0.0.0.0", "::") else host
    with socket.socket(socket.AF_INET6 if ":" in bind_host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((bind_host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise AppConfigError(
                    f"port {port} on {host} is already in use (another service, maybe another `serve run`); "
                    "choose a free one with --port"
                ) from None
            raise AppConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def ray_address(explicit: str | None) -> str:
    """Where our CLIs connect: the address given, else RAY_ADDRESS (`ray job submit` sets it for its drivers),
    else "local", a Ray instance of our own. Not `ray.init()`'s default: with no address it joins the cluster
    that `ray start` last started on this machine, which may be another user's."""
    return explicit or os.environ.get("RAY_ADDRESS") or "local"
