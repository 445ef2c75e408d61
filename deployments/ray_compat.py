"""Every private Ray API this service relies on, in one place, checked at start-up (`check_ray`).

Ray Serve's public API covers the rest; these fifteen have no public equivalent in Ray 2.60 (the range tested
is `TESTED_RAY`, pinned in pyproject.toml). Each says why it is needed and what was tried instead:

* `call_as_new_request`: a handle call with a fresh internal request id. Serve gives every handle call
  made while serving a request that request's internal id, and a router that does not fulfil pending
  requests in FIFO order (the `BucketRouter`) has its result matched to the pending request by that id:
  two concurrent encoder calls of one ingress request (a split request, a merged batch of several HTTP
  requests) share it, one gets both assignments and the other waits forever. Tried instead: the router
  matching the pending request itself (that is Ray's private `_fulfill_next_pending_request`; its
  `FIFOMixin` hands replicas to the oldest request whatever its bucket, undoing the affinity); a call in
  an empty `contextvars.Context` (also drops the user-facing request id that Serve's logs correlate by).
* `by_reference(handle)`: `options(_by_reference=True)`, so big payloads go through the object store even
  when Serve sends requests over gRPC (`RAY_SERVE_THROUGHPUT_OPTIMIZED=1`, whose gRPC messages have a cap).
* `SelectionHook`: a mixin for `RequestRouter` subclasses that calls `on_replica_selected(replica)` after
  Ray's own pick (its private `_select_from_candidate_replicas`), which the `BucketRouter` uses to count
  a selection in the queue-length cache at once rather than when the request is sent; and
  `on_request_assigned(replica, internal_request_id)` after Ray's private `_fulfill_next_pending_request` hands
  the replica to a request, which `routing.progress` needs to know which replica each encoder call waits on. The
  public `on_request_routed` comes only once the replica accepted the request (Serve's strict
  `max_ongoing_requests` asks it first), which a frozen replica never does (issue 44).
* `call_with_request_id(request_id, method, ...)`: `call_as_new_request` with an id the caller chose, so the
  ingress can follow its call to the replica the router assigns it (`routing.progress`).
* `queue_len_cache_enabled(router)`: whether Ray keeps that cache at all (`_use_replica_queue_len_cache`).
* `live_replica_count(app, deployment)`: the replica actors the GCS knows alive, by the actor name Serve gives
  them (`REPLICA_ID_FULL_ID_STR_PREFIX` + `app#deployment#id`, in `ray.serve._private.common`). `/health`
  needs to know within seconds that the last encoder replica died; `serve.status()` says so only after the
  controller's next health check, and the public state API needs the dashboard.
* `no_driver_stack_dump()`: `ray._private.ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER`, read when this
  process connects to Ray. A driver's core worker installs absl's failure-signal handler, which answers a plain
  SIGTERM (`kill PID`, a process manager) with a stack dump printed twice, the second time as E-level log lines,
  and a 3 s alarm. `serve run` connects after our `build_app` returns, so its handler cannot be replaced
  afterwards as the launcher does (`python -m deployments`). Tried instead: the environment variable of the
  same name, which every Ray process this one starts would inherit (their crash dumps are worth keeping).
* `quiet_token_auth_notice()`: a filter on the logger of `ray._private.authentication.authentication_token_setup`
  that drops its "Token authentication is enabled for this Ray cluster" notice, printed at every start of a
  local instance (`python -m deployments`, `serve run deployments:...`, `run_job` and so the batch CLI):
  authentication stays on, only the notice goes (the "is disabled" warning, a real risk, is kept). Not in
  `embed_dataset`, whose Ray and logging are the caller's. Tried instead: setting `RAY_AUTH_MODE=token`
  ourselves, which Ray takes as explicit and does not announce; but `import ray` caches Ray's config before
  our entry points could set it (`deployments` imports Ray), and a driver whose cached mode disagrees with
  the processes it starts cannot authenticate to them.
* `quiet_serve_shutdown_notice()`: a wrapper around `ray._private.worker.print_to_stdstream`, through which a
  driver prints the errors the GCS pushes to it, that drops one: "Task ServeController.graceful_shutdown failed.
  There are infinite retries remaining, so the task will be retried. Error: The actor is dead because it was
  killed by `ray.kill`", printed (yellow, as from the raylet) by a `serve.shutdown()` whenever the driver's
  listener gets it before Ray disconnects: seen at a Ctrl-C of `serve run` and a SIGTERM of the launcher
  (2026-12-03), not in every test run. Serve's controller ends its own graceful shutdown by killing
  itself, and the call waiting on it counts as a failed task with retries left. Nothing is retried and nothing
  failed; every other pushed error, and this one with another cause, is printed. Tried instead: a logging filter
  (the line is printed, not logged) and `serve.shutdown` alternatives (the CLI calls it, not us).
* `quiet_serve_system_info()`: through the same function, what `serve run deployments:...` prints of the lines
  Serve's controller and HTTP proxy actors log drops their DEBUG and INFO lines (a dozen per start and stop:
  endpoints, each replica added and stopped, the proxy's `Started <...SharedRouterLongPollClient object at
  0x...>`); their WARNING and ERROR lines are printed, and Ray's log files keep everything. The launcher sets
  those actors' level instead (`serve.start(logging_config=...)`), which `serve run` does not let an import path
  do. Tried instead: a level in the deployments' own `logging_config` (it covers the replicas only).
* `quiet_single_node_warning()`: through the same function, the launcher's own (one-node) Ray drops the
  controller's fast-path warning that an HTTP host of 127.0.0.1 "won't accept connections from HAProxy on other
  nodes" (there are none); on a cluster it is printed.
* `quick_serve_polls()`: `ray.serve._private.client.CLIENT_POLLING_INTERVAL_S`, how long Serve's client sleeps
  between two looks at the controller while `serve.run` waits for the application to be RUNNING and while
  `serve.delete` waits for it to go: 1 s, so `serve run`, the launcher and every `serve.run` in a pipeline
  answered up to a second after the application was ready. At 0.1 s a deployment returned 0.3-1.2 s sooner and
  a deletion 0.2-0.3 s sooner (the 2-core box, 2026-12-03). A look is one small controller call. Considered
  instead: `serve.run(..., _blocking=False)` (also private) and our own poll of `serve.status()`, which would
  drop Serve's own checks of the proxies and of a failed deployment.

* `loopback_only_node()`: `ray._private.ray_constants.ENABLE_RAY_CLUSTER`, whether Ray may use the machine's network
  address. The launcher's own Ray with a loopback `--host` sets it off (and `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` for
  the processes Ray starts), so the node's address is 127.0.0.1: Ray's metrics export port (Prometheus text with the
  node's address and session name, no authentication) listened on 0.0.0.0, and its gRPC servers on ::, even with
  `--host 127.0.0.1`. Tried instead: `ray.init(_node_ip_address="127.0.0.1")` (also private; Ray replaces a
  loopback address by the machine's) and `_metrics_export_port` (a port only, no address).

* `bind_serve_to_loopback()`: with it, as Ray's `worker_process_setup_hook` in every worker of that instance
  (`loopback_runtime_env`), the `bind` lines of `ray.serve._private.haproxy.HAPROXY_CONFIG_TEMPLATE` for HAProxy's
  stats page and Prometheus frontend, and `ray.serve._private.replica.add_port_to_grpc_server` for each replica's
  inter-deployment gRPC server (`"[::]:0"`), go to 127.0.0.1: Ray binds these on every interface with no address
  setting (`RAY_SERVE_HAPROXY_STATS_PORT` / `_METRICS_PORT` choose ports only).

* `sync_driver_handles()`: a wrapper around `ray.serve._private.handle_options.InitHandleOptions.create` that
  gives a handle first used from plain Python (no running event loop: Serve initialises a handle at its first
  `.remote()` or `.options()`) outside a replica its own router loop (`_run_router_in_separate_loop=True`, a
  private init option), as in Serve's default mode; a handle first used from async code keeps Serve's choice. With
  `RAY_SERVE_THROUGHPUT_OPTIMIZED=1` in the driver's environment Serve runs the router on the caller's event loop,
  and `handle.embed.remote(...).result()` from plain Python fails with "RuntimeError: No event loop running. You
  cannot use a handle initialized with `_run_router_in_separate_loop=False` when not inside an asyncio event loop"
  (measured on CPU, 2026-12-05). `build_app` installs it in the process that builds the application; replicas
  (the ingress's handle to the encoders) keep the caller's loop. Tried instead:
  `RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=1` in the driver's environment, which Serve reads once, when `ray.serve`
  is first imported (usually before ours), and which every Ray process the driver starts would inherit (the
  ingress replicas' routers too).

* `start_serve(...)`: `serve.start` less its wait for the proxies: the controller is created
  (`ray.serve._private.api._create_controller_and_proxy_refs`) and made this process's Serve client
  (`ray.serve.context._set_global_client`); the launcher then waits for the proxies' status (public) after
  `serve.run`. `serve.start` waits for the proxies first, so the replicas were created only after
  HAProxy and its proxy actor were up: 10.5 s of the launcher's cold start on the H100 box (2026-12-06), now
  spent while the encoder replica loads and captures. Tried instead: `serve.run` alone (it calls the same
  `serve_start`, which waits) and `serve.start` in a thread beside `serve.run` (two controllers could race). Only on
  boxes of 8 cores or more (`OVERLAP_SERVE_START_CPUS`): Ray starts as many worker processes at once as it has CPUs,
  and on the 2-core CI box the replicas' workers held the proxy's back past the controller's readiness check,
  which then killed and restarted it (a slower start, and its warnings printed).

The fast request path's environment (`FAST_PATH_ENV`, and the HAProxy bounds `PROXY_BOUNDS_ENV`) lives here too: the
names and values are Ray Serve's knobs, read by each Ray process when it starts (`ray.serve._private.constants`), so
no runtime_env can switch them.

One more function here uses no private API but depends on Ray's wording, so it lives beside them:
* `quiet_serve_noise()`: a filter on Serve's public `ray.serve` logger that drops INFO lines of Ray 2.60 that
  tell a user of this service nothing: `Started <ray.serve._private.router.SharedRouterLongPollClient object at
  0x...>.`, logged by a process when its first handle starts a router (every ingress replica, at start-up),
  serve.run's `Connecting to existing Serve app in namespace "serve". New http_options/controller_options will
  not be applied.`, logged by the launcher after its own `serve.start`, which did apply them, and an ingress
  replica's three lines on the fast path about the HTTP port it allocated and started (HAProxy sends to it).
  Every other record of the logger, this service's own lines among them, passes. If Ray rewords a line, it
  shows again (the shutdown tests look for the first two, test_proxy_limits.py and test_default_path_limits.py for the
  others).
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import importlib.util
import inspect
import logging
import os
import threading
import uuid
from functools import cache
from typing import TYPE_CHECKING

import ray
from ray._private import ray_constants

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle
    from ray.serve.request_router import RequestRouter

logger = logging.getLogger("ray.serve")

TESTED_RAY = ((2, 60), (2, 61))  # [low, high) of (major, minor): what pyproject.toml pins
OVERLAP_SERVE_START_CPUS = 8  # `start_serve`: fewer cores, and the launcher waits for the proxies first
QUICK_POLL_S = 0.1  # Serve's client waits between looks at the controller (its default: 1.0)
# the module (and so the logger name) that announces token authentication at a local start
TOKEN_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
TOKEN_AUTH_NOTICE = "Token authentication is enabled for this Ray cluster"
# the beginnings of the two Serve INFO lines `quiet_serve_noise` drops (Ray 2.60's wording)
SERVE_NOISE = (
    "Started <ray.serve._private.router.SharedRouterLongPollClient object at ",
    'Connecting to existing Serve app in namespace "serve". New http_options/controller_options will not be applied',
    # an ingress replica on the fast path (its own HTTP server behind HAProxy) announces it in three lines
    "Allocated port ",
    "Successfully started RequestProtocol.",
    "Started HTTP server on port ",
)
# Serve's controller warns, on the fast path, that an HTTP host of 127.0.0.1 shuts out HAProxy on other nodes: the
# launcher's own Ray has one node (Ray 2.60's wording)
HAPROXY_HOST_WARNING = "won't accept connections from HAProxy on other nodes"
SERVE_SHUTDOWN_NOTICE = "Task ServeController.graceful_shutdown failed."
# Serve's system actors as their log lines name them (`actor_name`), and the levels `quiet_serve_system_info`
# drops from their lines (Serve's text log format: the level first)
SERVE_SYSTEM_ACTORS = frozenset({"ServeController", "ProxyActor"})
QUIET_LEVELS = ("DEBUG ", "INFO ")
LEVELS = (*QUIET_LEVELS, "WARNING ", "ERROR ", "CRITICAL ")


# Ray Serve's fast request path (docs/service.md#fast-request-path): throughput-optimised Serve (handle calls over
# gRPC, user code and routers on the replicas' own loops) with HAProxy in front of the ingress replicas, and a gRPC
# message cap above one batch's arrays (gRPC's 4 MiB default < one embed of 32 224x224 arrays). Every Ray process
# reads them when it starts: the launcher puts them in its environment before `ray.init` (`use_fast_path`).
FAST_PATH_ENV = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(2**28),
}
# what the launcher adds for the Ray instance it starts (on one machine, in the foreground): the replicas' start-up
# lines on its console (throughput mode sends Serve's logs to files only; access logs are off by default, so this
# costs nothing per request), and a 2 s stop of an ingress replica where Serve waits 30 s by default for load
# balancers to notice (HAProxy runs here; the drain of `deployments.shutdown` has already answered everything), and
# 30 s for a new proxy to report ready where Serve's controller waits 5 s: on a 2-core box the proxy's process,
# started beside the replicas', took longer, and the controller printed warnings and restarted it
LAUNCHER_ENV = {
    "RAY_SERVE_LOG_TO_STDERR": "1",
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30",
}
# the serve constant each variable sets, where the two names differ (the start-up check looks for the constant)
SERVE_CONSTANT_OF = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "PROXY_READY_CHECK_TIMEOUT_S"}
# the two switches that make the fast path (the message cap only raises a limit); Serve takes "1" as on
FAST_PATH_SWITCHES = ("RAY_SERVE_THROUGHPUT_OPTIMIZED", "RAY_SERVE_ENABLE_HA_PROXY")
# Serve's variables for the HAProxy it runs on the fast path, by the `AppArgs` field each carries (docs/limits.md):
# Ray 2.60's defaults leave a never-sending connection open for an hour (timeout client 3600 s) and stop accepting at
# 4096 connections, so 20,600 idle sockets blocked every new request. Read when the HAProxy manager actor starts.
PROXY_BOUNDS_ENV = {
    "proxy_max_header_bytes": "RAY_SERVE_HAPROXY_TUNE_BUFSIZE",
    "proxy_idle_timeout_s": "RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S",
    "proxy_max_connections": "RAY_SERVE_HAPROXY_MAXCONN",
}
# Serve's hook for code of ours in its Python HTTP proxy (the default request path, and throughput mode without
# HAProxy): the import path of a function that ProxyActor.__init__ calls (Ray 2.60: `http_util.
# configure_http_middlewares`) before the proxy configures and starts its uvicorn server. Ray builds that server with
# `timeout_keep_alive` as its only limit (`http_util.start_asgi_http_server`), and HTTPOptions has no field for the
# others, so a 256 MiB header took the proxy 58.5 s to parse and connections that never send a byte stayed open until
# it ran out of them; `bound_python_proxy` gives that server the bounds HAProxy has on the fast path. Set only where
# HAProxy is off (the direct-ingress replicas of the fast path call the hook too, behind HAProxy's own bounds).
PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "deployments.ray_compat:bound_python_proxy"
PROXY_FD_RESERVE = 256  # descriptors the proxy keeps beside client connections (Ray's gRPC channels, its logs)
# Ray's switch for a one-node instance on the loopback interface (`ray_constants.ENABLE_RAY_CLUSTER`, off by default
# on macOS and Windows): the node's address becomes 127.0.0.1, so the metrics export port, the agents and every gRPC
# server listen there instead of on 0.0.0.0 / ::
LOOPBACK_NODE_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
FAST_PATH_HINT = "for the fast one start Ray with {} (docs/service.md#fast-request-path)".format(
    " ".join(f"{k}={v}" for k, v in FAST_PATH_ENV.items())
)


class RayCompatError(RuntimeError):
    """The installed Ray lacks a private API this service relies on."""


def _missing() -> list[str]:
    """The private APIs (as `module.name`) the installed Ray does not have."""
    # Serve's modules are imported where used, not at the top: the batch CLI imports this module (for
    # `quiet_token_auth_notice`) and has no other use for Serve (2-3 CPU-s of imports)
    from ray.serve import context as serve_context
    from ray.serve._private import client as serve_client
    from ray.serve._private import common as serve_common
    from ray.serve.handle import DeploymentHandle
    from ray.serve.request_router import RequestRouter

    missing = []
    if not callable(getattr(serve_context, "_get_serve_request_context", None)):
        missing.append("ray.serve.context._get_serve_request_context")
    elif "_internal_request_id" not in {f.name for f in dataclasses.fields(serve_context._RequestContext)}:
        missing.append("ray.serve.context._RequestContext._internal_request_id")
    if not isinstance(getattr(serve_context, "_serve_request_context", None), contextvars.ContextVar):
        missing.append("ray.serve.context._serve_request_context")
    if "_by_reference" not in inspect.signature(DeploymentHandle.options).parameters:
        missing.append("ray.serve.handle.DeploymentHandle.options(_by_reference=...)")
    if not inspect.iscoroutinefunction(getattr(RequestRouter, "_select_from_candidate_replicas", None)):
        missing.append("ray.serve.request_router.RequestRouter._select_from_candidate_replicas")
    fulfill = getattr(RequestRouter, "_fulfill_next_pending_request", None)
    if not callable(fulfill) or list(inspect.signature(fulfill).parameters)[1:3] != ["replica", "request_metadata"]:
        missing.append("ray.serve.request_router.RequestRouter._fulfill_next_pending_request")
    if "_use_replica_queue_len_cache" not in RequestRouter.__init__.__code__.co_names:
        missing.append("ray.serve.request_router.RequestRouter._use_replica_queue_len_cache")
    if not isinstance(getattr(serve_common, "REPLICA_ID_FULL_ID_STR_PREFIX", None), str):
        missing.append("ray.serve._private.common.REPLICA_ID_FULL_ID_STR_PREFIX")
    if not isinstance(getattr(ray_constants, "RAY_DISABLE_FAILURE_SIGNAL_HANDLER", None), bool):
        missing.append("ray._private.ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER")
    if importlib.util.find_spec(TOKEN_AUTH_LOGGER) is None:
        missing.append(TOKEN_AUTH_LOGGER)
    from ray.serve._private import constants as serve_constants
    from ray.serve._private import handle_options

    flags = {**FAST_PATH_ENV, **LAUNCHER_ENV, **{k: "" for k in PROXY_BOUNDS_ENV.values()}, PROXY_CALLBACK_ENV: ""}
    constants = [SERVE_CONSTANT_OF.get(k, k) for k in flags]
    missing += [f"ray.serve._private.constants.{c}" for c in constants if not hasattr(serve_constants, c)]
    options = handle_options.InitHandleOptions
    if not isinstance(options.__dict__.get("create"), classmethod) or "_run_router_in_separate_loop" not in {
        f.name for f in dataclasses.fields(options)
    }:
        missing.append("ray.serve._private.handle_options.InitHandleOptions.create(_run_router_in_separate_loop=...)")
    if not isinstance(getattr(ray_constants, "ENABLE_RAY_CLUSTER", None), bool):
        missing.append("ray._private.ray_constants.ENABLE_RAY_CLUSTER")
    from ray._private import worker as ray_worker

    # the errors the GCS pushes are printed through the module's name (so replacing it takes effect)
    # and so are the worker log lines, through the handler `connect` registers (so a wrapper set before it counts)
    listen, connect = getattr(ray_worker, "listen_error_messages", None), getattr(ray_worker, "connect", None)
    if not callable(getattr(ray_worker, "print_to_stdstream", None)) or not all(
        f is not None and "print_to_stdstream" in inspect.unwrap(f).__code__.co_names for f in (listen, connect)
    ):
        missing.append("ray._private.worker.print_to_stdstream")
    # the client's waits read the module's name when they sleep (so setting it takes effect)
    client = serve_client.ServeControllerClient
    waits = (client._wait_for_application_running, client.delete_apps)
    if not isinstance(getattr(serve_client, "CLIENT_POLLING_INTERVAL_S", None), float) or not all(
        "CLIENT_POLLING_INTERVAL_S" in inspect.unwrap(w).__code__.co_names for w in waits
    ):
        missing.append("ray.serve._private.client.CLIENT_POLLING_INTERVAL_S")
    # the proxy hook (`bound_python_proxy`): read by configure_http_middlewares, and a server built from the
    # module's `uvicorn.Config` with uvicorn's httptools protocol and its callbacks
    from ray.serve._private import http_util
    from uvicorn.protocols.http import httptools_impl

    uses = (http_util.configure_http_middlewares, PROXY_CALLBACK_ENV), (http_util.start_asgi_http_server, "uvicorn")
    if not all(name in inspect.unwrap(f).__code__.co_names for f, name in uses):
        missing.append("ray.serve._private.http_util.start_asgi_http_server(uvicorn.Config)")
    protocol = getattr(httptools_impl, "HttpToolsProtocol", None)
    if protocol is None or not all(
        callable(getattr(protocol, m, None)) for m in ("on_headers_complete", "on_response_complete", "data_received")
    ):
        missing.append("uvicorn.protocols.http.httptools_impl.HttpToolsProtocol")
    # the loopback binds (`bind_serve_to_loopback`): the template's lines, and the replica's gRPC port by name
    from ray.serve._private import haproxy, replica

    template = getattr(haproxy, "HAPROXY_CONFIG_TEMPLATE", "")
    # (in a worker process the hook already ran in, the lines are the rebound ones)
    if not isinstance(template, str) or not all(a in template or b in template for a, b in HAPROXY_ANY_BINDS):
        missing.append("ray.serve._private.haproxy.HAPROXY_CONFIG_TEMPLATE (bind *:stats_port, bind :metrics_port)")
    if not callable(getattr(replica, "add_port_to_grpc_server", None)) or REPLICA_GRPC_ANY not in inspect.getsource(
        replica
    ):
        missing.append('ray.serve._private.replica.add_port_to_grpc_server(server, "[::]:0")')
    # `start_serve`: the controller created without waiting for the proxies, then made the global client
    from ray.serve import context as serve_context
    from ray.serve._private import api as serve_api

    create = getattr(serve_api, "_create_controller_and_proxy_refs", None)
    if not callable(create) or list(inspect.signature(create).parameters)[:6] != [
        "http_options",
        "grpc_options",
        "global_logging_config",
        "global_tracing_config",
        "controller_options",
        "proxy_location",
    ]:
        missing.append("ray.serve._private.api._create_controller_and_proxy_refs")
    if not callable(getattr(serve_api, "_coerce_controller_options", None)):
        missing.append("ray.serve._private.api._coerce_controller_options")
    if not callable(getattr(serve_context, "_set_global_client", None)):
        missing.append("ray.serve.context._set_global_client")
    return missing


def _version() -> tuple[int, int]:
    major, minor, *_ = ray.__version__.split(".")
    return int(major), int(minor)


@cache
def check_ray() -> None:
    """Raise `RayCompatError` naming what is missing when the installed Ray lacks an API above; warn when
    it has them all but lies outside the tested range. Cached: one check per process."""
    (low, high), version = TESTED_RAY, _version()
    missing = _missing()
    tested = f"ray>={low[0]}.{low[1]},<{high[0]}.{high[1]}"
    if missing:
        raise RayCompatError(
            f"ray {ray.__version__} lacks private APIs this service relies on ({', '.join(missing)}); "
            f"install {tested} (deployments/ray_compat.py says why each is needed)"
        )
    if not low <= version < high:
        logger.warning("ray %s is outside the tested range %s; its private APIs are present", ray.__version__, tested)


def call_as_new_request(method, *args, **kwargs):
    """`method.remote(*args, **kwargs)` as a request of its own: the current Serve request context with a
    fresh internal request id (see the module docstring)."""
    return call_with_request_id(new_request_id(), method, *args, **kwargs)


def new_request_id() -> str:
    return str(uuid.uuid4())


def call_with_request_id(request_id: str, method, *args, **kwargs):
    """`call_as_new_request` whose internal request id is `request_id` (from `new_request_id()`): the id the
    router's `on_request_assigned` sees."""

    from ray.serve import context as serve_context

    def call():
        current = serve_context._get_serve_request_context()
        own = dataclasses.replace(current, _internal_request_id=request_id)
        serve_context._serve_request_context.set(own)
        return method.remote(*args, **kwargs)

    return contextvars.copy_context().run(call)


def by_reference(handle: DeploymentHandle) -> DeploymentHandle:
    """The handle sending its arguments through the object store (see the module docstring)."""
    return handle.options(_by_reference=True)


def queue_len_cache_enabled(router: RequestRouter) -> bool:
    """Whether Ray keeps the router's queue-length cache (on unless RAY_SERVE disables it)."""
    return router._use_replica_queue_len_cache


class SelectionHook:
    """Mixin for a `RequestRouter` subclass (list it first): `on_replica_selected(replica)` runs right after
    Ray picked the replica for a request, before Ray's routing task sends anything; `on_request_assigned(replica,
    internal_request_id)` once that pick is handed to the request."""

    async def _select_from_candidate_replicas(self, candidates, backoff_index: int):
        replica = await super()._select_from_candidate_replicas(candidates, backoff_index)
        if replica is not None:
            self.on_replica_selected(replica)
        return replica

    def on_replica_selected(self, replica) -> None:
        """Ray chose `replica` for a pending request."""

    def _fulfill_next_pending_request(self, replica, request_metadata=None):
        super()._fulfill_next_pending_request(replica, request_metadata)
        if request_metadata is not None:
            self.on_request_assigned(replica, request_metadata.internal_request_id)

    def on_request_assigned(self, replica, internal_request_id: str) -> None:
        """Ray handed `replica` to the pending request of that id (it is sent next, unless it was cancelled)."""


def live_replica_count(app_name: str, deployment: str) -> int:
    """Replica actors of `deployment` in `app_name` that are not dead (the GCS drops a dead actor's name)."""
    from ray.serve._private import common as serve_common

    prefix = f"{serve_common.REPLICA_ID_FULL_ID_STR_PREFIX}{app_name}#{deployment}#"
    return sum(1 for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix))


def no_driver_stack_dump() -> None:
    """Keep absl's failure-signal handler out of this process's Ray driver (see the module docstring): call
    before `ray.init`. Its own crash handling stays Python's; Ray's other processes keep theirs."""
    ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True


def _filter_once(logger_name: str, keep) -> None:
    """Add the filter `keep` to a logger unless it is there already (the quiet_* calls are idempotent)."""
    target = logging.getLogger(logger_name)
    if keep not in target.filters:
        target.addFilter(keep)


def _not_the_token_auth_notice(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(TOKEN_AUTH_NOTICE)


def quiet_token_auth_notice() -> None:
    """Drop Ray's "token authentication is enabled" notice from this process's log (see the module docstring):
    call before `ray.init`. Idempotent; every other record of that logger passes."""
    _filter_once(TOKEN_AUTH_LOGGER, _not_the_token_auth_notice)


def _not_serve_noise(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(SERVE_NOISE)


def quiet_serve_noise() -> None:
    """Drop Serve's router-repr and "will not be applied" INFO lines from this process's `ray.serve` logger (see
    the module docstring). Idempotent; every other record passes."""
    _filter_once("ray.serve", _not_serve_noise)


def is_serve_shutdown_notice(data: dict) -> bool:
    """Whether a batch of lines the GCS pushed to this driver is only Serve's own-kill notice (see the module
    docstring)."""
    lines = data.get("lines") or []
    return (
        data.get("pid") == "raylet"
        and bool(lines)
        and all(line.startswith(SERVE_SHUTDOWN_NOTICE) and "killed by `ray.kill`" in line for line in lines)
    )


def _print_only(marker: str, keep) -> None:
    """Wrap what this driver prints of the lines other processes send it (`print_to_stdstream`) so that it prints
    `keep(batch)` (the batch, or a copy with fewer lines), or nothing when that is None. Once per `marker`: the
    quiet_* calls are idempotent, and each wrapper calls the one installed before it. Call before `ray.init`,
    which registers the worker log handler."""
    from ray._private import worker as ray_worker

    printer = ray_worker.print_to_stdstream
    markers = getattr(printer, "quiet_markers", ())
    if marker in markers:
        return

    def print_to_stdstream(data, ignore_prefix):
        kept = keep(data)
        if kept is not None:
            printer(kept, ignore_prefix)

    print_to_stdstream.quiet_markers = (*markers, marker)
    print_to_stdstream.__wrapped__ = printer  # the chain down to Ray's own (tests start from it)
    ray_worker.print_to_stdstream = print_to_stdstream


def quiet_serve_shutdown_notice() -> None:
    """Drop the notice that Serve's controller "failed" when `serve.shutdown()` ends it (see the module
    docstring) from what this driver prints. Idempotent; every other line passes."""
    _print_only("serve_shutdown_notice", lambda data: None if is_serve_shutdown_notice(data) else data)


def without_serve_system_info(data: dict) -> dict | None:
    """A batch of log lines sent to this driver without the DEBUG and INFO lines of Serve's controller and proxy
    actors (None when nothing is left); any other actor's batch unchanged."""
    if data.get("actor_name") not in SERVE_SYSTEM_ACTORS:
        return data
    lines = data.get("lines") or []
    kept, dropping = [], False
    for line in lines:  # a record's further lines (the controller's multi-line INFO) go with it
        if line.startswith(LEVELS):
            dropping = line.startswith(QUIET_LEVELS)
        if not dropping:
            kept.append(line)
    if not kept:
        return None
    return data if len(kept) == len(lines) else {**data, "lines": kept}


def without_single_node_warning(data: dict) -> dict | None:
    """A batch of log lines without the controller's warning that HAProxy on other nodes cannot reach the replicas
    (`HAPROXY_HOST_WARNING`); every other line unchanged."""
    lines = data.get("lines") or []
    if data.get("actor_name") != "ServeController" or not any(HAPROXY_HOST_WARNING in line for line in lines):
        return data
    kept = [line for line in lines if HAPROXY_HOST_WARNING not in line]
    return {**data, "lines": kept} if kept else None


def quiet_single_node_warning() -> None:
    """Drop the controller's "HAProxy on other nodes" warning from what this driver prints: for the launcher's own
    Ray, which has one node. Idempotent; every other line passes."""
    _print_only("single_node_warning", without_single_node_warning)


# Ray 2.60's HAProxy manager reports HAProxy's stats every few seconds; when that report falls between HAProxy's
# stop and the manager's own, it logs these two errors with a traceback (a race of the stop, nothing lost)
HAPROXY_STOP_RACE = ("Failed to get HAProxy stats", "Unexpected error reporting HAProxy node metrics")
_serve_stopping = threading.Event()


def serve_stopping() -> None:
    """Tell this driver's log filter (`quiet_haproxy_stop_race`) that the service is stopping."""
    _serve_stopping.set()


def without_haproxy_stop_race(data: dict) -> dict | None:
    """Once `serve_stopping()` was called, a batch of log lines without the HAProxy manager's records (a record:
    a level line and the lines that continue it, its traceback) that report HAProxy's stats socket gone
    (`HAPROXY_STOP_RACE`); before that, and for any other actor, the batch unchanged."""
    if not _serve_stopping.is_set() or data.get("actor_name") != "HAProxyManager":
        return data
    lines = data.get("lines") or []
    kept, dropping = [], False
    for line in lines:
        if line.startswith(LEVELS):
            dropping = any(marker in line for marker in HAPROXY_STOP_RACE)
        if not dropping:
            kept.append(line)
    if not kept:
        return None
    return data if len(kept) == len(lines) else {**data, "lines": kept}


def quiet_haproxy_stop_race() -> None:
    """Drop the HAProxy manager's stats errors of the stop from what this driver prints (`without_haproxy_stop_race`).
    Idempotent; every other line passes."""
    _print_only("haproxy_stop_race", without_haproxy_stop_race)


def quiet_serve_system_info() -> None:
    """Print Serve's controller and proxy lines at WARNING and above only (see the module docstring): for `serve
    run`'s driver, before it connects. Idempotent; every other process's lines pass."""
    _print_only("serve_system_info", without_serve_system_info)


def start_serve(http_options, logging_config, proxy_location) -> None:
    """`serve.start(http_options=..., logging_config=..., proxy_location=...)` without its wait for the proxies
    (see the module docstring); `wait_for_proxies` waits for them once `serve.run` has started the replicas."""
    from ray.serve import context as serve_context
    from ray.serve._private import api as serve_api
    from ray.serve._private.client import ServeControllerClient

    controller, proxy_refs = serve_api._create_controller_and_proxy_refs(
        http_options, None, logging_config, None, serve_api._coerce_controller_options(None), proxy_location
    )
    del proxy_refs  # the controller may replace a proxy slow to start: `wait_for_proxies` asks for their status
    serve_context._set_global_client(ServeControllerClient(controller))


def wait_for_proxies(poll_s: float = 0.1) -> None:
    """What `serve.start` waits for: every proxy Serve runs HEALTHY (`serve.status()`), within Serve's own
    limit (TimeoutError past it). By status, not by the first proxy's readiness ref: the controller replaces a
    proxy that is slow to come up, and the replacement is the one that serves."""
    import time

    from ray import serve
    from ray.serve._private.constants import HTTP_PROXY_TIMEOUT
    from ray.serve.schema import ProxyStatus

    deadline = time.monotonic() + HTTP_PROXY_TIMEOUT
    while True:
        proxies = serve.status().proxies
        if proxies and all(status == ProxyStatus.HEALTHY for status in proxies.values()):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"HTTP proxies not available after {HTTP_PROXY_TIMEOUT}s: {dict(proxies)}")
        time.sleep(poll_s)


def quick_serve_polls() -> None:
    """Have Serve's client in this process look at the controller every `QUICK_POLL_S` while `serve.run` and
    `serve.delete` wait (see the module docstring). Idempotent; changes nothing else."""
    from ray.serve._private import client as serve_client

    serve_client.CLIENT_POLLING_INTERVAL_S = QUICK_POLL_S


def use_fast_path(environ: dict | None = None) -> dict[str, str]:
    """Put `FAST_PATH_ENV` and `LAUNCHER_ENV` into `environ` (default `os.environ`) where the user has not set a
    variable (a value the user exported wins), before `ray.init` starts Ray's processes, which inherit it, and
    before this process imports Ray Serve (its driver then agrees with them); and HAProxy's side ports where a
    default one is taken (`haproxy_side_ports`). Returns what it set."""
    environ = os.environ if environ is None else environ
    added = {k: v for k, v in {**FAST_PATH_ENV, **LAUNCHER_ENV}.items() if k not in environ}
    added |= {k: v for k, v in haproxy_side_ports().items() if k not in environ}
    environ.update(added)
    return added


# Serve's HAProxy also listens on two fixed ports of every interface, its Prometheus endpoint and its stats page
# (Ray 2.60: `RAY_SERVE_HAPROXY_METRICS_PORT`, `RAY_SERVE_HAPROXY_STATS_PORT`, read when the HAProxy manager starts)
HAPROXY_SIDE_PORTS = {"RAY_SERVE_HAPROXY_METRICS_PORT": 9101, "RAY_SERVE_HAPROXY_STATS_PORT": 8404}


def haproxy_side_ports() -> dict[str, str]:
    """A free port for each of HAProxy's side listeners whose default port something already listens on: with the
    defaults a second fast-path service on this machine (another launcher, a test run) could not start HAProxy
    ("Address already in use") and failed its start-up. Free defaults are kept (what a Prometheus scrape expects)."""
    import socket

    def listened(port: int) -> bool:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME-WAIT leftovers do not count
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                return True
        return False

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("0.0.0.0", 0))
            return s.getsockname()[1]

    return {name: str(free_port()) for name, port in HAPROXY_SIDE_PORTS.items() if listened(port)}


def request_path(environ: dict | None = None) -> str:
    """The request path Serve takes in a process with `environ` (default `os.environ`; a replica's is its node's
    Ray environment): "fast" with throughput mode and HAProxy, "throughput-optimised" with throughput mode
    behind Serve's Python proxy, "haproxy" with HAProxy alone, "default" otherwise."""
    environ = os.environ if environ is None else environ
    throughput, haproxy = (environ.get(k) == "1" for k in FAST_PATH_SWITCHES)
    if throughput and haproxy:
        return "fast"
    if haproxy:
        return "haproxy"
    return "throughput-optimised" if throughput else "default"


def describe_request_path(environ: dict | None = None, hint: str = FAST_PATH_HINT) -> str:
    """`request path fast (HAProxy, gRPC)`, or the slower path and how to switch (`hint`, one short line)."""
    path = request_path(environ)
    if path == "fast":
        return "request path fast (HAProxy, gRPC)"
    what = {
        "throughput-optimised": "Serve's Python proxy, gRPC",
        "haproxy": "HAProxy, actor calls",
        "default": "Serve's Python proxy, actor calls",
    }[path]
    return f"request path {path} ({what}); {hint}"


def in_event_loop() -> bool:
    """Whether this thread runs an asyncio event loop now."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def sync_driver_handles() -> None:
    """Give the handles this process first uses from plain Python (no running event loop) outside a replica a
    router loop of their own, so that `.result()` works in throughput mode too (see the module docstring).
    Idempotent; a handle first used from async code keeps Serve's choice, and so do handles made inside a replica
    and an explicit `_run_router_in_separate_loop`."""
    from ray.serve import context as serve_context
    from ray.serve._private.handle_options import InitHandleOptions
    from ray.serve._private.utils import DEFAULT

    create = InitHandleOptions.__dict__["create"].__func__
    if getattr(create, "sync_driver", False):
        return

    def create_with_own_loop(cls, **kwargs):
        key = "_run_router_in_separate_loop"
        unset = kwargs.get(key, DEFAULT.VALUE) == DEFAULT.VALUE
        if unset and serve_context._get_internal_replica_context() is None and not in_event_loop():
            kwargs[key] = True
        return create(cls, **kwargs)

    create_with_own_loop.sync_driver = True
    InitHandleOptions.create = classmethod(create_with_own_loop)


def default_max_connections() -> int:
    """The connection cap HAProxy can hold under this process's open-file hard limit (its children inherit it):
    HAProxy wants about 2.5 descriptors per connection (maxconn 65536 asked for 163,876) and, unable to raise its
    limit that far, refuses to start (measured with a hard limit of 20,000: "Cannot raise FD limit"). At most 65536."""
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY:
        return 65536
    return max(16, min(65536, (hard - 1024) * 2 // 5))


def proxy_bounds_env(args) -> dict[str, str]:
    """Serve's HAProxy variables for the fast path's front bounds of `args` (an `AppArgs`: see `PROXY_BOUNDS_ENV`)."""
    values = {field: getattr(args, field) for field in PROXY_BOUNDS_ENV}
    if values["proxy_max_connections"] is None:
        values["proxy_max_connections"] = default_max_connections()
    return {env: str(values[field]) for field, env in PROXY_BOUNDS_ENV.items()}


def use_proxy_bounds(args, environ: dict | None = None) -> dict[str, str]:
    """Put `proxy_bounds_env(args)` into `environ` (default `os.environ`) where the user has not set a variable, for a
    Ray instance not started yet, whose HAProxy manager reads them when it starts. Returns what it set."""
    environ = os.environ if environ is None else environ
    wanted = proxy_bounds_env(args)
    if environ.get("RAY_SERVE_ENABLE_HA_PROXY") != "1":  # Serve's Python proxy faces the clients: bound it too
        wanted[PROXY_CALLBACK_ENV] = PROXY_CALLBACK
    added = {k: v for k, v in wanted.items() if k not in environ}
    environ.update(added)
    return added


def python_proxy_limits(environ: dict | None = None) -> tuple[int, float, int]:
    """(header bytes, idle seconds, connections) for Serve's Python proxy, from the HAProxy variables of
    `PROXY_BOUNDS_ENV` in `environ` (default `os.environ`: the proxy's, which Ray started with the launcher's), so
    that one set of `AppArgs` bounds both request paths; AppArgs' defaults where a variable is missing."""
    environ = os.environ if environ is None else environ
    header = int(environ.get(PROXY_BOUNDS_ENV["proxy_max_header_bytes"], 16384))
    idle = float(environ.get(PROXY_BOUNDS_ENV["proxy_idle_timeout_s"], 10))
    connections = environ.get(PROXY_BOUNDS_ENV["proxy_max_connections"])
    return header, idle, int(connections) if connections else default_max_connections()


def _open_file_budget(wanted: int) -> int:
    """The connection cap this process can hold: its open-file soft limit raised to the hard one (a proxy that runs
    out of descriptors stops accepting, and every new request waits), less `PROXY_FD_RESERVE`; at most `wanted`."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):  # kept as it is: the cap below follows it
            pass
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(16, min(wanted, soft - PROXY_FD_RESERVE))


def bounded_http_protocol(max_header_bytes: int, idle_timeout_s: float, max_connections: int):
    """uvicorn's httptools protocol (what Serve's proxy uses) with the fast path's front bounds, as a class to pass
    as `uvicorn.Config(http=...)`:

    * a request line and headers over `max_header_bytes` are answered 431 and the connection closed as soon as
      that many bytes have come without the head ending (httptools has no cap: it took in all 256 MiB);
    * a connection that has not sent a whole request head `idle_timeout_s` after it opened or after its last
      response is closed (408 if part of a head came); uvicorn only times out keep-alive connections that send
      nothing, so one that never sends a byte, or one a minute, was kept for ever;
    * past `max_connections` a new connection closes the one that has waited longest for a request head, or is
      answered 503 when none waits: a flood of idle connections cannot shut new requests out, it only shortens
      the time an idle one is kept (uvicorn's `limit_concurrency` answers 503 to every new request instead).
    """
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    waiting: dict = {}  # the connections waiting for a request head, longest first (insertion order)

    def refuse(transport, status: bytes) -> None:
        transport.write(b"HTTP/1.1 " + status + b"\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
        transport.close()

    class BoundedHttpToolsProtocol(HttpToolsProtocol):
        head_timer = None  # set while a request head is awaited
        head_bytes = 0

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                if not waiting:  # every connection is in a request: this one waits nowhere
                    refuse(transport, b"503 Service Unavailable")
                    return
                oldest = next(iter(waiting))
                oldest.head_done()
                oldest.transport.close()
            self.await_head()

        def await_head(self) -> None:
            self.head_bytes = 0
            waiting[self] = None
            self.head_timer = self.loop.call_later(idle_timeout_s, self.head_timed_out)

        def head_done(self) -> None:
            waiting.pop(self, None)
            if self.head_timer is not None:
                self.head_timer.cancel()
                self.head_timer = None

        def head_timed_out(self) -> None:
            self.head_done()
            if self.transport.is_closing():
                return
            if self.head_bytes:
                refuse(self.transport, b"408 Request Timeout")
            else:
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self.head_timer is None:
                super().data_received(data)
                return
            self.head_bytes += len(data)
            super().data_received(data)  # the head may end in `data`: on_headers_complete stops the count
            if self.head_timer is not None and self.head_bytes > max_header_bytes:
                self.head_done()
                if not self.transport.is_closing():
                    refuse(self.transport, b"431 Request Header Fields Too Large")

        def on_headers_complete(self) -> None:
            self.head_done()
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            # uvicorn arms its keep-alive timer when the connection is idle, waiting for the next request
            if self.timeout_keep_alive_task is not None and not self.transport.is_closing():
                self.await_head()

        def connection_lost(self, exc) -> None:
            self.head_done()
            super().connection_lost(exc)

    return BoundedHttpToolsProtocol


class _UvicornWithBounds:
    """Stands for the `uvicorn` module in Serve's `http_util`: its `Config` gets our protocol class."""

    def __init__(self, uvicorn, protocol) -> None:
        self._uvicorn, self._protocol = uvicorn, protocol

    def __getattr__(self, name: str):
        return getattr(self._uvicorn, name)

    def Config(self, *args, **kwargs):  # noqa: N802 (uvicorn's name)
        return self._uvicorn.Config(*args, **{**kwargs, "http": self._protocol})


def bound_python_proxy() -> list:
    """Serve's HTTP proxy callback (`PROXY_CALLBACK`, run by `ProxyActor.__init__` before its server starts): bound
    the proxy's uvicorn server with `python_proxy_limits` (`bounded_http_protocol`). Returns no middleware. A
    direct-ingress replica (throughput mode) calls it too and is left as it is. Raises where Serve's code is not
    the one this relies on (`check_ray` checks it), so the proxy does not start unbounded."""
    import uvicorn
    from ray.serve._private import http_util
    from ray.serve._private.constants import SERVE_PROXY_NAME

    if not (ray.get_runtime_context().get_actor_name() or "").startswith(SERVE_PROXY_NAME):
        return []
    header, idle, connections = python_proxy_limits()
    connections = _open_file_budget(connections)
    if "uvicorn" not in http_util.start_asgi_http_server.__code__.co_names or http_util.uvicorn not in (
        uvicorn,
        getattr(http_util.uvicorn, "_uvicorn", None),
    ):
        raise RayCompatError("ray.serve._private.http_util.start_asgi_http_server no longer builds uvicorn.Config")
    http_util.uvicorn = _UvicornWithBounds(uvicorn, bounded_http_protocol(header, idle, connections))
    logger.info("HTTP proxy bounds: %d header bytes, %gs idle, %d connections", header, idle, connections)
    return []


def is_loopback(host: str) -> bool:
    """Whether an HTTP host given to the launcher is a loopback address (only this machine can connect)."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# Where Ray 2.60 binds every interface with no setting to choose: HAProxy's stats page and Prometheus frontend
# (`bind *:PORT` and `bind :PORT` in its config template) and each replica's inter-deployment gRPC server
# (`add_port_to_grpc_server(server, "[::]:0")` in replica.py). `bind_serve_to_loopback` rebinds them to 127.0.0.1.
HAPROXY_ANY_BINDS = (
    ("bind *:{{ config.stats_port }}", "bind 127.0.0.1:{{ config.stats_port }}"),
    ("bind :{{ config.metrics_port }}", "bind 127.0.0.1:{{ config.metrics_port }}"),
)
REPLICA_GRPC_ANY = "[::]:0"
LOOPBACK_BINDS_HOOK = "deployments.ray_compat.bind_serve_to_loopback"


def bind_serve_to_loopback() -> None:
    """Ray's `worker_process_setup_hook` for the launcher's loopback-only instance (`loopback_runtime_env`): in each
    of its worker processes (the Serve controller, the HAProxy manager, the replicas) HAProxy's stats and metrics
    frontends and the replica's gRPC server listen on 127.0.0.1 instead of every interface. Ray offers no address
    setting for them (Ray 2.60: `haproxy_templates.py`, `replica.py`); on a one-node instance on 127.0.0.1 every
    peer that connects to them is on this machine. Tried instead: `RAY_SERVE_HAPROXY_STATS_PORT` /
    `RAY_SERVE_HAPROXY_METRICS_PORT` (ports only) and the proxy callback (`PROXY_CALLBACK_ENV`, read by the
    Python proxy, which the fast path does not run)."""
    from ray.serve._private import haproxy, replica

    template = haproxy.HAPROXY_CONFIG_TEMPLATE
    for anywhere, loopback in HAPROXY_ANY_BINDS:
        template = template.replace(anywhere, loopback)
    haproxy.HAPROXY_CONFIG_TEMPLATE = template
    add_port = replica.add_port_to_grpc_server
    if getattr(add_port, "loopback", False):  # a second call in the same process
        return

    def add_loopback_port(server, address: str) -> int:
        return add_port(server, "127.0.0.1:0" if address == REPLICA_GRPC_ANY else address)

    add_loopback_port.loopback = True
    replica.add_port_to_grpc_server = add_loopback_port


def loopback_runtime_env() -> dict:
    """The `runtime_env` for `ray.init` of a loopback-only instance: `bind_serve_to_loopback` in every worker."""
    return {"worker_process_setup_hook": LOOPBACK_BINDS_HOOK}


def loopback_only_node() -> None:
    """Make the Ray instance this process is about to start a one-node instance on 127.0.0.1 (`LOOPBACK_NODE_ENV`):
    call before `ray.init`. `ray.init(_node_ip_address="127.0.0.1")` does not do it (Ray replaces a loopback address
    by the machine's), and `ray_constants` was read when this process imported Ray, so the constant is set here and
    the variable for the processes Ray starts. Their metrics port then listens on 127.0.0.1, not 0.0.0.0."""
    os.environ.update(LOOPBACK_NODE_ENV)
    ray_constants.ENABLE_RAY_CLUSTER = False
