"""The groups of `AppArgs` (`deployments.config`): one pydantic model per concern, each with its validators.

`AppArgs` is all of them (flat keys: `serve run deployments:build_app num_replicas=2`, the YAML's `args`), and
code that needs one concern can take the group it reads.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from encoder.loading.presets import PRESETS
from encoder.preprocessing.images import DEFAULT_FORMATS
from workspace.buckets import BucketError, BucketTable
from workspace.tables import DEVICE_DEFAULTS

_CPU = DEVICE_DEFAULTS["cpu"]
# Pillow formats the ingress decodes by default: the encoder's
DEFAULT_IMAGE_FORMATS = tuple(sorted(DEFAULT_FORMATS))
API_KEY_ENV = "VISION_API_KEY"
_CONFIG = ConfigDict(extra="forbid", frozen=True)


def _queue_limit(v: int) -> int:
    """Serve's queue limits: -1 (no limit) or positive; 0 would refuse everything."""
    if v == 0:
        raise ValueError("a queue limit is -1 (no limit) or positive")
    return v


def api_key_problem(key: str) -> str | None:
    """Why `key` cannot be an API key, or None. HTTP carries header values as bytes that Starlette reads as
    latin-1, so a key outside printable ASCII could never match what a client sends; a space would split it
    from the 'Bearer' scheme (RFC 6750's tokens are printable ASCII too)."""
    if not key or any(not ("!" <= ch <= "~") for ch in key):
        return "api_key must be printable ASCII with no spaces (what an 'Authorization: Bearer <key>' header carries)"
    return None


class ModelArgs(BaseModel):
    """The model and how it is loaded."""

    model_config = _CONFIG

    model: str = Field(
        "tiny",
        description="Preset name (random weights), a local Hugging Face checkpoint dir or a Hub id "
        "org/name[@revision]; checked by build_app before any replica starts.",
    )
    served_model_name: str | None = Field(
        None,
        description="Name in /v1/models and the accepted `model` of requests; default: a checkpoint directory's "
        "name, a Hub id without its @revision, or the preset's name.",
    )
    dtype: str | None = Field(None, description="float32 | bfloat16 | float16; default bf16 on CUDA, fp32 on CPU.")
    attention: str | dict[str, str] | None = Field(
        None,
        description="Attention per layer kind (encoder.load): 'auto' (default: the fastest per kind and graph "
        "shape; sdpa on CPU), one backend name for every layer, or a mapping such as "
        "{full: fa4, window: triton}.",
    )
    seed: int = Field(0, description="Seed of the random weights of a preset (same seed, same model everywhere).")
    device: Literal["auto", "cuda", "cpu"] = Field(
        "auto", description="Replica device; auto = cuda when the replica has a GPU share, else cpu."
    )
    quantization: Literal["fp8"] | None = Field(
        None,
        description="None (default: every GEMM in dtype) or 'fp8': the transformer blocks' linear layers in float8 "
        "e4m3 (per-channel weight scales made at load, per-token activation scales on the device); attention, "
        "norms, patch embedding and mergers stay bfloat16. CUDA GPUs of compute capability 8.9 or newer "
        "(Hopper/Ada), dtype bfloat16; each replica refuses elsewhere (encoder.load).",
    )
    text: bool = Field(
        True,
        description="Serve texts where the model has a text tower with its tokenizer (CLIP, SigLIP2). False: images "
        "only: replicas load no text weights and capture no text graphs, text requests are answered 400 "
        "text_not_supported, /v1/models lists no 'text' in input_types.",
    )

    @model_validator(mode="after")
    def _check_quantization(self) -> ModelArgs:
        # what the arguments alone rule out, said before any replica starts; the GPU's generation is checked
        # where the GPU is (encoder.load in each replica)
        if self.quantization is not None:
            if self.device == "cpu":
                raise ValueError(f"quantization {self.quantization!r} needs a CUDA GPU; device is 'cpu'")
            if self.dtype not in (None, "bfloat16", "bf16"):
                raise ValueError(
                    f"quantization {self.quantization!r} runs with dtype bfloat16 only, not {self.dtype!r}"
                )
        return self

    @property
    def model_name(self) -> str:
        """The name clients see (`/v1/models`, `model` of responses): `served_model_name`, else a checkpoint
        directory's name, a Hub id without its `@revision`, or the preset's name. `build_app` pins it, so that
        replicas on nodes without the directory serve the same name."""
        if self.served_model_name:
            return self.served_model_name
        if os.path.isdir(self.model):
            return os.path.basename(os.path.normpath(self.model))
        from encoder.loading.hub import parse_hub_id  # huggingface_hub: only where the name is not pinned yet

        return (parse_hub_id(self.model) or (self.model,))[0]

    @property
    def random_weights(self) -> bool:
        """A preset: seeded random weights (`encoder.loading.hub.resolve_model` tries preset names first)."""
        return self.model in PRESETS


class BucketArgs(BaseModel):
    """The encoder replicas' bucket table (`workspace.tables`)."""

    model_config = _CONFIG

    buckets: str | None = Field(
        None,
        description="Bucket budgets, '256,1024,4096' or 'pow2:256-32768'. Default on CUDA: one 224x224 image's "
        "patches (256; 196 at patch 16) times the powers of two up to 32768 (workspace.tables), "
        f"{_CPU.buckets!r} on CPU.",
    )
    bucket_max_images: int | None = Field(
        None, gt=0, description="Images per bucket (all buckets); default: the table's rule (1 on CPU)."
    )

    @field_validator("buckets")
    @classmethod
    def _parse_buckets(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                BucketTable.parse(v)
            except BucketError as e:
                raise ValueError(str(e)) from e
        return v


class BatchingArgs(BaseModel):
    """How an encoder replica batches requests and runs them."""

    model_config = _CONFIG

    max_batch_patches: int | None = Field(
        None,
        gt=0,
        description="Patches per replica batch (and per request the ingress sends); default: the largest "
        f"bucket's budget ({_CPU.max_batch_patches} with the CPU buckets).",
    )
    max_batch_size: int | None = Field(
        None,
        gt=0,
        description="Images per replica batch; default: the largest bucket's max_images "
        f"({_CPU.max_batch_images} with the CPU buckets).",
    )
    batch_wait_timeout_s: float = Field(
        0.002, ge=0, description="batcher='serve': how long @serve.batch waits for more requests after the first."
    )
    batch_fixed_cost_patches: int | None = Field(
        512,
        gt=0,
        description="batcher='continuous' on a GPU: a batch's replay cost independent of its size, in patches "
        "(H200, 7B tower: engine x1 and x32 fit ~1.7 ms + 3.2 us per bucket patch, ~530 patches). The batcher "
        "keeps the prefix of the queue with the most patches per (this + its bucket's budget), so a batch just "
        "over a bucket boundary leaves the excess for the next batch instead of padding to the next bucket. "
        "None: take everything that fits.",
    )
    gil_switch_interval_s: float | None = Field(
        0.0005,
        gt=0,
        description="Python's GIL switch interval in encoder replicas (sys.setswitchinterval). The device thread "
        "waits in GIL-releasing calls while the event loop unpickles requests; coming back it waits for the "
        "GIL up to this long each time (Python's default 5 ms; benchmarks/experiments/gil_convoy.py). None: leave it. "
        "Ingress replicas keep Python's default (their idle decode measured no better with 0.5 ms).",
    )
    batcher: Literal["serve", "continuous"] = Field(
        "continuous",
        description="'continuous': a batch is whatever waits when the device becomes free (no timer, no idle "
        "wait; deployments.batching). 'serve': @serve.batch with a patch-counting batch_size_fn, whose batches "
        "hold what arrived within batch_wait_timeout_s, and every idle request waits that long.",
    )
    pipeline_depth: int | None = Field(
        None,
        ge=1,
        le=4,
        description="Batches in flight per encoder replica. None: 2 on a GPU (the device thread uploads and "
        "patchifies batch N+1 and queues its replays while batch N runs, so the GPU does not wait for the host "
        "between batches), 1 on CPU (the engine runs there synchronously).",
    )


class ReplicaArgs(BaseModel):
    """The encoder deployment: replicas, resources, routing, health and shutdown."""

    model_config = _CONFIG

    num_replicas: int = Field(1, ge=1, description="Encoder replicas.")
    num_gpus: float | None = Field(
        None, ge=0, description="GPUs per encoder replica (0.5 = two replicas per GPU). Default: see resolve_num_gpus."
    )
    num_cpus: float = Field(0.5, ge=0, description="Logical CPUs per encoder replica (fractions are fine).")
    max_ongoing_requests: int = Field(512, gt=0, description="Requests one encoder replica accepts at once.")
    max_queued_requests: int = Field(
        1024, ge=-1, description="Encoder requests queued at each caller (ingress replica) before 503; -1 = no limit."
    )
    request_router_class: str | None = Field(
        "deployments.routing.router:BucketRouter",
        description="Import path of a ray.serve RequestRouter for the encoder deployment; the default routes "
        "by sequence-length bucket. None or 'ray' = Ray's default (power of two choices).",
    )
    request_router_kwargs: dict[str, Any] = Field(default_factory=dict, description="Passed to the router.")
    routing_stats_period_s: float = Field(1.0, gt=0, description="How often replicas publish routing stats.")
    health_check_period_s: float = Field(
        10.0, gt=0, description="Encoder replica health checks (a tiny real encode through the graph path)."
    )
    health_check_timeout_s: float = Field(30.0, gt=0, description="A health check slower than this fails.")
    graceful_shutdown_wait_loop_s: float = Field(
        0.5, gt=0, description="How often a stopping replica checks whether its requests have finished."
    )
    graceful_shutdown_timeout_s: float = Field(
        70.0, ge=0, description="Time a stopping replica has to finish its requests (> request_timeout_s); then killed."
    )
    enable_fault_injection: bool = Field(
        False, description="Tests only: EncoderReplica.inject_fault (hold batches, fail health checks)."
    )

    @field_validator("request_router_class", mode="before")
    @classmethod
    def _ray_default_router(cls, v):
        return None if v in ("ray", "default", "none", "") else v

    @model_validator(mode="after")
    def _check_router(self) -> ReplicaArgs:
        if self.request_router_kwargs and not self.request_router_class:
            raise ValueError("request_router_kwargs given without request_router_class")
        return self

    @field_validator("max_queued_requests")
    @classmethod
    def _encoder_queue_limit(cls, v: int) -> int:
        return _queue_limit(v)


class IngressArgs(BaseModel):
    """The ingress deployment: replicas, resources, merging, admission, time limits, retries."""

    model_config = _CONFIG

    ingress_replicas: int = Field(1, ge=1, description="HTTP/handle ingress replicas (CPU).")
    ingress_num_cpus: float = Field(0.25, ge=0, description="Logical CPUs per ingress replica.")
    ingress_max_ongoing_requests: int = Field(512, gt=0, description="Requests one ingress replica accepts.")
    ingress_max_queued_requests: int = Field(
        1024, ge=-1, description="HTTP requests queued at each proxy for the ingress before 503; -1 = no limit."
    )
    ingress_max_inflight_requests: int | None = Field(
        None,
        gt=0,
        description="Requests one ingress replica works on at once; more are answered 429 at once. Default: 3/4 "
        "of ingress_max_ongoing_requests (384), so that the excess reaches the ingress and is rejected fast.",
    )
    ingress_batch_size: int = Field(
        32, ge=0, description="Images the ingress merges into one encoder request (0 or 1: no ingress batching)."
    )
    ingress_max_concurrent_batches: int = Field(
        2,
        gt=0,
        description="Merged encoder requests in flight per ingress; calls arriving meanwhile wait and "
        "go together in the next one (no timer).",
    )
    ingress_packs_in_flight: int = Field(
        2,
        gt=0,
        description="Encoder calls (packs) of one request split for the encoder's batch limits that are in flight "
        "at once; the rest wait, so other callers' requests interleave with a large one (2: the next pack is "
        "queued while one runs, as with pipeline_depth 2).",
    )
    decode_threads: int = Field(
        4, gt=0, description="Threads per ingress opening image headers and resizing decoded (PIL, array) inputs."
    )
    decode_processes: int = Field(
        4,
        gt=0,
        description="Worker processes per ingress decoding encoded images (deployments.ingress.decode_pool): "
        "a decode that "
        "overruns decode_timeout_s is killed with its process, which is replaced.",
    )
    retry_after_s: float = Field(1.0, ge=0, description="Retry-After (seconds, rounded up) of 429 / 503 answers.")
    request_timeout_s: float = Field(
        60.0, gt=0, description="Per request, body read to response; past it 504 (408 if the body was still coming)."
    )
    drain_grace_s: float = Field(
        5.0, ge=0, le=600, description="Shutdown: how long an ingress replica still admits new requests after "
        "/health turns 503, for requests on their way and load balancers that poll /health less often (1 s at most "
        "where it was idle).",
    )  # fmt: skip
    encoder_retries: int = Field(
        3, ge=0, description="Retries of an encoder call whose replica died or is unavailable (encoding is idempotent)."
    )
    encoder_retry_backoff_s: float = Field(
        0.05, ge=0, description="First retry delay; doubles per retry (with jitter), capped at 2 s."
    )
    replica_stall_timeout_s: float = Field(
        3.0,
        gt=0,
        le=600,
        description="An encoder replica that has answered none of this ingress's calls for this long while one "
        "waited on it (or none of its liveness probes, about every quarter of it) is judged stalled (hung, frozen): "
        "the router stops sending to it, calls waiting on it are cancelled there and retried on another replica, "
        "/health counts it as not serving, and while no replica makes progress requests are answered 503 at once. "
        "Must exceed the longest legitimate batch (a GPU batch takes well under a second); it ends when the replica "
        "answers again (deployments.routing.progress).",
    )
    access_log: bool = Field(
        False, description="Serve's per-request access log lines (ingress and encoder replicas); off by default."
    )
    ec_cache_dir: str | None = Field(
        None,
        description="Where requests with `ec_cache_uuids` (and the handle's `write_ec_cache`) write each image's "
        "vLLM-layout tensor for vLLM's disk encoder-cache connector: <ec_cache_dir>/<uuid>/encoder_cache.safetensors "
        "(ECExampleConnector's shared_storage_path; storage every ingress replica and the LLM server share). "
        "None: the option is off (400 ec_cache_not_configured). Clients name only the uuid, never a path.",
    )
    cache_mib: int = Field(
        0,
        ge=0,
        description="MiB of encoder outputs each ingress replica keeps, keyed by content and everything that changes "
        "the answer, least recently used out (docs/service.md#encoder-cache): a repeated image or text is answered "
        "without decode or encode. 0 (default): off. Off by default because a hit answers without any encoder "
        "replica and is measurably faster: the service benchmarks (which repeat their images) and the fault tests "
        "would measure the cache, and tenants sharing a service could learn from the timing that an image was sent "
        "before; 256 is a good value where those do not matter (about 18k pooled 7B-Qwen vectors or 570 per-token "
        "bf16 224x224 answers per ingress replica).",
    )

    @property
    def inflight_limit(self) -> int:
        """Requests one ingress replica works on at once (`ingress_max_inflight_requests` or its default)."""
        if self.ingress_max_inflight_requests is not None:
            return self.ingress_max_inflight_requests
        return max(1, self.ingress_max_ongoing_requests * 3 // 4)

    @field_validator("ingress_max_queued_requests")
    @classmethod
    def _ingress_queue_limit(cls, v: int) -> int:
        return _queue_limit(v)

    @field_validator("ec_cache_dir")
    @classmethod
    def _absolute_ec_cache_dir(cls, v: str | None) -> str | None:
        if v is not None and not os.path.isabs(v):
            raise ValueError(f"ec_cache_dir must be an absolute path (every replica resolves it alike), got {v!r}")
        return v


class LimitArgs(BaseModel):
    """What one request may carry, and who may send it (README "Limits, errors and security")."""

    model_config = _CONFIG

    max_request_images: int = Field(256, gt=0, description="Images one HTTP request may carry (else 413).")
    max_request_bytes: int = Field(
        64 * 2**20, gt=0, description="HTTP request body bytes (Content-Length or counted while reading; else 413)."
    )
    max_image_bytes: int = Field(20 * 2**20, gt=0, description="Encoded bytes of one image (else 413).")
    max_image_pixels: int = Field(
        50_000_000,
        gt=0,
        description="Decoded width*height of one image, read from the file header before decoding (else 413); "
        "also Pillow's decompression-bomb limit in the ingress.",
    )
    max_request_patches: int = Field(
        262_144, gt=0, description="Patches of all images of one request (from the headers, before decoding)."
    )
    image_formats: tuple[str, ...] = Field(
        DEFAULT_IMAGE_FORMATS,
        description="Pillow formats accepted for encoded images (else 415); a list or 'PNG,JPEG,...'.",
    )
    api_key: str | None = Field(
        None,
        repr=False,
        description=f"Bearer key required on /v1/* (401 without it); default: the {API_KEY_ENV} environment "
        "variable of the ingress replica; unset = no key.",
    )
    url_allowlist: tuple[str, ...] = Field(
        (),
        description="Hosts ('host', 'host:port' or '*.domain') whose image URLs the ingress fetches; empty = no URL "
        "is fetched (http/https inputs are answered 400).",
    )
    url_schemes: tuple[str, ...] = Field(("https",), description="URL schemes fetched for allowlisted hosts.")
    url_fetch_timeout_s: float = Field(10.0, gt=0, description="Time limit of one image URL fetch.")
    decode_timeout_s: float = Field(
        5.0,
        gt=0,
        description="Time limit of decoding one encoded image in a decode process (else 413 image_decode_timeout); "
        "a 100-scan 4096x4096 progressive JPEG takes ~1.8 s on a CPU core, a 7000x7000 PNG ~4 s.",
    )
    max_inflight_bytes: int = Field(
        256 * 2**20,
        gt=0,
        description="Request bytes (headers and body) one ingress replica holds at once; a request that would "
        "exceed it is answered 429 with Retry-After at once (one request alone is always let in).",
    )
    max_inflight_patches: int = Field(
        1_048_576,
        gt=0,
        description="Patches of the requests one ingress replica decodes and encodes at once (counted from the "
        "headers, before decoding); over it 429 with Retry-After at once (one request alone is always let in).",
    )
    body_timeout_s: float = Field(
        10.0,
        gt=0,
        description="Time for a request body to arrive, plus one second per body_min_rate bytes received; "
        "past it 408. A body holds no admission slot until it has arrived.",
    )
    body_min_rate: int = Field(
        1 * 2**20, gt=0, description="Bytes per second a request body's time limit grows by (see body_timeout_s)."
    )
    # The HTTP front on both request paths: put into Serve's HAProxy variables (`ray_compat.proxy_bounds_env`) for a
    # Ray instance not started yet (the launcher, `serve run` of a local Ray, a pipeline); on the fast path HAProxy
    # applies them, on the default path Serve's Python proxy does through our proxy hook
    # (`ray_compat.bound_python_proxy`: Ray 2.60's uvicorn settings have no header cap, head timeout or eviction).
    proxy_max_header_bytes: int = Field(
        16384,
        ge=4096,
        le=2**20,
        description="Request line and headers: longer is refused before anything is forwarded (fast path: HAProxy's "
        "buffer, tune.bufsize, less 1 KiB, 400; default path: 431; body bytes are not counted).",
    )
    proxy_idle_timeout_s: int = Field(
        10,
        ge=1,
        le=3600,
        description="Seconds a client may stay silent while its request is expected (fast path: HAProxy's client "
        "timeout, head or body, or a response left unread; default path: a connection with no complete request head "
        "that long after it opened or after its last response); then 408 (or a close) and the connection ends. A slow "
        "answer is not cut by it. Serve's default is 3600 on the fast path, none on the default one.",
    )
    proxy_max_connections: int | None = Field(
        None,
        ge=16,
        le=2**20,
        description="Client connections held at once (fast path: HAProxy's maxconn, more wait in the kernel's accept "
        "queue; default path: past it a new connection closes the one that has waited longest for a request head, "
        "or gets 503 when every one is inside a request). Default: what the open-file limit where Ray starts allows "
        "(about 2.5 descriptors a connection on the fast path), at most 65536 (Serve's default is 4096); HAProxy "
        "refuses to start when a value does not fit that limit.",
    )

    @field_validator("image_formats", "url_allowlist", "url_schemes", mode="before")
    @classmethod
    def _comma_lists(cls, v):
        if isinstance(v, str):
            return tuple(x.strip() for x in v.split(",") if x.strip())
        return v

    @field_validator("image_formats")
    @classmethod
    def _known_formats(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        from PIL import Image

        Image.init()
        v = tuple(sorted({f.upper() for f in v}))
        unknown = [f for f in v if f not in Image.OPEN]
        if not v or unknown:
            raise ValueError(f"image_formats must be non-empty Pillow format names; unknown: {unknown}")
        return v

    @field_validator("api_key")
    @classmethod
    def _printable_key(cls, v: str | None) -> str | None:
        if v and (why := api_key_problem(v)):  # '' is no key, as unset
            raise ValueError(why)
        return v

    @field_validator("url_allowlist")
    @classmethod
    def _hosts(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        out = []
        for entry in v:
            entry = entry.strip().lower()
            if not entry or "/" in entry or "@" in entry or entry in ("*", "*."):
                raise ValueError(f"url_allowlist entries are 'host', 'host:port' or '*.domain', got {entry!r}")
            out.append(entry)
        return tuple(out)

    @field_validator("url_schemes")
    @classmethod
    def _schemes(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        v = tuple(s.lower() for s in v)
        if not set(v) <= {"http", "https"}:
            raise ValueError(f"url_schemes may hold 'http' and 'https' only, got {v}")
        return v
