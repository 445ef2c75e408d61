"""`python -m deployments --config FILE`: a Serve config file mapped onto the launcher's settings, the flags and
KEY=VALUE pairs over it, and each refusal as one line naming the file and the field (`deployments/launch_config.py`);
no Ray is started. The launcher started from `deployments/serve_config.yaml`: tests/integration/serve/
test_launcher_config.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from deployments.__main__ import parse_args
from deployments.launch_config import LaunchSettings, read_serve_file, resolve, with_machine_defaults
from deployments.preflight import USAGE_EXIT, AppConfigError

ROOT = Path(__file__).resolve().parents[3]
SMALL = ROOT / "deployments" / "serve_config.yaml"
PRODUCTION = ROOT / "deployments" / "serve_production.yaml"
APP = {"name": "default", "import_path": "deployments:build_app", "args": {"model": "tiny"}}


def settings(*argv: str) -> LaunchSettings:
    return resolve(parse_args(list(argv)))


def write(tmp_path: Path, config: dict | str) -> str:
    path = tmp_path / "serve.yaml"
    path.write_text(config if isinstance(config, str) else yaml.safe_dump(config))
    return str(path)


def refusal(path: str) -> str:
    with pytest.raises(AppConfigError) as info:
        read_serve_file(path)
    text = str(info.value)
    assert "\n" not in text and text.startswith(f"{path}: "), text  # one line, the file first
    return text


def test_the_small_config_maps_onto_the_launchers_settings():
    s = settings("--config", str(SMALL))
    file = yaml.safe_load(SMALL.read_text())
    (app,) = file["applications"]
    assert (s.host, s.port, s.name) == (file["http_options"]["host"], file["http_options"]["port"], app["name"])
    assert s.values == app["args"] and s.values["num_replicas"] == 2  # the file's args, not strings
    assert s.http_options == {"host": "127.0.0.1", "port": 8000}
    assert s.proxy_location == "EveryNode"
    # no logging_config in the file: Serve's controller and proxies at WARNING, as without --config
    assert s.serve_log_level == "WARNING" and s.logging_config == {"log_level": "WARNING"} and s.quiet_serve


def test_flags_and_key_values_override_the_file():
    s = settings(
        "--config", str(SMALL), "--host", "0.0.0.0", "--port", "9001", "--name", "other", "model=tiny-clip",
        "num_replicas=1",
    )  # fmt: skip
    assert (s.host, s.port, s.name) == ("0.0.0.0", 9001, "other")
    assert s.http_options == {"host": "0.0.0.0", "port": 9001}
    assert s.values["model"] == "tiny-clip" and s.values["num_replicas"] == "1"  # AppArgs coerces, as for serve run
    assert s.values["num_cpus"] == 0.25 and s.values["ingress_batch_size"] == 32  # the rest stays the file's
    # the order on the command line does not matter: the pairs may come first
    assert settings("model=tiny-clip", "--config", str(SMALL)).values["model"] == "tiny-clip"


def test_a_pair_replaces_the_files_key_under_its_group_too(tmp_path):
    from deployments.config import AppArgs

    app = APP | {"args": {"model": "tiny", "batching": {"max_batch_size": 8, "batcher": "serve"}}}
    s = settings("--config", write(tmp_path, {"applications": [app]}), "max_batch_size=4")
    assert s.values == {"model": "tiny", "batching": {"batcher": "serve"}, "max_batch_size": "4"}
    args = AppArgs.model_validate(s.values)
    assert (args.max_batch_size, args.batcher) == (4, "serve")


def test_without_a_file_or_what_it_leaves_out_the_defaults_apply(tmp_path):
    default = settings()
    assert (default.host, default.port, default.name, default.values) == ("127.0.0.1", 8000, "default", {})
    assert default.proxy_location is None and default.serve_log_level == "WARNING"
    # a file without http_options or a name: the launcher's defaults (Serve's schema would bind 0.0.0.0)
    s = settings("--config", write(tmp_path, {"applications": [{"import_path": "deployments:build_app"}]}))
    assert (s.host, s.port, s.name, s.values, s.proxy_location) == ("127.0.0.1", 8000, "default", {}, None)


def test_the_files_logging_config_and_http_timeouts_are_applied_and_the_flag_wins(tmp_path):
    path = write(tmp_path, {
        "http_options": {"port": 8123, "request_timeout_s": 90, "keep_alive_timeout_s": 75},
        "logging_config": {"encoding": "TEXT", "log_level": "INFO"},
        "proxy_location": "HeadOnly",
        "applications": [APP],
    })  # fmt: skip
    s = settings("--config", path)
    assert s.http_options == {"host": "127.0.0.1", "port": 8123, "request_timeout_s": 90, "keep_alive_timeout_s": 75}
    assert s.logging_config == {"encoding": "TEXT", "log_level": "INFO"} and not s.quiet_serve
    assert s.proxy_location == "HeadOnly"
    quiet = settings("--config", path, "--serve-log-level", "ERROR")
    assert quiet.logging_config == {"encoding": "TEXT", "log_level": "ERROR"} and quiet.quiet_serve


def with_app(**fields) -> dict:
    return {"applications": [APP | fields]}


@pytest.mark.parametrize(
    "config, expected",
    [
        # what the launcher cannot apply, with what to do instead
        (with_app(deployments=[{"name": "VisionEncoder", "num_replicas": 3}]),
         "applications[0].deployments: not applied by python -m deployments; set replicas and resources as args"),
        (with_app(runtime_env={"env_vars": {"VISION_API_KEY": "k"}}),
         "applications[0].runtime_env: not applied by python -m deployments; export its env_vars"),
        (with_app(logging_config={"log_level": "DEBUG"}), "applications[0].logging_config: not applied"),
        ({"grpc_options": {"port": 9000}, **with_app()}, "grpc_options: not applied by python -m deployments"),
        ({"target_capacity": 0, **with_app()}, "target_capacity: not applied"),  # a 0 is a value, not absent
        ({"http_options": {"root_path": "/v"}, **with_app()}, "http_options.root_path: not applied"),
        ({"http_options": {"ssl_keyfile": "k.pem", "ssl_certfile": "c.pem"}, **with_app()},
         "http_options.ssl_certfile: not applied"),  # the first in the file
        ({"proxy_location": "Disabled", **with_app()}, "proxy_location: Disabled; python -m deployments serves HTTP"),
        (with_app(import_path="other.module:app"),
         "applications[0].import_path: 'other.module:app' is not this service's application"),
        (with_app(import_path="deployments:app"), "applications[0].args: deployments:app takes none"),
        (with_app(route_prefix="/embed"), "applications[0].route_prefix: '/embed'; python -m deployments serves at /"),
        ({"applications": [APP, APP | {"name": "second", "route_prefix": "/b"}]},
         "applications: 2 applications, python -m deployments runs exactly one"),
        ({"applications": []}, "applications: 0 applications"),
        ({"http_options": {"port": 70000}, **with_app()}, "http_options.port: 70000 is not in 1-65535"),
        # keys Serve's schema does not know (Serve would drop them without a word: a typo is refused here)
        ({"http_option": {"port": 9000}, **with_app()}, "http_option: not a field of a Serve config"),
        (with_app(arg={"model": "tiny"}), "applications[0].arg: not a field of a Serve config"),
        # what Serve's schema refuses, in one line
        ({"http_options": {"port": "eighty"}, **with_app()},
         "not a valid Serve config: http_options.port: Input should be a valid integer"),
        (with_app(import_path="nocolon"), "not a valid Serve config: applications[0].import_path: Got invalid"),
        ({"proxy_location": "Nowhere", **with_app()}, "not a valid Serve config: proxy_location: "),
        ({"http_options": {"port": 9000}}, "not a valid Serve config: applications: Field required"),
    ],
)  # fmt: skip
def test_what_the_launcher_cannot_run_is_refused_in_one_line(tmp_path, config, expected):
    text = refusal(write(tmp_path, config))
    assert expected in text, text


def test_empty_fields_are_not_refused(tmp_path):
    s = settings("--config", write(tmp_path, with_app(runtime_env={}, deployments=[], logging_config=None)))
    assert s.values == {"model": "tiny"}


@pytest.mark.parametrize(
    "content, expected",
    [
        (None, "cannot read it: No such file or directory"),
        ("", "not a Serve config: expected a mapping with `applications:`, got an empty file"),
        ("- a\n- b\n", "got a list"),
        ("applications: [\n  {name: x\n", "not valid YAML: "),
        ("applications:\n\t- name: x\n", "not valid YAML: found character '\\t' that cannot start any token at line 2"),
        (b"\xff\xfe\x00binary", "not a text file"),
    ],
)
def test_a_file_that_cannot_be_read_is_one_line_naming_it(tmp_path, content, expected):
    path = tmp_path / "serve.yaml"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    text = refusal(str(path))
    assert expected in text, text


def test_a_directory_is_refused_in_one_line(tmp_path):
    assert "cannot read it: Is a directory" in refusal(str(tmp_path))


def test_the_production_config_is_for_serve_deploy_on_a_cluster():
    """serve_production.yaml autoscales its deployments (`deployments:` overrides): refused, not run without them."""
    text = refusal(str(PRODUCTION))
    assert "applications[0].deployments: not applied by python -m deployments" in text, text
    assert "serve run / serve deploy" in text


def test_the_launcher_prints_one_error_line_and_exits_2(tmp_path, capsys, monkeypatch):
    """The whole CLI on a bad file: `error: FILE: ...` on stderr, exit status 2, no traceback, no Ray started."""
    import ray

    from deployments import __main__ as launcher

    monkeypatch.setattr(launcher, "ray_address", lambda given: "local")
    monkeypatch.setattr(ray, "init", lambda **kw: pytest.fail("Ray was started"))
    missing = str(tmp_path / "nope.yaml")
    # --request-path default: the fast path's flags stay out of this process's environment
    assert launcher.main(["--config", missing, "--request-path", "default"]) == USAGE_EXIT
    err = capsys.readouterr().err
    assert err == f"error: {missing}: cannot read it: No such file or directory\n", err


def test_help_says_the_flags_override_the_file(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--config FILE" in out and "the flags and KEY=VALUE pairs given here override the file" in out, out


@pytest.mark.parametrize(("cpus", "replicas"), [(1, 1), (2, 1), (4, 1), (8, 3), (16, 6), (24, 8), (128, 8)])
def test_launcher_sizes_ingress_replicas_to_the_machine(cpus, replicas):
    from deployments.config import AppArgs

    values = with_machine_defaults({"model": "tiny"}, cpus)
    assert values == {"model": "tiny", "ingress_replicas": replicas}
    assert AppArgs.model_validate(values).ingress_replicas == replicas


@pytest.mark.parametrize("given", [{"ingress_replicas": "2"}, {"ingress": {"ingress_replicas": 2}}])
def test_ingress_replicas_given_flat_or_in_its_group_are_kept(given):
    from deployments.config import AppArgs

    values = with_machine_defaults({"model": "tiny", **given}, 16)
    assert values == {"model": "tiny", **given}
    assert AppArgs.model_validate(values).ingress_replicas == 2
