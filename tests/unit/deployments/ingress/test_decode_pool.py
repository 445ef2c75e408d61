"""deployments.ingress.decode_pool: decoding in worker processes under a deadline (issue 17: decode is cancellable).

Wall-clock assertions are wide margins between working and broken only (a worker that is not killed
would sleep 600 s); nothing sleeps to synchronise.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
import threading
import time

import numpy as np
import pytest

from deployments.ingress.decode_pool import DecodePool, _serve, decode_resized
from encoder.errors import DecodeTimeoutError, DecodeWorkerError, ImageDecodeError, ImageTooComplexError
from encoder.preprocessing.images import load_image
from encoder.preprocessing.qwen import DEFAULT_CONFIG
from tests.decode_hooks import misbehaving_decode
from tests.images_util import encode, random_image
from tests.jpeg_bombs import scan_bomb

JPEG = encode(random_image("RGB", 224, 200), "JPEG", quality=90)


@pytest.fixture(scope="module")
def pool():
    # One worker: after a kill the next decode can only succeed on a replacement.
    with DecodePool(1, decode_fn=misbehaving_decode) as p:
        yield p


def _decode_soon(pool, data, deadline_s=30.0, within_s=30.0):
    """`pool.decode` that fails (instead of hanging the suite) when no answer comes within `within_s`: a pool
    that never replaces a dead worker, or never times out a decode, would otherwise block it for good."""
    cancel = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1) as caller:
        call = caller.submit(pool.decode, data, deadline_s, cancel=cancel)
        try:
            return call.result(timeout=within_s)
        except concurrent.futures.TimeoutError:
            cancel.set()  # the call returns within one slice; the pool stays usable for the next test
            raise AssertionError(f"no answer within {within_s:g} s") from None


def test_decodes_like_load_image(pool):
    for data in (JPEG, encode(random_image("RGBA", 50, 60), "PNG"), encode(random_image("P", 30, 20), "GIF")):
        out = pool.decode(data, 30.0)
        assert out.dtype == np.uint8 and out.flags.writeable
        np.testing.assert_array_equal(out, np.asarray(load_image(data)))


def test_decode_resized_returns_what_the_ingress_sends():
    data = encode(random_image("RGB", 300, 500), "PNG")
    with DecodePool(1, decode_fn=decode_resized) as p:
        out = p.decode(data, 30.0)
    np.testing.assert_array_equal(out, DEFAULT_CONFIG.resize(load_image(data)))
    assert out.shape[0] % 28 == 0 and out.shape[1] % 28 == 0


def test_decode_errors_arrive_as_themselves(pool):
    with pytest.raises(ImageDecodeError) as inline:
        load_image(b"not an image")
    with pytest.raises(ImageDecodeError) as pooled:
        pool.decode(b"not an image", 30.0)
    assert type(pooled.value) is type(inline.value) and str(pooled.value) == str(inline.value)
    with pytest.raises(ImageTooComplexError, match="max_jpeg_scans=100"):
        pool.decode(scan_bomb(2000), 30.0)
    with pytest.raises(RuntimeError, match="decode function failed: KeyError"):
        pool.decode(b"bug", 30.0)
    assert pool.decode(JPEG, 30.0).shape == (224, 200, 3)


def test_overrunning_worker_is_killed_and_replaced(pool):
    (before,) = pool.pids
    started = time.monotonic()
    with pytest.raises(DecodeTimeoutError, match=r"longer than the deadline of 0\.5 s"):
        _decode_soon(pool, b"sleep", 0.5)
    # the 0.5 s deadline, then the kill; broken, the worker sleeps its 600 s
    assert time.monotonic() - started < 30.0
    assert not _running(before)
    assert _decode_soon(pool, JPEG).shape == (224, 200, 3)  # on the replacement
    assert pool.pids != [before]


@pytest.mark.parametrize(("request_", "how"), [(b"exit", "exit code 3"), (b"segfault", "killed by SIGSEGV")])
def test_crashed_worker_is_replaced(pool, request_, how):
    (before,) = pool.pids
    with pytest.raises(DecodeWorkerError, match=f"the decode worker died \\({how}\\) while decoding"):
        pool.decode(request_, 30.0)
    assert _decode_soon(pool, JPEG).shape == (224, 200, 3)  # on the replacement
    assert pool.pids != [before]


def test_async_decode_does_not_block_the_loop(pool):
    async def main():
        task = asyncio.ensure_future(pool.decode_async(b"sleep", 1.0))
        beats = 0
        while not task.done():  # a blocked loop would not come back here until the call ended
            await asyncio.sleep(0.01)
            beats += 1
        with pytest.raises(DecodeTimeoutError):
            task.result()
        assert beats >= 10
        return await pool.decode_async(JPEG, 30.0)

    np.testing.assert_array_equal(asyncio.run(main()), np.asarray(load_image(JPEG)))


def test_cancelled_async_decode_frees_its_worker(pool):
    async def main():
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(pool.decode_async(b"sleep", 600.0), timeout=0.5)
        started = time.monotonic()
        # the only worker would be asleep for 600 s; wait_for cancels the call instead of hanging the suite
        out = await asyncio.wait_for(pool.decode_async(JPEG, 30.0), 30.0)
        return out, time.monotonic() - started

    out, waited = asyncio.run(main())
    assert out.shape == (224, 200, 3) and waited < 30.0


def test_concurrent_callers_share_the_workers():
    with DecodePool(2, decode_fn=misbehaving_decode) as p:
        with concurrent.futures.ThreadPoolExecutor(6) as callers:
            slow = callers.submit(p.decode, b"sleep", 2.0)
            fast = [callers.submit(p.decode, JPEG, 30.0) for _ in range(5)]
            for f in fast:  # served by the other worker while one sleeps
                assert f.result().shape == (224, 200, 3)
            with pytest.raises(DecodeTimeoutError):
                slow.result()


def test_a_worker_stopped_by_two_threads_at_once_closes_its_pipe_once(monkeypatch):
    # close() and a restart thread can stop the same worker together (seen in CI: EBADF from the second
    # os.close). A slow close of the pipe holds the first stopper inside it while the second arrives.
    with DecodePool(1, decode_fn=misbehaving_decode) as p:
        (w,) = list(p._all)
        real_close = w.conn._close
        closes = []

        def slow_close(*args):
            closes.append(threading.current_thread().name)
            time.sleep(0.2)
            real_close(*args)

        monkeypatch.setattr(w.conn, "_close", slow_close)
        errors = []

        def stop():
            try:
                w.stop()
            except OSError as e:
                errors.append(e)

        stoppers = [threading.Thread(target=stop, name=f"stopper{i}") for i in range(2)]
        for t in stoppers:
            t.start()
        for t in stoppers:
            t.join(timeout=30)
        assert not errors and len(closes) == 1 and w.conn.closed and not w.proc.is_alive(), (errors, closes)


def test_close_leaves_no_processes():
    p = DecodePool(2, decode_fn=misbehaving_decode)
    pids = p.pids
    assert len(pids) == 2 and all(_running(pid) for pid in pids)
    errors = []

    def busy():
        try:
            p.decode(b"sleep", 600.0)
        except RuntimeError as e:
            errors.append(e)

    caller = threading.Thread(target=busy)
    caller.start()
    p.close()
    caller.join(30.0)
    assert not caller.is_alive() and len(errors) == 1 and "closed" in str(errors[0])
    assert not any(_running(pid) for pid in pids)
    assert not {c.pid for c in multiprocessing.active_children()} & set(pids)
    with pytest.raises(RuntimeError, match="closed"):
        p.decode(JPEG, 1.0)
    p.close()  # idempotent


def test_bad_arguments(pool):
    with pytest.raises(ValueError, match="deadline_s must be > 0"):
        pool.decode(JPEG, 0)
    with pytest.raises(ValueError, match="workers must be >= 1"):
        DecodePool(0)


def _running(pid: int) -> bool:
    """Whether the process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("unread", [True, False], ids=["reset (a message left unread)", "closed"])
def test_a_worker_whose_pool_is_gone_exits_quietly(capfd, unread):
    """When the ingress replica dies (Serve shutting down on Ctrl-C), its decode workers see their pipe reset, or
    closed: each exits with status 0 and prints no traceback into the service's log."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=True)
    proc = ctx.Process(target=_serve, args=(child, decode_resized, DEFAULT_CONFIG), daemon=True)
    proc.start()
    child.close()
    assert parent.poll(60), "the worker never said it was ready"
    if not unread:
        parent.recv()
    parent.close()  # with the worker's "ready" unread, the worker's next read fails with ECONNRESET
    proc.join(60)
    assert proc.exitcode == 0, proc.exitcode
    assert "Traceback" not in capfd.readouterr().err


def test_a_worker_prints_no_pillow_bomb_warning(capfd):
    """Broken: a worker (a fresh forkserver / spawn process, Pillow's limit at its default ~89 MP) printed
    Pillow's DecompressionBombWarning into the service's log for an image over it; the pool's
    `cfg.max_image_pixels` (100 MP here) decides, with its own error."""
    from tests.images_util import png_bomb_header

    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=True)
    proc = ctx.Process(target=_serve, args=(child, decode_resized, DEFAULT_CONFIG), daemon=True)
    proc.start()
    child.close()
    assert parent.poll(60), "the worker never said it was ready"
    assert parent.recv() == ("ready",)
    parent.send_bytes(png_bomb_header(10_000, 9_500))  # 95 MP: over Pillow's limit, under ours; no pixel data
    assert parent.poll(60)
    kind, error, message = parent.recv()
    assert (kind, error) == ("error", ImageDecodeError) and "truncated" in message, message
    parent.close()
    proc.join(60)
    assert "DecompressionBombWarning" not in capfd.readouterr().err


def test_a_worker_refuses_a_png_text_chunk_bomb(pool):
    """Issue 44 case 8. Broken: a worker (a fresh forkserver process) had Pillow's default text-chunk limit, 64 MiB,
    so 60 MB of zTXt in a picture large enough for the pool (512x512) decoded; the same chunks in a 64x64 one,
    decoded in the ingress process, were refused. Workers now apply the ingress's hardening (`harden_pillow`)."""
    from tests.images_util import png_with_text

    with pytest.raises(ImageTooComplexError, match="PNG text chunks .* more than the limit of 8388608 bytes"):
        _decode_soon(pool, png_with_text(512, 60))
    assert _decode_soon(pool, JPEG).shape == (224, 200, 3)  # the worker lives on


def test_the_ingress_refuses_a_text_chunk_bomb_on_the_loop_and_in_a_worker(monkeypatch):
    """The ingress's two decode paths (a 64x64 picture on the event loop, a 512x512 one in a decode process)
    give the same 413 `image_too_complex` naming the input."""
    import warnings
    from concurrent.futures import ThreadPoolExecutor

    from PIL import Image, PngImagePlugin

    from deployments.errors import ErrorCode, classify
    from deployments.ingress.decoding import IngressDecoder
    from deployments.ingress.inputs import harden_pillow
    from deployments.ingress.security import UrlFetcher
    from deployments.metrics import RecentTimings
    from tests.images_util import png_with_text

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)  # harden_pillow's are process-wide
    monkeypatch.setattr(PngImagePlugin, "MAX_TEXT_MEMORY", PngImagePlugin.MAX_TEXT_MEMORY)

    async def refusals(decoder) -> list[BaseException]:
        out = []
        for side in (64, 512):
            try:
                await asyncio.wait_for(decoder.prepare([png_with_text(side, 60)], DEFAULT_CONFIG, "input"), 60)
            except ImageTooComplexError as e:
                out.append(e)
        return out

    with warnings.catch_warnings(), ThreadPoolExecutor(2) as threads:  # the filter harden_pillow adds
        harden_pillow(DEFAULT_CONFIG.max_image_pixels)  # as the ingress replica's constructor does
        decoder = IngressDecoder(threads, UrlFetcher(()), 10**7, RecentTimings(), processes=1, timeout_s=30.0)
        try:
            refused = asyncio.run(refusals(decoder))
            assert len(decoder.pids()) == 1  # the 512x512 one went to a decode process
        finally:
            decoder.close()
    assert len(refused) == 2, refused
    for e in refused:
        assert str(e).startswith("input[0]: PNG text chunks"), e
        assert classify(e).error is ErrorCode.IMAGE_TOO_COMPLEX and ErrorCode.IMAGE_TOO_COMPLEX.status == 413
