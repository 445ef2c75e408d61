"""`build_app(args)`: the Serve application (ingress -> encoder replicas). Not named `app.py`: a submodule
of that name would shadow the `deployments.app` attribute that `serve run deployments:app` reads."""

from __future__ import annotations

import logging

import ray
from pydantic import ValidationError
from ray.serve.config import BackpressureConfig, RequestRouterConfig
from ray.serve.schema import LoggingConfig

from deployments.config import ENCODER_NAME, INGRESS_NAME, AppArgs, resolve_num_gpus
from deployments.ingress.deployment import VisionIngress
from deployments.preflight import AppConfigError, check_encoder_options, check_model, ray_address
from deployments.ray_compat import (
    check_ray,
    describe_request_path,
    quick_serve_polls,
    sync_driver_handles,
    use_proxy_bounds,
)
from deployments.replica.deployment import EncoderReplica
from deployments.shutdown import in_serve_run, install_signal_drain
from encoder.errors import RandomWeightsWarning, reason, validation_reason

logger = logging.getLogger("ray.serve")


def check_router_kwargs(routing: RequestRouterConfig, kwargs: dict) -> None:
    """A router class that can check its `request_router_kwargs` (a static `check_kwargs(kwargs)`, as
    `router.BucketRouter` has) checks them here; AppConfigError names the bad one."""
    check = getattr(routing.get_request_router_class(), "check_kwargs", None)
    if check is None:
        return
    try:
        check(dict(kwargs))
    except ValidationError as exc:
        raise AppConfigError(f"request_router_kwargs: {validation_reason(exc)}") from None
    except (ValueError, TypeError) as exc:  # a bad `buckets` spec (workspace.buckets.BucketError)
        raise AppConfigError(f"request_router_kwargs: {reason(exc)}") from None


def build_app(args: dict | AppArgs | None = None):
    """The application: `VisionIngress` (CPU, HTTP + `embed`) bound to `EncoderReplica`s.

    `args`: an `AppArgs` or a dict of its fields (strings from the Serve CLI are coerced).
    `serve run deployments:build_app model=tiny num_replicas=2`.

    Bad arguments or a model that cannot be loaded raise `preflight.AppConfigError` (one line) here, before
    any replica starts. With Ray connected (`serve deploy` builds the app in the controller) the replicas
    may run on other nodes, so a checkpoint directory needs only its config.json here.
    """
    check_ray()
    quick_serve_polls()  # `serve.run` of this app in this process answers within 0.1 s of it being RUNNING
    sync_driver_handles()  # `handle.embed.remote(...).result()` from this process works in throughput mode too
    try:
        a = args if isinstance(args, AppArgs) else AppArgs.model_validate(dict(args or {}))
    except ValidationError as exc:
        raise AppConfigError(f"invalid application arguments: {validation_reason(exc)}") from None
    source = check_model(a.model, weights_elsewhere=ray.is_initialized())
    check_encoder_options(source.config, a.buckets, a.dtype, a.attention, a.bucket_max_images)
    gpus = resolve_num_gpus(a)
    # Replicas re-derive the device from the same args, so pin the GPU decision made here; and the served name,
    # which for a checkpoint directory depends on the directory being where the ingress runs.
    a = a.model_copy(update={"num_gpus": gpus, "served_model_name": a.model_name})
    plain = a.model_dump(mode="json")
    # Serve logs two INFO lines per request (proxy/ingress and encoder) unless access logs are off
    logging_config = LoggingConfig(enable_access_log=a.access_log)
    router = {}
    if a.request_router_class:
        router["request_router_class"] = a.request_router_class
        router["request_router_kwargs"] = dict(a.request_router_kwargs)
    try:  # imports the router class: a bad path fails here, in one line
        routing = RequestRouterConfig(request_routing_stats_period_s=a.routing_stats_period_s, **router)
    except (ImportError, AttributeError, TypeError, ValueError) as exc:
        raise AppConfigError(f"request_router_class {a.request_router_class!r}: {reason(exc)}") from None
    check_router_kwargs(routing, a.request_router_kwargs)
    encoder = EncoderReplica.options(
        name=ENCODER_NAME,
        num_replicas=a.num_replicas,
        max_ongoing_requests=a.max_ongoing_requests,
        max_queued_requests=a.max_queued_requests,
        ray_actor_options={"num_cpus": a.num_cpus, "num_gpus": gpus},
        request_router_config=routing,
        health_check_period_s=a.health_check_period_s,
        health_check_timeout_s=a.health_check_timeout_s,
        graceful_shutdown_wait_loop_s=a.graceful_shutdown_wait_loop_s,
        graceful_shutdown_timeout_s=a.graceful_shutdown_timeout_s,
        logging_config=logging_config,
    )
    # The ingress admits `inflight_limit` requests and answers the rest 429 itself (OpenAI error body,
    # Retry-After); requests beyond its max_ongoing_requests queue at the proxy, and beyond
    # ingress_max_queued_requests the proxy answers 503 with Retry-After.
    ingress = VisionIngress.options(
        name=INGRESS_NAME,
        num_replicas=a.ingress_replicas,
        max_ongoing_requests=a.ingress_max_ongoing_requests,
        max_queued_requests=a.ingress_max_queued_requests,
        backpressure_config=BackpressureConfig(status_code=503, retry_after_s=a.retry_after_s),
        ray_actor_options={"num_cpus": a.ingress_num_cpus},
        graceful_shutdown_wait_loop_s=a.graceful_shutdown_wait_loop_s,
        graceful_shutdown_timeout_s=a.graceful_shutdown_timeout_s,
        logging_config=logging_config,
    )
    if in_serve_run():  # Ctrl-C / SIGTERM of `serve run`: drain first (Serve's shutdown drops in-flight requests)
        install_signal_drain(a.request_timeout_s, a.drain_grace_s)
    # a Ray instance not started yet (`serve run`, the launcher, a pipeline) will inherit this environment, so it
    # names the request path; on a running cluster the ingress replicas' line says it
    starts_ray = not ray.is_initialized() and ray_address(None) == "local"
    path = f", {describe_request_path()}" if starts_ray else ""
    if starts_ray:  # the HAProxy of the fast path, when Ray starts it, bounds headers, idle clients and connections
        use_proxy_bounds(a)
    logger.info(
        "vision app: model=%s (%s%s), %d encoder replica(s) x %g GPU / %g CPU, %d ingress replica(s), router=%s%s",
        a.model, source.kind, ", RANDOM weights" if source.random_weights else "", a.num_replicas, gpus,
        a.num_cpus, a.ingress_replicas, a.request_router_class or "default", path,
    )  # fmt: skip
    if source.random_weights:  # said here, once, as one line; the replicas keep quiet about it (EncoderReplica)
        logger.warning(RandomWeightsWarning.message(a.model))
    return ingress.bind(encoder.bind(plain), plain)
