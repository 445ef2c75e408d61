"""Run the service in the foreground: `python -m deployments [--port 8000] [--host 127.0.0.1] [key=value ...]`.

What `serve run deployments:build_app key=value ...` does, plus what it cannot: the HTTP port and host are
options (an import path given to `serve run` always gets port 8000), a taken port is refused before anything
starts (Ray's proxy would share it through SO_REUSEPORT and split the requests with the other service), a
bad model or argument is one `error:` line, one line says where the service answers once it does, and
SIGINT / SIGTERM shut it down gracefully and without a traceback: the ingress replicas drain first
(`deployments.shutdown`: new requests get 503 `shutting_down`, admitted ones are answered), then Serve and
Ray stop; a second signal stops at once. Exit status: 0 after a requested stop, 2 for bad arguments, a bad
model or a taken port. Serve's controller and HTTP proxies log at WARNING (`--serve-log-level INFO` brings
back their lines for each deployment step), so the start-up reads as the app's own summary lines.

Without `--address` (or RAY_ADDRESS) it starts its own local Ray instance, never a cluster someone else
started on this machine, on Serve's fast request path (throughput mode, HAProxy, gRPC: `ray_compat.FAST_PATH_ENV`,
put in its environment before `ray.init`; a variable the user exported wins; `--request-path default` keeps
Serve's default path). With an address it joins that cluster, whose request path was chosen when its Ray
started, and the ready line says which it is. Joining needs `RAY_AUTH_MODE=token` to authenticate with the
token in ~/.ray/auth_token, as `ray start` clusters require in Ray 2.60.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from deployments.preflight import USAGE_EXIT, AppConfigError, check_port_free, ray_address


def _port(text: str) -> int:
    """A TCP port for argparse (a bad one: its usage line and exit 2, not a traceback from bind)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port {port} is not in 1-65535")
    return port


def key_values(items: list[str]) -> dict[str, str]:
    """`["model=tiny", "num_replicas=2"]` -> a dict of strings (AppArgs coerces them, as for `serve run`)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise AppConfigError(f"application arguments are key=value, got {item!r}")
        out[key] = value
    return out


def cluster_environ() -> dict[str, str]:
    """The environment a Ray process of the joined cluster starts with (a task's: its node's Ray environment),
    the flags of the request path only."""
    import ray

    from deployments.ray_compat import FAST_PATH_ENV

    @ray.remote(num_cpus=0)
    def environ() -> dict[str, str]:
        return {k: os.environ[k] for k in FAST_PATH_ENV if k in os.environ}

    return ray.get(environ.remote(), timeout=60)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m deployments", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("args", nargs="*", metavar="KEY=VALUE", help="AppArgs fields, e.g. model=tiny num_replicas=2")
    p.add_argument("--host", default="127.0.0.1", help="address the HTTP proxy listens on (0.0.0.0: every one)")
    p.add_argument("--port", type=_port, default=8000, help="HTTP port (default 8000)")
    p.add_argument(
        "--address", default=None, help="Ray cluster to join (default: RAY_ADDRESS, else a Ray instance of our own)"
    )
    p.add_argument("--name", default="default", help="application name (serve.get_app_handle(name))")
    p.add_argument(
        "--serve-log-level",
        default="WARNING",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="log level of Serve's controller and HTTP proxies (default WARNING; INFO reports each deployment step)",
    )
    p.add_argument(
        "--request-path",
        default="fast",
        choices=["fast", "default"],
        help="Serve's request path when this starts its own Ray: fast (throughput mode, HAProxy, gRPC; the default) "
        "or default (Serve's Python HTTP proxy and actor calls); a cluster joined keeps its own",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    # The main thread stops Serve and Ray in order on the first SIGINT / SIGTERM (a second one skips the drain).
    # Installed first: a signal while the model is checked or Ray starts is kept, whatever the launcher inherited
    # (a process started in the background by a non-interactive shell inherits SIGINT ignored: a Ctrl-C sent to
    # its group in its first seconds was lost and the service started); and again after ray.init: Ray's core
    # worker installs its own SIGTERM handler (sys.exit(15)).
    stop = threading.Event()

    def on_signal(*_):
        if stop.is_set():  # a second signal: skip the drain
            raise KeyboardInterrupt
        stop.set()

    def handle_signals() -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)

    handle_signals()
    address = ray_address(ns.address)
    if address == "local" and ns.request_path == "fast":
        from deployments.ray_compat import use_fast_path

        # Ray's processes inherit this environment and read the flags when they start; set before this process
        # imports Ray Serve, so its own handles and `build_app`'s line agree
        use_fast_path()
    elif address != "local":  # for build_app: the request path is the cluster's, not this environment's
        os.environ["RAY_ADDRESS"] = address
    from deployments.application import build_app
    from deployments.config import AppArgs
    from deployments.shutdown import drain, drain_timeout

    try:
        values = key_values(ns.args)
        app = build_app(values)  # checks the arguments and the model, before Ray starts
        app_args = AppArgs.model_validate(values)
        if address == "local":  # on a cluster the proxies listen on its nodes, not necessarily here
            check_port_free(ns.host, ns.port)
    except AppConfigError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return USAGE_EXIT
    except KeyboardInterrupt:  # a second signal before Ray started: nothing to stop
        return 0
    if stop.is_set():  # a signal while the application was checked: Ray is not started
        return 0

    import ray
    from ray import serve

    from deployments.ray_compat import (
        describe_request_path,
        is_loopback,
        loopback_only_node,
        no_driver_stack_dump,
        quiet_serve_noise,
        quiet_serve_shutdown_notice,
        quiet_serve_system_info,
        quiet_single_node_warning,
        quiet_token_auth_notice,
    )

    if ns.serve_log_level in ("WARNING", "ERROR"):  # the controller's INFO lines logged before its level is set
        quiet_serve_system_info()
    if address == "local":  # one node: no HAProxy elsewhere to shut out
        quiet_single_node_warning()

    quiet_token_auth_notice()  # token authentication stays on; Ray's notice of it at every start goes
    quiet_serve_shutdown_notice()  # and its "controller failed" line at every stop
    quiet_serve_noise()  # and serve.run's "new http_options will not be applied" after our serve.start applied them
    no_driver_stack_dump()  # a SIGTERM while Ray starts: no absl stack dump and abort (exit 134)
    if address == "local" and is_loopback(ns.host):  # nothing of our own Ray listens beyond this machine either
        loopback_only_node()
    try:
        ray.init(address=address, namespace="serve")
    except KeyboardInterrupt:
        return 0
    handle_signals()
    started = deployed = False
    try:
        # Serve's system actors log a dozen INFO lines per start and stop (endpoints, replicas added and stopped, a
        # router object's repr) around the app's own summary; the deployments keep their own logging_config
        if not stop.is_set():
            serve.start(
                http_options={"host": ns.host, "port": ns.port}, logging_config={"log_level": ns.serve_log_level}
            )
            started = True
        if not stop.is_set():
            serve.run(app, name=ns.name, route_prefix="/", blocking=False)
            deployed = True
            host = "127.0.0.1" if ns.host in ("0.0.0.0", "::") else ns.host
            if address == "local":  # chosen here: the fast one unless asked otherwise
                path = describe_request_path(hint="drop --request-path default for the fast one")
            else:
                path = describe_request_path(cluster_environ())
            ready = f"vision service ready at http://{host}:{ns.port}/v1, {path} (Ctrl-C to stop)"
            print(ready, file=sys.stderr, flush=True)
        stop.wait()
        if deployed:  # Serve's shutdown drops what is in flight: finish the admitted requests first
            drain(drain_timeout(app_args.request_timeout_s, app_args.drain_grace_s))
    except KeyboardInterrupt:
        pass
    finally:
        try:
            if deployed or (started and address != "local"):  # a cluster outlives us: remove the application
                serve.shutdown()
        except KeyboardInterrupt:
            pass
        ray.shutdown()  # our own Ray instance: everything in it stops
    return 0


if __name__ == "__main__":
    sys.exit(main())
