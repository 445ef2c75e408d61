"""An encoder replica's health check, and the faults tests inject into it.

* `HealthProbe`: Serve's health check (every `health_check_period_s`; 3 failures in a row and Serve replaces
  the replica). It fails after a sticky device error, and otherwise runs a tiny real encode in the device
  thread (queued behind the running batch) and checks its output is finite and unchanged since start-up.
* `FaultInjector` (tests only, `AppArgs.enable_fault_injection`): holds batches in the device thread, fails
  health checks, or corrupts the weights (a broken device state the probe must detect).
"""

from __future__ import annotations

import logging
import time

import numpy as np
import ray
import torch

from deployments.metrics import ReplicaMetrics
from encoder.errors import InvalidArgumentError
from encoder.patchify import stack_patchify
from encoder.preprocessing.config import ProcessorConfig

logger = logging.getLogger("ray.serve")


def sticky_device_error(e: BaseException) -> bool:
    """An error after which the device (CUDA context) cannot be trusted: the replica must be replaced."""
    text = str(e)
    return "CUDA error" in text or "CUBLAS" in text or "illegal memory access" in text


def probe_pixels(pp: ProcessorConfig) -> list[np.ndarray]:
    """One small deterministic picture at the model's smallest size (a ramp, not a flat colour)."""
    side = pp.factor * max(1, -(-int(pp.min_pixels**0.5) // pp.factor))
    ramp = (np.arange(side * side * 3, dtype=np.int64) * 37 % 251).astype(np.uint8)
    return [ramp.reshape(side, side, 3)]


class FaultInjector:
    """Faults a test sets with `EncoderReplica.inject_fault` (see `inject`)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.unhealthy = False
        self._hold = None  # (switch actor, timeout)

    def inject(self, kind: str | None, switch=None, timeout_s: float = 60.0) -> None:
        """kind: "hold" — the next batch waits in the device thread (and every later one behind it) until
        `switch.wait.remote()` returns (an actor the test owns) or `timeout_s` passes; "unhealthy" — health
        checks fail; None — clear "hold" and "unhealthy". ("corrupt" is `HealthProbe.corrupt`.)"""
        if not self.enabled:
            raise InvalidArgumentError("fault injection is disabled (AppArgs.enable_fault_injection)")
        if kind == "hold":
            if switch is None:
                raise InvalidArgumentError("inject_fault('hold') needs a switch actor with a wait() method")
            self._hold = (switch, timeout_s)
        elif kind == "unhealthy":
            self.unhealthy = True
        elif kind is None:
            self.unhealthy, self._hold = False, None
        else:
            raise InvalidArgumentError(f"unknown fault {kind!r}; expected hold, unhealthy, corrupt or None")

    def wait_if_held(self) -> None:
        """Device thread: block while a "hold" fault is set (released by its switch, or its timeout)."""
        hold = self._hold
        if hold is None:
            return
        switch, timeout_s = hold
        try:
            ray.get(switch.wait.remote(), timeout=timeout_s)
        except Exception as e:  # noqa: BLE001 - a lost switch or the timeout releases the hold too
            logger.warning("hold released by %s: %s", type(e).__name__, e)
        finally:
            if self._hold is hold:
                self._hold = None


class HealthProbe:
    """The replica's health check (see the module docstring). `pipeline`: the replica's `DevicePipeline`."""

    def __init__(self, pipeline, metrics: ReplicaMetrics, faults: FaultInjector):
        self._pipeline, self._metrics, self._faults = pipeline, metrics, faults
        self._pixels = probe_pixels(pipeline.pp)
        self._reference = self._encode()

    def _encode(self) -> np.ndarray:
        """Device thread: encode the probe image through the engine (a graph replay on CUDA)."""
        p = self._pipeline
        (vector,) = p.engine.encode(stack_patchify(self._pixels, p.pp, p.device), pooling="mean")
        return vector.numpy()

    def _failed(self, message: str, cause: BaseException | None = None) -> RuntimeError:
        self._metrics.health_checks.inc(tags={"result": "failed"})
        error = RuntimeError(message)
        error.__cause__ = cause
        return error

    async def check(self) -> None:
        pipeline = self._pipeline
        if self._faults.unhealthy:
            raise self._failed("encoder replica is unhealthy (injected fault)")
        if pipeline.fatal is not None:
            raise self._failed(f"encoder replica hit a device error and must be replaced: {pipeline.fatal}")
        started = time.perf_counter()
        try:
            out = await pipeline.on_device_thread(self._encode)
        except Exception as e:
            if sticky_device_error(e):
                pipeline.fatal = e
            raise self._failed(f"health probe encode failed: {type(e).__name__}: {e}", e) from e
        self._metrics.health_probe.observe(time.perf_counter() - started)
        if not np.isfinite(out).all() or not np.allclose(out, self._reference, rtol=1e-3, atol=1e-3):
            pipeline.fatal = RuntimeError("the health probe's embedding is not finite or differs from start-up")
            raise self._failed(f"encoder replica must be replaced: {pipeline.fatal}")
        self._metrics.health_checks.inc(tags={"result": "ok"})

    async def corrupt(self) -> None:
        """Fault injection: the weights become NaN, in place (captured graphs read the same memory)."""
        if not self._faults.enabled:
            raise InvalidArgumentError("fault injection is disabled (AppArgs.enable_fault_injection)")

        @torch.no_grad()
        def fill() -> None:
            for p in self._pipeline.engine.encoder.model.parameters():
                p.fill_(float("nan"))

        await self._pipeline.on_device_thread(fill)
