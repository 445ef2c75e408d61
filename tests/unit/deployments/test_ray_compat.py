"""`deployments.ray_compat`: the start-up check that the installed Ray has the private APIs the service uses."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from ray.serve import context as serve_context

from deployments import ray_compat


def test_installed_ray_has_every_private_api_and_is_in_the_tested_range():
    assert ray_compat._missing() == []
    low, high = ray_compat.TESTED_RAY
    assert low <= ray_compat._version() < high
    ray_compat.check_ray()


def test_a_missing_private_api_is_a_clear_error_naming_it(monkeypatch):
    monkeypatch.delattr(serve_context, "_get_serve_request_context")
    ray_compat.check_ray.cache_clear()
    try:
        with pytest.raises(ray_compat.RayCompatError, match=r"_get_serve_request_context.*install ray>=2\.60,<2\.61"):
            ray_compat.check_ray()
    finally:
        ray_compat.check_ray.cache_clear()


def test_the_pin_in_pyproject_is_the_tested_range():
    import tomllib

    project = tomllib.loads((Path(__file__).resolve().parents[3] / "pyproject.toml").read_text())["project"]
    (low, high) = ray_compat.TESTED_RAY
    pin = f"ray[serve,data]>={low[0]}.{low[1]},<{high[0]}.{high[1]}"
    assert pin in project["dependencies"]


def test_the_driver_stack_dump_switch_is_the_one_the_core_worker_reads(monkeypatch):
    from ray._private import ray_constants

    monkeypatch.setattr(ray_constants, "RAY_DISABLE_FAILURE_SIGNAL_HANDLER", False)
    ray_compat.no_driver_stack_dump()
    assert ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER is True
    monkeypatch.delattr(ray_constants, "RAY_DISABLE_FAILURE_SIGNAL_HANDLER")
    assert ray_compat._missing() == ["ray._private.ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER"]


def test_the_token_auth_notice_is_dropped_and_the_disabled_warning_kept(caplog):
    import logging

    from ray._private.authentication import authentication_token_setup as setup

    caplog.set_level(logging.INFO, logger=ray_compat.TOKEN_AUTH_LOGGER)
    setup._warn_token_auth_enabled()  # Ray's own notice: the text the filter matches
    assert any(r.getMessage().startswith(ray_compat.TOKEN_AUTH_NOTICE) for r in caplog.records), caplog.text
    caplog.clear()
    target = logging.getLogger(ray_compat.TOKEN_AUTH_LOGGER)
    try:
        ray_compat.quiet_token_auth_notice()
        ray_compat.quiet_token_auth_notice()
        assert len(target.filters) == 1
        setup._warn_token_auth_enabled()
        setup._warn_token_auth_disabled()
        target.info("another record of that logger")
        assert [r.getMessage()[:42] for r in caplog.records] == [
            "Token authentication is disabled for this ",
            "another record of that logger",
        ]
    finally:
        for f in list(target.filters):
            target.removeFilter(f)


def test_importing_the_module_imports_no_serve():
    import subprocess
    import sys

    code = "import sys, deployments.ray_compat; print(sorted(m for m in sys.modules if m.startswith('ray.serve')))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


def test_serve_client_waits_poll_quickly_and_the_check_names_the_constant(monkeypatch):
    from ray.serve._private import client as serve_client

    monkeypatch.setattr(serve_client, "CLIENT_POLLING_INTERVAL_S", 1.0)  # Ray's default
    ray_compat.quick_serve_polls()
    assert serve_client.CLIENT_POLLING_INTERVAL_S == ray_compat.QUICK_POLL_S == 0.1
    monkeypatch.delattr(serve_client, "CLIENT_POLLING_INTERVAL_S")
    assert ray_compat._missing() == ["ray.serve._private.client.CLIENT_POLLING_INTERVAL_S"]


def rays_own_printer():
    """Ray's `print_to_stdstream` without the filters of `ray_compat`: a test process that built the app earlier
    (serve.run of build_app, the launcher in-process) has them installed for good."""
    from ray._private import worker as ray_worker

    printer = ray_worker.print_to_stdstream
    while hasattr(printer, "quiet_markers"):
        printer = printer.__wrapped__
    return printer


def test_serve_shutdown_notice_is_dropped_and_other_pushed_errors_printed(monkeypatch, capsys):
    from ray._private import worker as ray_worker

    monkeypatch.setattr(ray_worker, "print_to_stdstream", rays_own_printer())  # restored afterwards
    ray_compat.quiet_serve_shutdown_notice()
    ray_compat.quiet_serve_shutdown_notice()
    notice = (
        "Task ServeController.graceful_shutdown failed. There are infinite retries remaining, so the task will be "
        "retried. Error: The actor is dead because it was killed by `ray.kill`."
    )
    other_cause = notice.replace("killed by `ray.kill`", "OOM-killed")
    for lines in ([notice], [other_cause], ["A worker died or was killed while executing a task."]):
        ray_worker.print_to_stdstream({"lines": lines, "pid": "raylet", "is_err": False}, ignore_prefix=False)
    printed = capsys.readouterr().out
    assert "killed by `ray.kill`" not in printed
    assert "OOM-killed" in printed and "A worker died" in printed
    assert ray_worker.print_to_stdstream.quiet_markers == ("serve_shutdown_notice",)  # installed once
    monkeypatch.delattr(ray_worker, "print_to_stdstream")
    assert "ray._private.worker.print_to_stdstream" in ray_compat._missing()


def test_serve_system_actors_print_warnings_only_and_every_other_line_passes(monkeypatch, capsys):
    import inspect

    from ray._private import worker as ray_worker
    from ray.serve._private.controller import ServeController
    from ray.serve._private.logging_utils import ServeFormatter
    from ray.serve._private.proxy import ProxyActor

    # the names Ray gives those actors' lines, and Serve's text format, which starts with the level
    names = {ServeController.__name__, ProxyActor.__ray_metadata__.class_name}  # one plain class, one @ray.remote
    assert names == ray_compat.SERVE_SYSTEM_ACTORS
    assert ServeFormatter.COMPONENT_LOG_FMT.startswith("%(levelname)s ")
    assert "actor_name" in inspect.getsource(ray_worker.print_worker_logs)
    monkeypatch.setattr(ray_worker, "print_to_stdstream", rays_own_printer())  # restored afterwards
    ray_compat.quiet_serve_shutdown_notice()
    ray_compat.quiet_serve_system_info()
    ray_compat.quiet_serve_system_info()
    assert ray_worker.print_to_stdstream.quiet_markers == ("serve_shutdown_notice", "serve_system_info")

    def line(level: str, text: str) -> str:
        return f"{level} 2026-12-04 15:16:46,044 proxy 192.0.2.2 -- {text}"

    batches = [
        (
            "ProxyActor",
            [line("INFO", "Started <ray.serve._private.router.X object at 0x7f>."), line("DEBUG", "a debug detail")],
        ),
        ("ServeController", [line("INFO", "Adding 1 replica"), line("WARNING", "replica slow to start")]),
        ("ServeController", [line("ERROR", "deploy failed"), "Traceback (most recent call last):", "  boom"]),
        ("ServeReplica:default:VisionIngress", [line("INFO", "vision ingress: API key off")]),
        (None, ["INFO a task's own line"]),
    ]
    for actor, lines in batches:
        data = {"lines": lines, "pid": 4242, "ip": "192.0.2.2", "is_err": True, "job": "01000000"}
        if actor:
            data["actor_name"] = actor
        ray_worker.print_to_stdstream(data, ignore_prefix=False)
    printed = capsys.readouterr().err
    assert "object at 0x" not in printed and "Adding 1 replica" not in printed and "debug detail" not in printed, (
        printed
    )
    assert "replica slow to start" in printed and "deploy failed" in printed and "  boom" in printed, printed
    assert "vision ingress: API key off" in printed and "a task's own line" in printed, printed
    # a batch is not changed in place (Ray's deduplicator keeps references to what it printed)
    data = {"lines": [line("INFO", "x"), line("WARNING", "y")], "actor_name": "ProxyActor"}
    assert ray_compat.without_serve_system_info(data) == {**data, "lines": [line("WARNING", "y")]}
    assert len(data["lines"]) == 2 and ray_compat.without_serve_system_info({**data, "lines": []}) is None
    # a multi-line INFO record (the controller's "Throughput optimized Ray Serve enabled ...") goes whole
    record = [line("INFO", "Throughput optimized Ray Serve enabled with:"), "  • Direct ingress enabled", ""]
    data = {"lines": [*record, line("ERROR", "boom"), "  detail"], "actor_name": "ServeController"}
    assert ray_compat.without_serve_system_info(data)["lines"] == [line("ERROR", "boom"), "  detail"]


def test_serve_noise_is_dropped_and_every_other_serve_line_kept():
    import inspect
    import logging

    from ray.serve._private import api as serve_api
    from ray.serve._private.constants import SERVE_NAMESPACE
    from ray.serve._private.router import SharedRouterLongPollClient

    # Ray's wording where it logs the two lines (a reworded line would pass the filter and show again)
    assert 'logger.info(f"Started {shared}.")' in inspect.getsource(SharedRouterLongPollClient.get_or_create)
    source = inspect.getsource(serve_api)
    assert "Connecting to existing Serve app in namespace" in source
    assert '" New http_options/controller_options will not be applied."' in source and SERVE_NAMESPACE == "serve"
    shared = object.__new__(SharedRouterLongPollClient)  # its repr as Ray logs it: no __repr__ of its own
    started = f"Started {shared}."
    connecting = (
        f'Connecting to existing Serve app in namespace "{SERVE_NAMESPACE}". '
        "New http_options/controller_options will not be applied."
    )
    kept = ['Started Serve in namespace "serve".', "vision ingress: API key off, URL fetching off"]
    target = logging.getLogger("ray.serve")
    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    handler, level = Collect(), target.level
    target.addHandler(handler)
    target.setLevel(logging.INFO)
    try:
        for line in (started, connecting, *kept):
            target.info(line)
        assert seen == [started, connecting, *kept]  # the lines as Ray logs them, without the filter
        seen.clear()
        ray_compat.quiet_serve_noise()
        ray_compat.quiet_serve_noise()
        assert target.filters.count(ray_compat._not_serve_noise) == 1
        for line in (started, connecting, *kept):
            target.info(line)
        assert seen == kept
    finally:
        target.removeHandler(handler)
        target.removeFilter(ray_compat._not_serve_noise)
        target.setLevel(level)


def test_use_fast_path_sets_what_the_user_has_not_exported():
    environ = {"RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": "1000", "PATH": "/bin"}
    added = ray_compat.use_fast_path(environ)
    assert added == {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1", **ray_compat.LAUNCHER_ENV}
    assert environ["RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH"] == "1000"  # the user's value wins
    # one batch of 32 224x224 uint8 arrays (4.8 MB) fits the cap the launcher sets
    assert int(ray_compat.FAST_PATH_ENV["RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH"]) > 32 * 224 * 224 * 3
    assert ray_compat.use_fast_path(environ) == {}


def test_the_request_path_is_named_with_a_hint_when_slow():
    assert ray_compat.request_path(dict(ray_compat.FAST_PATH_ENV)) == "fast"
    assert ray_compat.describe_request_path(dict(ray_compat.FAST_PATH_ENV)) == "request path fast (HAProxy, gRPC)"
    assert ray_compat.request_path({"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}) == "throughput-optimised"
    assert ray_compat.request_path({"RAY_SERVE_THROUGHPUT_OPTIMIZED": "true"}) == "default"  # Serve takes "1" only
    # a user's exported 0 wins over the launcher's 1
    haproxy_only = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "0", "RAY_SERVE_ENABLE_HA_PROXY": "1"}
    assert ray_compat.describe_request_path(haproxy_only).startswith("request path haproxy (HAProxy, actor calls); ")
    slow = ray_compat.describe_request_path({})
    assert slow.startswith("request path default (Serve's Python proxy, actor calls); for the fast one start Ray")
    assert all(f"{k}={v}" in slow for k, v in ray_compat.FAST_PATH_ENV.items())
    assert ray_compat.describe_request_path({}, hint="HINT").endswith("; HINT")


def test_the_fast_path_flags_are_the_ones_serve_reads():
    from ray.serve._private import constants

    names = {**ray_compat.FAST_PATH_ENV, **ray_compat.LAUNCHER_ENV}
    assert all(hasattr(constants, ray_compat.SERVE_CONSTANT_OF.get(name, name)) for name in names)


def test_driver_handles_get_a_router_loop_of_their_own(monkeypatch):
    from ray.serve._private import handle_options
    from ray.serve._private.handle_options import InitHandleOptions
    from ray.serve._private.utils import DEFAULT

    monkeypatch.setattr(InitHandleOptions, "create", InitHandleOptions.__dict__["create"])  # restored after
    ray_compat.sync_driver_handles()
    ray_compat.sync_driver_handles()  # idempotent: one wrapper
    assert InitHandleOptions.create()._run_router_in_separate_loop is True
    assert InitHandleOptions.create(_run_router_in_separate_loop=DEFAULT.VALUE)._run_router_in_separate_loop is True
    assert InitHandleOptions.create(_run_router_in_separate_loop=False)._run_router_in_separate_loop is False

    async def from_async_code():  # a handle first used in a running loop keeps Serve's choice
        return InitHandleOptions.create()._run_router_in_separate_loop

    assert asyncio.run(from_async_code()) is handle_options.RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP


def test_the_single_node_haproxy_warning_goes_and_nothing_else():
    warning = f"WARNING 2026-12-05 controller 1 -- HTTPOptions.host='127.0.0.1' {ray_compat.HAPROXY_HOST_WARNING}; ..."
    data = {"lines": [warning, "ERROR x -- other"], "actor_name": "ServeController"}
    assert ray_compat.without_single_node_warning(data)["lines"] == ["ERROR x -- other"]
    assert ray_compat.without_single_node_warning({**data, "lines": [warning]}) is None
    assert ray_compat.without_single_node_warning({**data, "actor_name": "Other"}) == {**data, "actor_name": "Other"}


def test_the_haproxy_host_warning_is_rays_wording():
    import inspect

    from ray.serve._private import controller

    source = inspect.getsource(controller).replace('"\n                    "', "")  # the message's literals joined
    assert ray_compat.HAPROXY_HOST_WARNING in source


def test_haproxy_side_ports_move_only_off_a_port_something_listens_on(monkeypatch):
    """A second fast-path service on one machine: HAProxy's Prometheus / stats ports (fixed by default) taken by
    the first made the second's HAProxy exit "Address already in use". A listened default gets a free port;
    a free default is kept (not in the answer). Broken: the taken default kept, or a free one moved."""
    import os
    import socket

    from ray.serve._private import constants

    for name, port in ray_compat.HAPROXY_SIDE_PORTS.items():  # the variables and defaults Serve reads
        assert getattr(constants, name) == port or os.environ.get(name)
    with socket.socket() as taken, socket.socket() as probe:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        probe.bind(("0.0.0.0", 0))
        free = probe.getsockname()[1]
        probe.close()  # free again, never listened on
        monkeypatch.setattr(ray_compat, "HAPROXY_SIDE_PORTS", {"METRICS": taken.getsockname()[1], "STATS": free})
        moved = ray_compat.haproxy_side_ports()
        assert set(moved) == {"METRICS"} and int(moved["METRICS"]) != taken.getsockname()[1]
        env = {}
        ray_compat.use_fast_path(env)
        assert "METRICS" in env and "STATS" not in env
        env = {"METRICS": "9999"}
        ray_compat.use_fast_path(env)
        assert env["METRICS"] == "9999"  # a value the user exported wins


def test_the_python_proxy_hook_is_set_only_where_haproxy_is_off_and_an_exported_one_wins():
    class Args:
        proxy_max_header_bytes, proxy_idle_timeout_s, proxy_max_connections = 8192, 3, 100

    default = {}
    ray_compat.use_proxy_bounds(Args(), default)
    assert default[ray_compat.PROXY_CALLBACK_ENV] == ray_compat.PROXY_CALLBACK
    assert ray_compat.python_proxy_limits(default) == (8192, 3.0, 100)  # what the proxy reads: the same AppArgs
    fast = {"RAY_SERVE_ENABLE_HA_PROXY": "1"}
    ray_compat.use_proxy_bounds(Args(), fast)
    assert ray_compat.PROXY_CALLBACK_ENV not in fast
    own = {ray_compat.PROXY_CALLBACK_ENV: "mine:callback"}
    ray_compat.use_proxy_bounds(Args(), own)
    assert own[ray_compat.PROXY_CALLBACK_ENV] == "mine:callback"
    module, _, name = ray_compat.PROXY_CALLBACK.partition(":")
    assert module == ray_compat.__name__ and callable(getattr(ray_compat, name))


def test_the_bounded_protocol_refuses_big_heads_times_out_idle_ones_and_makes_room_for_new_ones():
    """uvicorn with `bounded_http_protocol` (what the hook gives Serve's proxy), in a thread of this process."""
    import socket
    import threading

    import httpx
    import uvicorn

    from tests.serve_fixtures import free_port, wait_for

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    port, cap = free_port(), 8
    protocol = ray_compat.bounded_http_protocol(4096, 1.0, cap)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, http=protocol, lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}/"
    try:
        wait_for(lambda: server.started, timeout_s=30, what="uvicorn")
        with socket.create_connection(("127.0.0.1", port), timeout=10) as big:
            try:
                big.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 2**20)
            except OSError:  # closed while sending
                pass
            answer = big.recv(100)
        assert answer == b"" or answer.startswith(b"HTTP/1.1 431 "), answer  # b"": lost to the reset
        idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(cap + 4)]
        assert httpx.get(url, timeout=10).text == "ok"  # served at once: the oldest idle ones gave way
        started = time.monotonic()
        assert all(s.recv(10) == b"" for s in idle)  # closed (the oldest 5 at once, the others timed out), unanswered
        assert time.monotonic() - started < 8
        for s in idle:
            s.close()
        with httpx.Client() as client:  # a keep-alive connection is served again, the timer restarted by each head
            assert [client.get(url, timeout=10).text for _ in range(3)] == ["ok"] * 3
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_loopback_binds_rewrite_haproxy_side_ports_and_the_replica_grpc_port(monkeypatch):
    from ray.serve._private import haproxy, replica

    # restored after the test: the hook changes Ray's modules in the process it runs in
    monkeypatch.setattr(haproxy, "HAPROXY_CONFIG_TEMPLATE", haproxy.HAPROXY_CONFIG_TEMPLATE)
    seen = []
    monkeypatch.setattr(replica, "add_port_to_grpc_server", lambda server, address: seen.append(address) or 4321)
    assert "bind *:{{ config.stats_port }}" in haproxy.HAPROXY_CONFIG_TEMPLATE  # Ray's own: every interface
    ray_compat.bind_serve_to_loopback()
    ray_compat.bind_serve_to_loopback()  # twice in one process: the port rebound once
    template = haproxy.HAPROXY_CONFIG_TEMPLATE
    assert (
        "bind 127.0.0.1:{{ config.stats_port }}" in template and "bind 127.0.0.1:{{ config.metrics_port }}" in template
    )
    assert "bind *:" not in template and "bind :" not in template
    assert replica.add_port_to_grpc_server(object(), "[::]:0") == 4321
    assert replica.add_port_to_grpc_server(object(), "10.0.0.1:5") == 4321
    assert seen == ["127.0.0.1:0", "10.0.0.1:5"]
    assert ray_compat._missing() == []  # the check accepts the rebound template (a worker the hook ran in)
    assert ray_compat.loopback_runtime_env() == {
        "worker_process_setup_hook": "deployments.ray_compat.bind_serve_to_loopback"
    }


def test_a_template_without_the_bind_lines_is_named_missing(monkeypatch):
    from ray.serve._private import haproxy

    monkeypatch.setattr(haproxy, "HAPROXY_CONFIG_TEMPLATE", "listen stats\n  bind 0.0.0.0:{{ config.stats_port }}\n")
    assert any("HAPROXY_CONFIG_TEMPLATE" in m for m in ray_compat._missing())


def test_the_haproxy_stats_race_of_the_stop_goes_only_once_stopping(monkeypatch):
    monkeypatch.setattr(ray_compat, "_serve_stopping", __import__("threading").Event())
    race = [
        "ERROR 2026-12-06 proxy 127.0.0.1 -- Failed to get HAProxy stats: Failed to send socket command 'show stat'",
        "ERROR 2026-12-06 proxy 127.0.0.1 -- Unexpected error reporting HAProxy node metrics.",
        "Traceback (most recent call last):",
        "ConnectionRefusedError: [Errno 111] Connection refused",
    ]
    other = "WARNING 2026-12-06 proxy 127.0.0.1 -- something else"
    data = {"lines": [*race, other], "actor_name": "HAProxyManager"}
    assert ray_compat.without_haproxy_stop_race(data) == data  # while serving: an error worth seeing
    ray_compat.serve_stopping()
    assert ray_compat.without_haproxy_stop_race(data)["lines"] == [other]
    assert ray_compat.without_haproxy_stop_race({**data, "lines": race}) is None
    elsewhere = {**data, "actor_name": "ServeController"}
    assert ray_compat.without_haproxy_stop_race(elsewhere) == elsewhere
