"""Run the service in the foreground: `python -m deployments [--port 8000] [--host 127.0.0.1] [key=value ...]`,
or from a Serve config file: `python -m deployments --config deployments/serve_config.yaml [key=value ...]`.

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

`--config FILE` reads a Serve config (the YAML of `serve run FILE`, validated with Serve's schema), quietly where
`serve run FILE` is not: its `http_options` host and port, its one application's name and args, `proxy_location`,
the timeouts of `http_options` and `logging_config` (Serve's controller and proxies). The flags given here (--host,
--port, --name, --serve-log-level) and KEY=VALUE pairs override what the file says. Any other field with a value
(`deployments:` overrides, `runtime_env`, an import path other than deployments:build_app, ...) is refused with one
`error:` line naming the file and the field, exit 2, rather than ignored (`deployments/launch_config.py`).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from dataclasses import replace

from deployments.launch_config import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    DEFAULT_SERVE_LOG_LEVEL,
    resolve,
    with_machine_defaults,
)
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
    # default None: not given, so the --config file's value (else the default) applies (launch_config.resolve)
    p.add_argument(
        "args", nargs="*", metavar="KEY=VALUE", help="AppArgs fields, e.g. model=tiny num_replicas=2 (over --config's)"
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help="a Serve config YAML (as for serve run FILE): its http_options host and port and its one application's "
        "name and args; the flags and KEY=VALUE pairs given here override the file; fields the launcher cannot "
        "apply (deployments overrides, runtime_env, ...) are refused, exit 2",
    )
    p.add_argument(
        "--host",
        help=f"address the HTTP proxy listens on (0.0.0.0: every one; default: --config's, else {DEFAULT_HOST})",
    )
    p.add_argument("--port", type=_port, help=f"HTTP port (default: --config's, else {DEFAULT_PORT})")
    p.add_argument(
        "--address", default=None, help="Ray cluster to join (default: RAY_ADDRESS, else a Ray instance of our own)"
    )
    p.add_argument("--name", help="application name (serve.get_app_handle(name); default: --config's, else default)")
    p.add_argument(
        "--serve-log-level",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help=f"log level of Serve's controller and HTTP proxies (default: --config's logging_config, else "
        f"{DEFAULT_SERVE_LOG_LEVEL}; INFO reports each deployment step)",
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
        # read after the request path's flags are set: Serve's schema imports Serve, which reads them
        s = resolve(ns)  # the flags given, then the --config file, then the defaults
        if address == "local":  # our own Ray on this machine: what is not given is sized to it
            s = replace(s, values=with_machine_defaults(s.values, os.cpu_count() or 1))
        app = build_app(s.values)  # checks the arguments and the model, before Ray starts
        app_args = AppArgs.model_validate(s.values)
        if address == "local":  # on a cluster the proxies listen on its nodes, not necessarily here
            check_port_free(s.host, s.port)
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
        OVERLAP_SERVE_START_CPUS,
        describe_request_path,
        is_loopback,
        loopback_only_node,
        loopback_runtime_env,
        no_driver_stack_dump,
        quiet_haproxy_stop_race,
        quiet_serve_noise,
        quiet_serve_shutdown_notice,
        quiet_serve_system_info,
        quiet_single_node_warning,
        quiet_token_auth_notice,
        serve_stopping,
        start_serve,
        wait_for_proxies,
    )

    if s.quiet_serve:  # the controller's INFO lines logged before its level is set
        quiet_serve_system_info()
    if address == "local":  # one node: no HAProxy elsewhere to shut out
        quiet_single_node_warning()

    quiet_token_auth_notice()  # token authentication stays on; Ray's notice of it at every start goes
    quiet_serve_shutdown_notice()  # and its "controller failed" line at every stop
    quiet_haproxy_stop_race()  # and the HAProxy manager's stats traceback when a report races the stop
    quiet_serve_noise()  # and serve.run's "new http_options will not be applied" after our serve.start applied them
    no_driver_stack_dump()  # a SIGTERM while Ray starts: no absl stack dump and abort (exit 134)
    loopback = address == "local" and is_loopback(s.host)
    if loopback:  # nothing of our own Ray listens beyond this machine either
        loopback_only_node()
    try:
        runtime_env = loopback_runtime_env() if loopback else None  # HAProxy's side ports and replicas' gRPC too
        ray.init(address=address, namespace="serve", runtime_env=runtime_env)
    except KeyboardInterrupt:
        return 0
    handle_signals()
    started = deployed = False
    try:
        # Serve's system actors log a dozen INFO lines per start and stop (endpoints, replicas added and stopped, a
        # router object's repr) around the app's own summary; the deployments keep their own logging_config
        # on a box with the cores for it, the proxies (HAProxy and its actor: seconds) start while serve.run
        # creates the replicas (`start_serve`)
        overlap = (os.cpu_count() or 1) >= OVERLAP_SERVE_START_CPUS
        if not stop.is_set():
            if overlap:
                start_serve(s.http_options, s.logging_config, s.proxy_location)
            else:
                serve.start(
                    http_options=s.http_options, logging_config=s.logging_config, proxy_location=s.proxy_location
                )
            started = True
        if not stop.is_set():
            serve.run(app, name=s.name, route_prefix="/", blocking=False)
            deployed = True
            if overlap:
                wait_for_proxies()
            host = "127.0.0.1" if s.host in ("0.0.0.0", "::") else s.host
            if address == "local":  # chosen here: the fast one unless asked otherwise
                path = describe_request_path(hint="drop --request-path default for the fast one")
            else:
                path = describe_request_path(cluster_environ())
            ready = f"vision service ready at http://{host}:{s.port}/v1, {path} (Ctrl-C to stop)"
            print(ready, file=sys.stderr, flush=True)
        stop.wait()
        serve_stopping()  # the HAProxy manager's stats race of the stop is not printed (quiet_haproxy_stop_race)
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
