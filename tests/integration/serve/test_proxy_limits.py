"""The HTTP front's bounds and what listens (issue 44, cases 4, 5 and 10), on the launcher's fast path (HAProxy).

* A huge request header is refused at once (HAProxy's buffer, `proxy_max_header_bytes`) while `/health` answers.
* Connections that never send a byte are closed after `proxy_idle_timeout_s` (Serve's default kept them an hour),
  and a new request is served while more idle connections than `proxy_max_connections` are open.
* With `--host 127.0.0.1` no process of the launcher's Ray listens beyond loopback: Ray's metrics export port,
  HAProxy's stats and Prometheus frontends and the replicas' internal gRPC servers included (the last three
  rebound by `ray_compat.bind_serve_to_loopback`; docs/limits.md#security).

And the launcher's request path (issue 45.1): started with none of Serve's flags exported it runs Serve's fast path
(throughput mode, HAProxy in front of the ingress replicas, handle calls over gRPC). Observables: who listens on the
port (`ss -ltnp`: the `haproxy` process), the ingress replicas' start-up line (what Serve read in their environment)
and the launcher's ready line, which name the path. Its default counterpart: test_default_path_limits.py.

One launcher subprocess for the module, with a small cap and timeout so that the test needs few sockets; the
request-path test runs last and stops it with SIGTERM (it shares the launcher to save a start of its own, ~25 s on
the 2-core box).
"""

from __future__ import annotations

import ipaddress
import socket
import time

import httpx
import pytest
import ray  # noqa: F401  (puts Ray's bundled psutil on the path)

from tests.launcher import look_and_stop, running_launcher, send_huge_header, status_line

pytestmark = [pytest.mark.slow, pytest.mark.spawns_ray]

IDLE_TIMEOUT_S = 2
MAX_CONNECTIONS = 32


@pytest.fixture(scope="module")
def launcher(tmp_path_factory):
    """(port, process, log path) of a launcher on 127.0.0.1 with a small connection cap and idle timeout, started
    with none of Serve's flags exported (`tests.launcher.environment`). drain_grace_s=0: the stop at the end
    (`look_and_stop`, right after a request) does not wait out the 5 s grace, which nothing here is about."""
    args = [f"proxy_idle_timeout_s={IDLE_TIMEOUT_S}", f"proxy_max_connections={MAX_CONNECTIONS}", "drain_grace_s=0"]
    with running_launcher(tmp_path_factory.mktemp("proxy_limits"), args) as launched:
        yield launched


def test_a_huge_header_is_refused_at_once_and_health_answers(launcher):
    port, _, _ = launcher
    line, elapsed, sent, health_s = send_huge_header(port)
    assert line.startswith(b"HTTP/1.1 400"), (line, sent)
    assert elapsed < 10, elapsed  # 58.5 s in the issue; a wide margin over what it takes (milliseconds)
    assert sent < 16 * 2**20, sent  # the bytes were not taken in
    assert health_s and max(health_s) < 5, health_s
    assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200


def test_idle_connections_are_closed_and_new_requests_served(launcher):
    port, _, _ = launcher
    idle = []
    try:
        for _ in range(MAX_CONNECTIONS + 16):  # more than the cap: the last ones wait in the accept queue
            s = socket.socket()
            s.settimeout(60)
            s.connect(("127.0.0.1", port))
            idle.append(s)
        # a new request: served once the idle ones ahead of it time out (before: held for an hour)
        r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=60)
        assert r.status_code == 200
        started = time.monotonic()
        lines = [status_line(s) for s in idle]  # each is answered 408 and closed, never left open
        assert all(line in (b"", b"HTTP/1.1 408 Request Time-out") for line in lines), set(lines)
        assert time.monotonic() - started < 10 * IDLE_TIMEOUT_S + 30
    finally:
        for s in idle:
            s.close()


def test_nothing_of_the_launchers_ray_listens_beyond_loopback(launcher):
    import psutil

    _, proc, _ = launcher
    root = psutil.Process(proc.pid)
    listening, beyond = [], []
    for p in [root, *root.children(recursive=True)]:
        try:
            sockets = p.net_connections("inet")
            name = p.name()
        except psutil.Error:  # gone meanwhile
            continue
        for c in sockets:
            if c.status != psutil.CONN_LISTEN:
                continue
            listening.append((name, c.laddr.ip, c.laddr.port))
            address = ipaddress.ip_address(c.laddr.ip)
            address = getattr(address, "ipv4_mapped", None) or address
            if not address.is_loopback:
                beyond.append((name, c.laddr.ip, c.laddr.port))
    assert any(name.startswith("ray::DashboardAgent") for name, _, _ in listening), listening  # the metrics port
    # and what Ray 2.60 binds on every interface with no address to choose, rebound by the launcher's worker hook
    # (`ray_compat.bind_serve_to_loopback`): HAProxy's stats page and Prometheus frontend, each replica's gRPC server
    assert any(name == "haproxy" for name, _, _ in listening), listening
    assert any(name.startswith("ray::ServeReplica:") for name, _, _ in listening), listening
    assert not beyond, beyond


def test_the_launcher_runs_the_fast_path_with_nothing_exported(launcher):
    # last in the module: it stops the launcher
    name, output = look_and_stop(*launcher)
    assert name == "haproxy", (name, output[-3000:])  # HAProxy answers on the port, not Serve's Python proxy
    lines = output.splitlines()
    # the application line (the environment Ray inherited), the ingress replica's (what Serve read in it: its handle
    # to the encoders sends over gRPC) and the ready line name the path
    for what in ("vision app:", "vision ingress:", "vision service ready"):
        named = [line for line in lines if what in line]
        assert len(named) == 1 and "request path fast (HAProxy, gRPC)" in named[0], (what, output[-3000:])
    assert any("encoder ready:" in line for line in lines), output[-3000:]  # the replicas' lines reach the console
    # Serve's controller at WARNING: not its multi-line "Throughput optimized Ray Serve enabled" INFO record
    assert "ServeController" not in output and "Throughput optimized" not in output, output[-3000:]
    assert "Traceback" not in output and "failed to shut down" not in output, output[-3000:]
    # nor an ingress replica's lines about its HTTP port (`quiet_serve_noise`)
    assert "Allocated port" not in output and "Started HTTP server on port" not in output, output[-3000:]
