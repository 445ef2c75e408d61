"""deployments.ingress.decoding.IngressDecoder without processes: a fake decode pool stands in for
`deployments.ingress.decode_pool.DecodePool`, so where each decode runs, its deadline and the cancelling of a request's
other decodes are checked fast (the real pool: tests/unit/deployments/ingress/test_decode_pool.py)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from PIL import Image

from deployments.ingress.decoding import IngressDecoder
from deployments.ingress.security import UrlFetcher
from deployments.metrics import RecentTimings
from encoder.errors import ImageDecodeError
from encoder.preprocessing.qwen import PreprocessConfig
from tests.images_util import encode, random_image

PP = PreprocessConfig()
TIMEOUT_S = 7.5


class FakePool:
    """`decode_async` of DecodePool: b"bad" fails at once, b"hang" waits until cancelled, others decode."""

    def __init__(self) -> None:
        self.calls: list[tuple[bytes, float]] = []
        self.cancelled: list[bytes] = []
        self.hanging = asyncio.Event()

    async def decode_async(self, data: bytes, deadline_s: float) -> np.ndarray:
        self.calls.append((data, deadline_s))
        if data == b"bad":
            await self.hanging.wait()  # fail only once the other decode is under way
            raise ImageDecodeError("image bytes are bad")
        if data == b"hang":
            self.hanging.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.append(data)
                raise
        return np.zeros((28, 28, 3), np.uint8)


def _decoder(fake: FakePool, threads: ThreadPoolExecutor) -> IngressDecoder:
    decoder = IngressDecoder(threads, UrlFetcher(()), 10**7, RecentTimings(), processes=1, timeout_s=TIMEOUT_S)
    decoder._pools["image"] = fake  # started: prepare() never starts real processes
    return decoder


def _opened_as(monkeypatch) -> None:
    """Every input opens as a small PNG whose encoded bytes are the given name (what the fake pool sees)."""
    import deployments.ingress.decoding as decoding
    from deployments.ingress.inputs import Opened

    real = decoding.open_input

    def open_input(x, pp, max_bytes):
        o = real(encode(random_image("RGB", 28, 28), "PNG"), pp, max_bytes)
        return Opened(o.image, o.patches, x)

    monkeypatch.setattr(decoding, "open_input", open_input)


def test_one_failed_decode_cancels_the_others_and_names_its_input(monkeypatch):
    fake = FakePool()
    _opened_as(monkeypatch)

    async def run():
        with ThreadPoolExecutor(2) as threads:
            decoder = _decoder(fake, threads)
            with pytest.raises(ImageDecodeError, match=r"^input\[1\]: image bytes are bad"):
                await decoder.prepare([b"hang", b"bad"], PP, "input")
            for _ in range(10):  # let the cancellation reach the other decode
                await asyncio.sleep(0)
            assert fake.cancelled == [b"hang"]  # here: asyncio.run would cancel it on the way out

    asyncio.run(asyncio.wait_for(run(), 60))


def test_encoded_images_get_the_configured_deadline(monkeypatch):
    fake = FakePool()
    _opened_as(monkeypatch)

    async def run():
        with ThreadPoolExecutor(2) as threads:
            return await _decoder(fake, threads).prepare([b"one", b"two"], PP, "input")

    out = asyncio.run(asyncio.wait_for(run(), 60))
    assert [a.shape for a in out] == [(28, 28, 3)] * 2
    assert sorted(fake.calls) == [(b"one", TIMEOUT_S), (b"two", TIMEOUT_S)]  # seconds, as configured


def test_a_small_file_of_many_pixels_is_decoded_in_the_pool_not_on_the_event_loop():
    """A flat 3000x2000 PNG is a few KB: small enough to open on the loop, too many pixels to decode there."""
    flat = encode(Image.new("RGB", (3000, 2000), (9, 9, 9)), "PNG")
    small = encode(random_image("RGB", 224, 224), "PNG")
    fake = FakePool()

    async def run(data):
        with ThreadPoolExecutor(2) as threads:
            return await _decoder(fake, threads).prepare([data], PP, "input")

    assert asyncio.run(asyncio.wait_for(run(small), 60))[0].ndim == 3
    assert fake.calls == []  # decoded inline
    asyncio.run(asyncio.wait_for(run(flat), 60))
    assert fake.calls == [(flat, TIMEOUT_S)]


def test_a_refused_bomb_logs_no_pillow_warning(monkeypatch):
    """Broken: the ingress refused an image over `max_image_pixels` (413) and its log still had Pillow's
    DecompressionBombWarning, printed by Image.open before the header check (`harden_pillow` sets Pillow's
    limit to ours: the warning fired for every refused image up to twice the limit)."""
    import warnings

    from PIL import PngImagePlugin

    from deployments.ingress.inputs import harden_pillow, open_input
    from encoder.errors import ImageTooLargeError
    from encoder.preprocessing.images import load_image
    from tests.images_util import png_bomb_header

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)  # harden_pillow's are process-wide
    monkeypatch.setattr(PngImagePlugin, "MAX_TEXT_MEMORY", PngImagePlugin.MAX_TEXT_MEMORY)
    pp = PreprocessConfig(max_image_pixels=1_000_000)
    bomb = png_bomb_header(1_200, 1_000)  # 1.2 MP: over the limit, under twice it (Pillow's error)
    with warnings.catch_warnings(record=True) as caught:  # and restores the filters harden_pillow adds
        warnings.simplefilter("always")
        harden_pillow(pp.max_image_pixels)
        with pytest.raises(ImageTooLargeError, match="over the limit of 1000000"):
            open_input(bomb, pp)
        with pytest.raises(ImageTooLargeError, match="over the limit of 1000000"):
            load_image(bomb, pp)  # the decode the ingress runs after it
    assert [str(w.message) for w in caught if issubclass(w.category, Image.DecompressionBombWarning)] == []
