"""The launcher's settings (`python -m deployments`): its flags over a Serve config file (`--config FILE`, the YAML
of `serve run FILE` and `serve deploy FILE`) over its defaults.

The file is validated with Ray Serve's own schema (`ray.serve.schema.ServeDeploySchema`), as `serve run` does; then
every field in it is either applied or refused: a setting that silently did not take effect (replica autoscaling,
an API key in a `runtime_env`) would be worse than an error. Applied:

* `http_options`: `host`, `port` (the launcher's `--host`, `--port`), `request_timeout_s`, `keep_alive_timeout_s`;
* `proxy_location`: `EveryNode` or `HeadOnly`;
* `logging_config`: Serve's controller and proxies (its `log_level` is `--serve-log-level`'s default);
* of the one application: `name` (`--name`), `args` (the `AppArgs` fields; a KEY=VALUE given to the launcher
  replaces the file's key of that name, flat or under its group), `import_path` when it is this package's application
  (`deployments:build_app`), `route_prefix` when it is `/`.

Refused, with one line naming the file and the field (exit status 2): every other field with a value (among them an
application's `deployments` overrides and `runtime_env`, `grpc_options`, `target_capacity`, `http_options.root_path`
and `ssl_*`), a key Serve's schema does not know, another `import_path`, more than one application. A file that
cannot be read, is not YAML or fails Serve's schema is refused the same way.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, field
from typing import Any

from deployments.preflight import AppConfigError

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_SERVE_LOG_LEVEL = "WARNING"
# the import paths of this package's application builder (Serve takes `module:attr` and `module.attr`)
BUILDER_PATHS = frozenset(
    {"deployments:build_app", "deployments.build_app", "deployments.application:build_app",
     "deployments.application.build_app"}
)  # fmt: skip
DEFAULT_APP_PATHS = frozenset({"deployments:app", "deployments.app"})  # build_app({}): takes no args
# what the launcher applies, by section; every other field with a value is refused
APPLIED_TOP = ("applications", "http_options", "proxy_location", "logging_config")
APPLIED_HTTP = ("host", "port", "request_timeout_s", "keep_alive_timeout_s")
APPLIED_APP = ("name", "import_path", "args", "route_prefix")
# what to do instead, for the fields a user is likeliest to have
HINTS = {
    "deployments": "set replicas and resources as args (num_replicas=..., num_gpus=..., ingress_replicas=...)",
    "runtime_env": "export its env_vars where the launcher starts: the Ray instance it starts inherits them",
}


@dataclass(frozen=True)
class ServeFile:
    """What the launcher takes from a Serve config file (None / empty: the file does not say)."""

    path: str
    name: str | None = None
    args: dict[str, Any] = field(default_factory=dict)
    host: str | None = None
    port: int | None = None
    http_options: dict[str, Any] = field(default_factory=dict)  # the other applied ones: the timeouts
    proxy_location: str | None = None
    logging_config: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LaunchSettings:
    """The launcher's settings once its flags, its --config file and its defaults are merged."""

    host: str
    port: int
    name: str
    values: dict[str, Any]  # build_app's arguments
    serve_log_level: str | int
    http_options: dict[str, Any]  # for serve.start, host and port included
    logging_config: dict[str, Any]  # for serve.start, log_level included
    proxy_location: str | None  # for serve.start; None: Serve's default (EveryNode)

    @property
    def quiet_serve(self) -> bool:
        """Serve's controller and proxies log below INFO (its INFO lines printed before the level is set go too)."""
        level = self.serve_log_level
        number = level if isinstance(level, int) else logging.getLevelNamesMapping().get(level, logging.INFO)
        return number >= logging.WARNING


def key_values(items: list[str]) -> dict[str, str]:
    """`["model=tiny", "num_replicas=2"]` -> a dict of strings (AppArgs coerces them, as for `serve run`)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise AppConfigError(f"application arguments are key=value, got {item!r}")
        out[key] = value
    return out


def resolve(ns: argparse.Namespace) -> LaunchSettings:
    """The flags given (None: not given), then the --config file's settings, then the defaults; KEY=VALUE pairs
    over the file's args. Raises AppConfigError (one line) for a bad pair or a file the launcher cannot run."""
    from deployments.config import DEFAULT_APP_NAME

    pairs = key_values(ns.args)
    file = read_serve_file(ns.config) if ns.config else ServeFile(path="")
    host = first(ns.host, file.host, DEFAULT_HOST)
    port = first(ns.port, file.port, DEFAULT_PORT)
    level = first(ns.serve_log_level, file.logging_config.get("log_level"), DEFAULT_SERVE_LOG_LEVEL)
    return LaunchSettings(
        host=host,
        port=port,
        name=first(ns.name, file.name, DEFAULT_APP_NAME),
        values=merge_args(file.args, pairs),
        serve_log_level=level,
        http_options={**file.http_options, "host": host, "port": port},
        logging_config={**file.logging_config, "log_level": level},
        proxy_location=file.proxy_location,
    )


def with_machine_defaults(values: dict[str, Any], cpus: int) -> dict[str, Any]:
    """`values` with what the launcher sizes to the machine when it starts its own Ray, unless given (flat or
    under its group): `ingress_replicas` (`machine_ingress_replicas`). One ingress replica's event loop carries
    a few hundred one-image requests per second; the GPU box's encoder replica takes well over a thousand."""
    ingress = values.get("ingress")
    if "ingress_replicas" in values or (isinstance(ingress, dict) and "ingress_replicas" in ingress):
        return values
    return values | {"ingress_replicas": machine_ingress_replicas(cpus)}


def machine_ingress_replicas(cpus: int) -> int:
    """Ingress replicas for a machine of `cpus` logical CPUs: 3 per 8 CPUs, at least 1, at most 8 (6 on a 16-CPU
    GPU box, where one-image HTTP requests measured 3x the img/s of one replica; beyond 8 the merging splits)."""
    return max(1, min(8, cpus * 3 // 8))


def merge_args(file_args: dict[str, Any], pairs: dict[str, str]) -> dict[str, Any]:
    """The file's args with each KEY=VALUE pair replacing its key, flat or under its group's name in the file
    (`batching: {max_batch_size: 8}` and `max_batch_size=4`: 4, not AppArgs' "given both flat and under")."""
    from deployments.config import GROUPS

    out = {}
    for key, value in file_args.items():
        if key in GROUPS and key not in pairs and isinstance(value, dict):
            value = {k: v for k, v in value.items() if k not in pairs}
        out[key] = value
    return out | pairs


def first(*values):
    return next(v for v in values if v is not None)


def read_serve_file(path: str) -> ServeFile:
    """The settings of Serve config file `path` that the launcher applies; AppConfigError (one line naming the file)
    for a file it cannot read or run as written."""
    raw = load_yaml(path)
    from pydantic import ValidationError
    from ray.serve.schema import HTTPOptionsSchema, ServeApplicationSchema, ServeDeploySchema

    try:
        config = ServeDeploySchema.model_validate(raw)
    except ValidationError as exc:
        raise AppConfigError(f"{path}: not a valid Serve config: {schema_errors(exc)}") from None
    refuse_unapplied(path, raw, "", ServeDeploySchema, APPLIED_TOP)
    http = raw.get("http_options") or {}
    refuse_unapplied(path, http, "http_options.", HTTPOptionsSchema, APPLIED_HTTP)
    if len(config.applications) != 1:
        raise AppConfigError(
            f"{path}: applications: {len(config.applications)} applications, python -m deployments runs exactly "
            "one (serve run / serve deploy run several)"
        )
    raw_app = raw["applications"][0]
    refuse_unapplied(path, raw_app, "applications[0].", ServeApplicationSchema, APPLIED_APP)
    app = config.applications[0]
    where = f"{path}: applications[0]"
    if app.import_path in DEFAULT_APP_PATHS:
        if app.args:
            raise AppConfigError(f"{where}.args: {app.import_path} takes none; use deployments:build_app")
    elif app.import_path not in BUILDER_PATHS:
        raise AppConfigError(
            f"{where}.import_path: {app.import_path!r} is not this service's application; python -m deployments "
            "runs deployments:build_app only (serve run / serve deploy run others)"
        )
    if "route_prefix" in raw_app and app.route_prefix != "/":
        raise AppConfigError(f"{where}.route_prefix: {app.route_prefix!r}; python -m deployments serves at /")
    location = config.proxy_location.value if "proxy_location" in raw else None
    if location == "Disabled":
        raise AppConfigError(f"{path}: proxy_location: Disabled; python -m deployments serves HTTP")
    options = config.http_options
    port = options.port if "port" in http else None
    if port is not None and not 1 <= port <= 65535:
        raise AppConfigError(f"{path}: http_options.port: {port} is not in 1-65535")
    return ServeFile(
        path=path,
        name=app.name if "name" in raw_app else None,
        args=dict(app.args or {}),
        host=options.host if "host" in http else None,
        port=port,
        http_options={k: getattr(options, k) for k in APPLIED_HTTP[2:] if k in http},
        proxy_location=location,
        logging_config=config.logging_config.model_dump(exclude_unset=True) if config.logging_config else {},
    )


def load_yaml(path: str) -> dict[str, Any]:
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
    except OSError as exc:
        raise AppConfigError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise AppConfigError(f"{path}: not a text file (not UTF-8)") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or " ".join(str(exc).split())
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise AppConfigError(f"{path}: not valid YAML: {problem}{at}") from None
    if not isinstance(raw, dict):
        got = "an empty file" if raw is None else f"a {type(raw).__name__}"
        raise AppConfigError(f"{path}: not a Serve config: expected a mapping with `applications:`, got {got}")
    return raw


def refuse_unapplied(path: str, raw: Any, prefix: str, schema: type, applied: tuple[str, ...]) -> None:
    """AppConfigError for the first key of mapping `raw` that Serve's `schema` lacks, or that has a value (not
    None, {} or []) and is not `applied`."""
    if not isinstance(raw, dict):
        return
    for key, value in raw.items():
        if key not in schema.model_fields:
            raise AppConfigError(f"{path}: {prefix}{key}: not a field of a Serve config")
        if key in applied or value is None or value == {} or value == []:
            continue
        hint = HINTS.get(key)
        instead = f"{hint}, or run this file with serve run / serve deploy" if hint else "use serve run / serve deploy"
        raise AppConfigError(f"{path}: {prefix}{key}: not applied by python -m deployments; {instead}")


def schema_errors(exc) -> str:
    """A pydantic ValidationError of Serve's schema in one line: `applications[0].import_path: message; ...`."""
    parts = []
    for err in exc.errors():
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err.get("loc", ())).lstrip(".")
        message = " ".join(str(err.get("msg", "")).removeprefix("Value error, ").split())
        parts.append(f"{where}: {message}" if where else message)
    return "; ".join(parts)
