"""Image decoding in worker processes, each decode under a deadline (issue 17: decode is cancellable).

A decode running in a thread cannot be stopped: a scan bomb that passes the structural limits keeps its
thread (and the GIL-free C decoder keeps a core) busy for as long as it takes. `DecodePool` runs
`encoder.preprocessing.images.load_image` in N worker processes instead. A worker that overruns the deadline is
killed (SIGTERM, then SIGKILL) and replaced, and the caller gets `DecodeTimeoutError` at the deadline; a
worker that dies while decoding (segfault, `os._exit`, OOM kill) gives `DecodeWorkerError` and is
replaced the same way. Errors the decode raises for the image (`EncoderError` subclasses) arrive as
themselves.

    pool = DecodePool(workers=2)                  # blocks until the workers are ready; or `with ... as pool`
    pixels = pool.decode(data, deadline_s=2.0)    # uint8 [H, W, 3] RGB, from any thread
    pixels = await pool.decode_async(data, 2.0)   # never blocks the event loop; then pool.close()

Workers come from the `forkserver` context: a fresh interpreter imports `encoder.preprocessing.qwen` once
(seconds: torch comes with it) and forks each worker, so nothing of the caller (CUDA, threads) is
inherited and a replacement is ready in ~0.1 s (`spawn` works too, each worker importing everything).
Cancelling `decode_async` drops a call waiting for a worker and stops (kills, replaces) the worker of
one already decoding, since its caller is gone. Pixels come back through the worker's pipe.

Per-image cost of the pool over decoding inline in the calling thread (`benchmarks/experiments/decode_limits.py`,
median of 20-30 interleaved runs on a 2-core box shared with other jobs; load average ~2.5 [~9]):
  decode_rgb 224x224 JPEG q90:        inline 0.54 ms, pool 0.84 ms (+0.3 ms) [+0.3-0.6 ms]
  decode_rgb 2048x2048 JPEG q90:      inline 34 ms, pool 46 ms (+11 ms: 12.6 MB of pixels) [+17-25 ms]
  decode_resized 2048x2048 -> 980x980: inline 93 ms, pool 97 ms (+3.5 ms: 2.9 MB) [within the noise]
  replacement after a kill, until the next decode is answered on a 1-worker pool: 60 ms [110-170 ms]
So the pool costs a small image ~0.3 ms and a large one ~1 ms per MB of pixels returned (the pipe
alone moves 12.6 MB in 13.6 ms, a memcpy takes 2.5 ms: shared memory would save at most ~1 ms/MB);
resizing in the worker (`decode_resized`) returns only the model-sized array.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing
import queue
import signal
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from encoder.errors import DecodeTimeoutError, DecodeWorkerError, EncoderError, reason
from encoder.preprocessing.config import ProcessorConfig
from encoder.preprocessing.images import harden_pillow, load_image
from encoder.preprocessing.qwen import DEFAULT_CONFIG

log = logging.getLogger(__name__)
_SLICE_S = 0.05  # how often a waiting call looks at its cancel flag and at the pool's state


def decode_rgb(data: bytes, cfg: ProcessorConfig) -> np.ndarray:
    """The pool's default decode: the project's own bytes path, as uint8 [H, W, 3] RGB."""
    return np.asarray(load_image(data, cfg))


def decode_resized(data: bytes, cfg: ProcessorConfig) -> np.ndarray:
    """Decode and resize to the model's input (`cfg.resize`, as the ingress): less to send back."""
    return cfg.resize(load_image(data, cfg))


def decode_video_frames(data: bytes, cfg) -> tuple[np.ndarray, tuple[list[float] | None, float | None]]:
    """A video pool's decode (`cfg`: a `VideoPreprocessConfig`, its limits included): the sampled frames resized,
    uint8 [n, h, w, 3], and the video's facts `(timestamps, second_per_grid_ts)`: Qwen3-VL's timestamps, Qwen2/2.5-VL's
    seconds per temporal patch, None where the tower has none (`encoder.preprocessing.video_decode.load_video`)."""
    from encoder.preprocessing.video_decode import load_video  # PyAV: only in the processes that decode videos

    prepared = load_video(data, cfg)
    return prepared.frames, (prepared.timestamps, prepared.second_per_grid_ts)


def _serve(conn, decode_fn: Callable, cfg) -> None:
    """A worker's main loop: bytes in, ('ok', shape) + pixel bytes or an error tuple out."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it stops us
    # A fresh process (forkserver) has Pillow's defaults: the ingress's hardening (PNG text chunks 8 MiB, not
    # 64; `cfg.max_image_pixels` decides, quietly) must be set here too, or the larger pictures the pool
    # decodes escaped the text-chunk cap that the small ones decoded in the ingress got.
    harden_pillow(getattr(cfg, "max_image_pixels", None))  # a video pool's config has no image limits
    try:
        conn.send(("ready",))
        while True:
            data = conn.recv_bytes()
            try:
                pixels, meta, with_meta = decode_fn(data, cfg), None, False
                if isinstance(pixels, tuple):  # (pixels, picklable facts about them): a video's timestamps, ...
                    (pixels, meta), with_meta = pixels, True  # sent back even when None (a Qwen2-VL video's)
                pixels = np.ascontiguousarray(pixels, dtype=np.uint8)
            except EncoderError as e:
                conn.send(("error", type(e), str(e)))
            except Exception as e:  # noqa: BLE001 - a bug in the decode function: reported, the worker lives on
                conn.send(("bug", type(e).__name__, reason(e)))
            else:
                conn.send(("ok", pixels.shape, meta) if with_meta else ("ok", pixels.shape))
                conn.send_bytes(pixels.reshape(-1))
    # The pool closed the pipe (EOFError) or its process died: a reset (ConnectionResetError, when it left a
    # message of ours unread, as a replica stopped by Ctrl-C does) or a broken pipe on our answer. Nobody is
    # left to answer; exit quietly rather than print a traceback into the service's log.
    except (EOFError, ConnectionResetError, BrokenPipeError):
        return


def _how(exitcode: int | None) -> str:
    if exitcode is None or exitcode >= 0:
        return "still running" if exitcode is None else f"exit code {exitcode}"
    names = {int(s): s.name for s in signal.Signals}
    return f"killed by {names.get(-exitcode, f'signal {-exitcode}')}"


class _Worker:
    def __init__(self, ctx, decode_fn: Callable, cfg) -> None:
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_serve, args=(child, decode_fn, cfg), name="decode-worker", daemon=True)
        self.proc.start()
        child.close()
        self.busy = False
        # close() and a restart thread (or a caller releasing it) may stop the same worker at once: the pipe must
        # be closed once, or the second os.close hits EBADF, or a descriptor that was reused meanwhile
        self._stop_lock = threading.Lock()

    def wait_ready(self, timeout_s: float) -> None:
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"decode worker not ready within {timeout_s:g} s")
        self.conn.recv()  # EOFError if it died while starting

    def kill(self) -> int | None:
        """Stop the process (SIGTERM, SIGKILL after 1 s); its exit code."""
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(1.0)
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5.0)
        return self.proc.exitcode

    def stop(self) -> int | None:
        """Kill the process and close the pipe; safe to call again and from several threads at once."""
        code = self.kill()
        with self._stop_lock:
            if not self.conn.closed:
                self.conn.close()
        return code


class DecodePool:
    """`workers` decode processes; `decode_fn(data, cfg) -> uint8 HWC array` (module-level, picklable)
    runs in them, by default `decode_rgb` (`encoder.preprocessing.images.load_image` with `cfg`).

    Like every spawn / forkserver child, a worker first imports the caller's main script as __mp_main__
    (not for `python -m pkg`): under Ray that is Ray's worker script, which imports ray, so a Ray actor
    should pass `preload=("encoder.preprocessing.qwen", "ray")` to have that import done once in the fork server.
    """

    def __init__(
        self,
        workers: int = 2,
        *,
        cfg: ProcessorConfig = DEFAULT_CONFIG,
        decode_fn: Callable = decode_rgb,
        context: str = "forkserver",
        preload: Sequence[str] = ("encoder.preprocessing.qwen",),
        start_timeout_s: float = 120.0,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self._ctx = multiprocessing.get_context(context)
        if context == "forkserver":
            # The fork server imports these once and every worker is forked with them loaded. Only takes
            # effect if this process's fork server is not running yet (there is one per process).
            self._ctx.set_forkserver_preload(list(preload))
        self._args = (decode_fn, cfg)
        self._start_timeout_s = start_timeout_s
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._all: set[_Worker] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._threads = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="decode-pool")
        started = [self._start() for _ in range(workers)]
        try:
            for w in started:
                w.wait_ready(start_timeout_s)
                self._idle.put(w)
        except BaseException:
            self.close()
            raise

    def _start(self) -> _Worker:
        w = _Worker(self._ctx, *self._args)
        with self._lock:
            self._all.add(w)
        return w

    @property
    def pids(self) -> list[int]:  # of the current workers (monitoring, tests)
        with self._lock:
            return [w.proc.pid for w in self._all]

    def decode(self, data: bytes, deadline_s: float, *, cancel: threading.Event | None = None) -> np.ndarray:
        """Decode one image in a worker: uint8 [H, W, 3]. Waits for a free worker first (not counted in
        the deadline). Raises the decode's own EncoderError, DecodeTimeoutError when decoding takes longer
        than `deadline_s` seconds, DecodeWorkerError when the worker dies, CancelledError once `cancel`
        is set, RuntimeError when the pool is closed."""
        if deadline_s <= 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
        w = self._acquire(cancel)
        w.busy = True
        ends = time.monotonic() + deadline_s
        try:
            w.conn.send_bytes(data)
            while not w.conn.poll(min(_SLICE_S, max(0.0, ends - time.monotonic()))):
                if cancel is not None and cancel.is_set():
                    self._replace(w)
                    raise concurrent.futures.CancelledError("the caller cancelled the decode")
                if time.monotonic() >= ends:
                    self._replace(w)
                    raise DecodeTimeoutError(
                        f"decoding the image ({len(data)} bytes) took longer than the deadline of {deadline_s:g} s"
                    )
            reply = w.conn.recv()
            if reply[0] == "ok":
                pixels = np.empty(reply[1], dtype=np.uint8)
                w.conn.recv_bytes_into(pixels.reshape(-1))
        except (EOFError, OSError) as e:  # the worker died (or the pool was closed under us)
            code = self._replace(w)
            if self._closed:
                raise RuntimeError("the DecodePool was closed during the decode") from None
            raise DecodeWorkerError(
                f"the decode worker died ({_how(code)}) while decoding the image ({len(data)} bytes)"
            ) from e
        self._release(w)
        if reply[0] == "ok":
            return pixels if len(reply) == 2 else (pixels, reply[2])
        if reply[0] == "error":
            raise reply[1](reply[2])
        raise RuntimeError(f"decode function failed: {reply[1]}: {reply[2]}")

    async def decode_async(self, data: bytes, deadline_s: float) -> np.ndarray:
        """`decode` on a pool thread; cancelling drops the call (queued: never runs; running: its worker is
        stopped)."""
        if self._closed:
            raise RuntimeError("the DecodePool is closed")
        cancel = threading.Event()
        future = self._threads.submit(self.decode, data, deadline_s, cancel=cancel)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            cancel.set()
            raise

    def _acquire(self, cancel: threading.Event | None) -> _Worker:
        while True:
            if self._closed:
                raise RuntimeError("the DecodePool is closed")
            if cancel is not None and cancel.is_set():
                raise concurrent.futures.CancelledError("the caller cancelled the decode")
            try:
                return self._idle.get(timeout=_SLICE_S)
            except queue.Empty:
                continue

    def _release(self, w: _Worker) -> None:
        w.busy = False
        with self._lock:
            keep = not self._closed and w in self._all
        if keep:
            self._idle.put(w)
        else:
            w.stop()

    def _replace(self, w: _Worker) -> int | None:
        """Stop `w` now; a new worker is started in the background (the caller does not wait for it)."""
        code = w.stop()
        with self._lock:
            self._all.discard(w)
            closed = self._closed
        if not closed:
            threading.Thread(target=self._add_worker, name="decode-pool-restart", daemon=True).start()
        return code

    def _add_worker(self) -> None:
        for attempt in range(1_000_000):
            if self._closed:
                return
            try:
                w = self._start()
            except Exception as e:  # noqa: BLE001 - fork failures (EAGAIN, ENOMEM) are retried
                log.warning("could not start a decode worker: %s", reason(e))
            else:
                try:
                    w.wait_ready(self._start_timeout_s)
                except (EOFError, OSError, TimeoutError) as e:
                    log.warning("a new decode worker failed to start (%s): %s", _how(w.kill()), reason(e))
                    with self._lock:
                        self._all.discard(w)
                    w.stop()
                else:
                    self._release(w)  # stops it instead if the pool was closed meanwhile
                    return
            time.sleep(min(30.0, 0.1 * 2**attempt))

    # ----------------------------------------------------------------------------------------- closing

    def close(self) -> None:
        """Stop every worker (busy ones too: their callers get RuntimeError); idempotent. The fork server
        (one per process, idle, multiprocessing's own) stays until this process exits."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            workers = list(self._all)
            self._all.clear()
        for w in workers:
            if w.busy:
                w.kill()  # its caller sees the pipe end and closes the pipe itself
            else:
                w.stop()
        self._threads.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> DecodePool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
