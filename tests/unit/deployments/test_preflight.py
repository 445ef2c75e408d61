"""What `build_app` and the launcher check before any replica starts (`deployments.preflight`), the one-sentence
`input` schema error, the access-log option and the random-weights mark; no Ray cluster."""

from __future__ import annotations

import socket
import subprocess
import sys

import click
import pytest

from deployments import build_app
from deployments.config import AppArgs
from deployments.ingress.openai_api import parse_embedding_request
from deployments.launch_config import key_values
from deployments.preflight import USAGE_EXIT, AppConfigError, check_model, check_port_free
from encoder.errors import ConfigError
from tests.hf_models import write_checkpoint
from tests.hub_cache import populate, use_cache
from tests.serve_fixtures import free_port


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ckpt")
    write_checkpoint(directory, "qwen2_5_vl", "full")
    return directory


def one_line(exc_info) -> str:
    text = str(exc_info.value)
    assert "\n" not in text and "object at 0x" not in text, text
    return text


@pytest.mark.parametrize(
    "model, expected",
    [
        ("/nonexistent/dir", "'/nonexistent/dir': no such directory"),
        ("no-such-preset", "unknown preset 'no-such-preset'"),
        ("", "model is empty"),
    ],
)
def test_build_app_refuses_a_bad_model_in_one_line(model, expected):
    with pytest.raises(AppConfigError) as info:
        build_app({"model": model})
    text = one_line(info)
    assert expected in text and "expected a preset (tiny" in text  # what was given, what is accepted
    # the Serve CLI (click) prints it as one `Error:` line and exits 2, the batch CLI's usage status
    assert isinstance(info.value, click.ClickException) and isinstance(info.value, ConfigError)
    assert info.value.exit_code == USAGE_EXIT == 2


def test_build_app_refuses_bad_arguments_in_one_line():
    with pytest.raises(AppConfigError) as info:
        build_app({"num_replicas": "two", "nmu_gpus": 1})
    text = one_line(info)
    assert "num_replicas" in text and "nmu_gpus" in text


@pytest.mark.parametrize(
    "args, expected",
    [
        ({"dtype": "bf"}, "dtype 'bf': expected one of float32"),
        ({"attention": "bogus"}, "attention 'bogus': expected one of auto, sdpa"),
        ({"attention": {"windows": "sdpa"}}, "attention names layer kinds 'windows': this model has full, window"),
        ({"buckets": "7"}, "buckets '7': "),  # not a multiple of the model's merge unit (4)
        ({"request_router_class": "no.such:Router"}, "request_router_class 'no.such:Router': "),
        (
            {"request_router_class": "deployments.routing.router:NoSuch"},
            "request_router_class 'deployments.routing.router:NoSuch'",
        ),
        # the router's own options (broken: RUNNING, then every request 504 after its 60 s time limit)
        ({"request_router_kwargs": {"spill_fration": 0.5}}, "request_router_kwargs: spill_fration: Extra inputs"),
        ({"request_router_kwargs": {"spill_fraction": 2}}, "request_router_kwargs: spill_fraction: Input should be"),
        ({"request_router_kwargs": {"buckets": "pow2:256-1000"}}, "request_router_kwargs: "),
    ],
)
def test_build_app_refuses_what_would_fail_in_every_replica_in_one_line(args, expected):
    """Broken: these passed `build_app`, then every replica failed at load and retried, with tracebacks from
    Serve's controller, and the launcher exited 1 after ~20 s (or a raw ModuleNotFoundError for the router)."""
    with pytest.raises(AppConfigError) as info:
        build_app({"model": "tiny", **args})
    assert expected in one_line(info), one_line(info)


def test_the_attention_check_names_what_it_refuses_by_type_and_agrees_with_the_encoder_on_empty():
    """A value or kind that is not a string is named by its type (it showed the object's repr), and "" for a kind
    is "auto" here as it is in `encoder.load` (the driver refused what every replica would have run)."""
    from deployments.preflight import check_encoder_options
    from encoder.loading.presets import PRESETS

    config = PRESETS["tiny"]
    check_encoder_options(config, attention={"full": "", "window": None})
    for attention, expected in (
        ({"full": object()}, "attention of type object: expected one of auto"),
        ({object(): "sdpa"}, "attention names layer kinds of type object: this model has full, window"),
    ):
        with pytest.raises(AppConfigError) as info:
            check_encoder_options(config, attention=attention)
        assert expected in one_line(info) and " at 0x" not in one_line(info), one_line(info)


def test_the_drivers_lists_of_names_are_the_encoders():
    from encoder.api import DTYPES
    from encoder.attention.registry import _REGISTRY
    from encoder.config import BUILTIN_ATTENTION, DTYPE_NAMES

    assert tuple(DTYPES) == DTYPE_NAMES and tuple(_REGISTRY) == BUILTIN_ATTENTION
    # and the layer kinds a mapping may name are the towers' (built on the meta device: no weights)
    from encoder.api import attention_plan
    from encoder.config import attention_kinds
    from encoder.loading.presets import PRESETS

    for name, config in PRESETS.items():
        assert tuple(attention_plan(config, "cpu")) == attention_kinds(config), name
    # so the check needs no torch (the drivers import it only when they need it: tests/unit/test_architecture.py)
    code = (
        "import sys\nfrom deployments.preflight import check_encoder_options\n"
        "from encoder.loading.presets import PRESETS\n"
        "check_encoder_options(PRESETS['tiny'], 'pow2:256-1024', 'bf16', 'sdpa')\nprint('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "False", done.stderr[-2000:]


def test_hub_id_is_checked_offline_from_the_cache(monkeypatch, tmp_path, checkpoint):
    cache = use_cache(monkeypatch, tmp_path / "hf_home", offline=True)
    with pytest.raises(AppConfigError, match="HF_HUB_OFFLINE"):
        build_app({"model": "tiny-org/absent"})
    populate(cache, "tiny-org/tiny-vl", checkpoint)
    assert check_model("tiny-org/tiny-vl").kind == "hub"
    build_app({"model": "tiny-org/tiny-vl"})


def test_a_directory_needs_its_weights_unless_they_live_on_other_nodes(checkpoint, tmp_path):
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    (config_only / "config.json").write_text((checkpoint / "config.json").read_text())
    with pytest.raises(AppConfigError, match="no model.safetensors"):
        check_model(str(config_only))
    # `serve deploy`: the controller on a head node that holds only the config files
    assert check_model(str(config_only), weights_elsewhere=True).weights_on_disk is False
    (config_only / "config.json").write_text("{not json")
    with pytest.raises(AppConfigError):  # a broken config is refused even then
        check_model(str(config_only), weights_elsewhere=True)
    with pytest.raises(AppConfigError, match="no such directory"):
        check_model(str(tmp_path / "absent"), weights_elsewhere=True)


def test_a_taken_port_is_refused_even_when_shared_with_so_reuseport():
    with socket.socket() as plain:
        plain.bind(("127.0.0.1", 0))
        plain.listen()
        port = plain.getsockname()[1]
        with pytest.raises(AppConfigError, match=f"port {port} on 127.0.0.1 is already in use"):
            check_port_free("127.0.0.1", port)
        with pytest.raises(AppConfigError, match="already in use"):  # 0.0.0.0 covers 127.0.0.1
            check_port_free("0.0.0.0", port)
    with socket.socket() as shared:  # how Ray Serve's proxy binds: a second proxy would share it silently
        shared.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        shared.bind(("127.0.0.1", 0))
        shared.listen()
        with pytest.raises(AppConfigError, match="already in use"):
            check_port_free("127.0.0.1", shared.getsockname()[1])
        port = shared.getsockname()[1]
    check_port_free("127.0.0.1", port)  # free again


def _port_left_in_time_wait() -> int:
    """A port a just-stopped service leaves behind: a client was connected and the server closed first, so the
    server's side of that connection waits in TIME_WAIT (FIN_WAIT_2 until the client closes) with no listener.
    The listener binds as Ray Serve's proxy does (`ray.serve._private.http_util`): SO_REUSEADDR and SO_REUSEPORT."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        served, _ = listener.accept()
    served.close()  # the server closes first: its side of the connection keeps the port
    assert client.recv(1) == b""  # the server's FIN arrived
    client.close()
    return port


def test_a_port_left_in_time_wait_by_a_stopped_service_is_free():
    """Broken: the check bound without SO_REUSEADDR, so for ~65 s after a stop with a client connected the
    launcher refused to start again with "already in use"."""
    port = _port_left_in_time_wait()
    with pytest.raises(OSError):  # the state is there: a plain bind still fails
        with socket.socket() as plain:
            plain.bind(("127.0.0.1", port))
    check_port_free("127.0.0.1", port)
    check_port_free("0.0.0.0", port)
    with socket.socket() as listener:  # and a real listener on that port is still refused, bound as the proxy binds
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen()
        with pytest.raises(AppConfigError, match=f"port {port} on 127.0.0.1 is already in use"):
            check_port_free("127.0.0.1", port)


@pytest.mark.parametrize("port", ["70000", "-1", "0", "http"])
def test_a_port_out_of_range_is_a_usage_error(port, capsys):
    """Broken: `--port 70000` reached bind() and died with OverflowError's traceback, exit 1."""
    from deployments.__main__ import parse_args

    with pytest.raises(SystemExit) as info:
        parse_args(["--port", port])
    assert info.value.code == 2 and "argument --port" in capsys.readouterr().err


def test_launcher_arguments_are_key_values():
    assert key_values(["model=tiny", "num_replicas=2", "api_key=a=b"]) == {
        "model": "tiny", "num_replicas": "2", "api_key": "a=b"
    }  # fmt: skip
    with pytest.raises(AppConfigError, match="key=value"):
        key_values(["tiny"])


def test_access_logs_are_off_unless_asked_for():
    def access_logs(app) -> tuple[bool, bool]:
        ingress = app._bound_deployment
        encoder = ingress.init_args[0]._bound_deployment
        return tuple(d._deployment_config.logging_config["enable_access_log"] for d in (ingress, encoder))

    assert access_logs(build_app({})) == (False, False)
    assert access_logs(build_app({"access_log": "true"})) == (True, True)


def test_random_weights_are_marked(checkpoint):
    assert AppArgs(model="tiny").random_weights and AppArgs(model="qwen2.5-vl-7b").random_weights
    assert not AppArgs(model=str(checkpoint)).random_weights and not AppArgs(model="Qwen/X").random_weights


SHAPE = (
    'an image (a data URL or base64 string), a text (with input_type "text"), or a non-empty list of them and of '
    '{"text": ...} / {"image": ...} objects'
)
ITEM = 'a string or a {"text": ...} / {"image": ...} object'


@pytest.mark.parametrize(
    "body, sentence",
    [
        (b'{"input": []}', "input is an empty list; send at least one item"),
        (b"{}", f"input is required: {SHAPE}"),
        (b'{"input": 5}', f"input must be {SHAPE}"),
        (b'{"input": null}', f"input must be {SHAPE}"),
        (b'{"input": ["a", 3, ["b"]]}', f"input[1] must be {ITEM}"),  # the first only
    ],
)
def test_a_bad_input_is_one_sentence_not_pydantic_union_noise(body, sentence):
    with pytest.raises(Exception) as info:
        parse_embedding_request(body)
    assert str(info.value) == sentence and info.value.param == "input"


def test_other_schema_errors_keep_their_field_next_to_the_input_sentence():
    with pytest.raises(Exception) as info:
        parse_embedding_request(b'{"input": [], "pooling": "max"}')
    text = str(info.value)
    assert "input is an empty list" in text and "pooling: Input should be" in text and "list[str]" not in text


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_while_ray_starts_stops_the_launcher_once_ray_is_up(sig, monkeypatch):
    """Broken: a Ctrl-C that came while `ray.init` started Ray was lost (the service started and ran until a second
    one), and a SIGTERM there ended it with status 15 or 134. `ray.init` here is a stand-in that gets the signal
    while it runs; the launcher must then start nothing more and shut Ray down, exit 0."""
    import os
    import signal as signals

    import ray
    from ray import serve

    from deployments import __main__ as launcher

    calls, saved = [], {s: signals.getsignal(s) for s in (signals.SIGINT, signals.SIGTERM)}

    def init(**kwargs):
        calls.append("ray.init")
        os.kill(os.getpid(), getattr(signals, sig))  # delivered to the handler the launcher installed

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("ray.shutdown"))
    monkeypatch.setattr(serve, "start", lambda **kw: calls.append("serve.start"))
    monkeypatch.setattr(serve, "run", lambda *a, **kw: calls.append("serve.run"))
    monkeypatch.setattr(serve, "shutdown", lambda: calls.append("serve.shutdown"))
    monkeypatch.setattr(launcher, "ray_address", lambda given: "local")
    from deployments import ray_compat  # its log filters and Ray's flag are process-wide: kept out of this process

    for name in ("quiet_token_auth_notice", "quiet_serve_shutdown_notice", "quiet_serve_noise", "no_driver_stack_dump"):
        monkeypatch.setattr(ray_compat, name, lambda: None)
    try:
        assert launcher.main(["--port", str(free_port()), "model=tiny"]) == 0
    finally:
        for s, handler in saved.items():
            signals.signal(s, handler)
    assert calls == ["ray.init", "ray.shutdown"]


@pytest.mark.parametrize("inherited", ["default", "ignored"])
def test_a_signal_while_the_application_is_checked_starts_nothing(inherited, monkeypatch):
    """Broken: the launcher installed its handlers only after checking the application. Started in the background
    by a non-interactive shell (SIGINT inherited ignored), a Ctrl-C to its group in its first ~2 s was lost and
    the service started (measured: it ran until a second one); in a terminal the same Ctrl-C ended it with a
    KeyboardInterrupt traceback. Now nothing starts, exit 0."""
    import os
    import signal as signals

    import ray

    from deployments import __main__ as launcher
    from deployments import application

    calls, saved = [], {s: signals.getsignal(s) for s in (signals.SIGINT, signals.SIGTERM)}
    real_build_app = application.build_app

    def build_app(values):
        calls.append("build_app")
        os.kill(os.getpid(), signals.SIGINT)  # the Ctrl-C, while the model is checked
        return real_build_app(values)

    monkeypatch.setattr(application, "build_app", build_app)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append("ray.init"))
    monkeypatch.setattr(launcher, "ray_address", lambda given: "local")
    try:
        signals.signal(signals.SIGINT, signals.SIG_IGN if inherited == "ignored" else signals.default_int_handler)
        assert launcher.main(["--port", str(free_port()), "model=tiny"]) == 0
    finally:
        for s, handler in saved.items():
            signals.signal(s, handler)
    assert calls == ["build_app"]
