"""Hostile and unusual inputs against a running service on CPU Ray (issue 6, acceptance 1 and 4).

One deployment for the module, with an API key, small limits (so over-limit inputs stay small) and
one allowlisted local HTTP server for image URLs. Every malformed request must be answered with its
documented 4xx and an OpenAI error object naming the problem, none with a 5xx, and the service must
still answer a good request correctly afterwards; unusual but valid images are encoded like
`VisionEncoder.encode` encodes them; 1,000 bad requests must not grow the ingress's memory.
"""

from __future__ import annotations

import base64
import io
import json
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import numpy as np
import pytest
from PIL import Image

import encoder
from deployments import build_app
from tests.images_util import encode, jpeg_with_orientation, png_bomb_header, random_image

pytestmark = pytest.mark.slow

KEY = "test-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMITS = {
    "max_request_images": 4,
    "max_request_bytes": 512 * 1024,
    "max_image_bytes": 128 * 1024,
    "max_image_pixels": 2_000_000,
    "max_request_patches": 2048,
}
ATOL = 1e-4


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def png(h: int, w: int, seed: int = 0, mode: str = "RGB") -> bytes:
    return encode(random_image(mode, h, w, seed), "PNG")


GOOD = png(64, 64, 1)


# ------------------------------------------------------------------------------------------ fixtures


class _Images(BaseHTTPRequestHandler):
    """A local image host: /good.png, /big.png (over max_image_bytes), /redirect, /missing, /text."""

    def do_GET(self):  # noqa: N802 - http.server API
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "/good.png")
            self.end_headers()
            return
        body, media = {
            "/good.png": (GOOD, "image/png"),
            "/big.png": (png(300, 300, 9), "image/png"),  # noise: ~270 KB > 128 KiB
            "/text": (b"<html>not an image</html>", "text/html"),
        }.get(self.path, (None, None))
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", media)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def image_host():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def app(ray_cluster, image_host):
    from tests.serve_fixtures import running_app

    args = {"model": "tiny", "api_key": KEY, "url_allowlist": [image_host], "url_schemes": ["http"], **LIMITS}
    with running_app(build_app(args), name="secure") as svc:
        yield svc


@pytest.fixture(scope="module")
def reference():
    return encoder.load("tiny")


@pytest.fixture(scope="module")
def client(app):
    with httpx.Client(base_url=app.base_url, timeout=60) as c:
        yield c


def embed(client, inputs, **kwargs) -> httpx.Response:
    return client.post("/v1/embeddings", json={"input": inputs, **kwargs}, headers=AUTH)


def vectors(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    return np.array([d["embedding"] for d in response.json()["data"]], dtype=np.float32)


# ------------------------------------------------------------------------------------------ hostile inputs


def _bmp_bomb(width: int, height: int) -> bytes:
    """A 54-byte BMP whose header claims width x height 24-bit pixels."""
    info = struct.pack("<IiiHHIIiiII", 40, width, height, 1, 24, 0, 0, 2835, 2835, 0, 0)
    return b"BM" + struct.pack("<IHHI", 14 + len(info), 0, 0, 14 + len(info)) + info


def _truncated(fmt: str) -> bytes:
    data = encode(random_image("RGB", 64, 64, 3), fmt)
    return data[: len(data) // 2]


def _noise_png(side: int) -> bytes:
    return png(side, side, 5)


def _zeros_png(h: int, w: int) -> bytes:
    return encode(Image.new("L", (w, h)), "PNG")


def _nested(depth: int) -> bytes:
    return b'{"input": ' + b"[" * depth + b"]" * depth + b"}"


J = "application/json"
# (id, request kwargs for httpx, status, error code); every kwargs dict is merged over a POST of a good body.
MALFORMED: list[tuple[str, dict, int, str]] = [
    ("invalid-json", {"content": b"{not json"}, 400, "invalid_json"),
    ("truncated-json", {"content": b'{"input": ["abc"'}, 400, "invalid_json"),
    ("deeply-nested-json", {"content": _nested(100_000)}, 400, "invalid_json"),
    ("invalid-utf8", {"content": b'{"input": "\xff\xfe"}'}, 400, "invalid_json"),
    ("empty-body", {"content": b""}, 400, "invalid_json"),
    ("json-array-body", {"json": [1, 2]}, 422, "invalid_schema"),
    ("json-null-body", {"json": None}, 422, "invalid_schema"),
    ("missing-input", {"json": {"model": "tiny"}}, 422, "invalid_schema"),
    ("input-number", {"json": {"input": 123}}, 422, "invalid_schema"),
    ("input-list-of-numbers", {"json": {"input": [1, 2, 3]}}, 422, "invalid_schema"),
    ("input-nested-lists", {"json": {"input": [["a"], ["b"]]}}, 422, "invalid_schema"),
    ("input-empty-list", {"json": {"input": []}}, 422, "invalid_schema"),
    ("input-null", {"json": {"input": None}}, 422, "invalid_schema"),
    ("unknown-pooling", {"json": {"input": [data_url(GOOD)], "pooling": "max"}}, 422, "invalid_schema"),
    ("unknown-encoding-format", {"json": {"input": [data_url(GOOD)], "encoding_format": "int8"}}, 422,
     "invalid_schema"),
    ("dimensions-not-int", {"json": {"input": [data_url(GOOD)], "dimensions": "abc"}}, 422, "invalid_schema"),
    ("model-not-string", {"json": {"input": [data_url(GOOD)], "model": 5}}, 422, "invalid_schema"),
    ("unknown-model", {"json": {"input": [data_url(GOOD)], "model": "gpt-4"}}, 404, "model_not_found"),
    ("unsupported-dimensions", {"json": {"input": [data_url(GOOD)], "dimensions": 7}}, 400, "invalid_dimensions"),
    ("bad-base64-chars", {"json": {"input": ["data:image/png;base64,!!!not base64!!!"]}}, 400, "invalid_base64"),
    ("bad-base64-padding", {"json": {"input": ["bm90IGJhc2U2NA="]}}, 400, "invalid_base64"),
    ("non-ascii-base64", {"json": {"input": ["iVBORw0KGgoü"]}}, 400, "invalid_base64"),
    ("nul-bytes", {"json": {"input": ["\x00\x00\x00\x00"]}}, 400, "invalid_base64"),
    ("data-url-no-comma", {"json": {"input": ["data:image/png;base64"]}}, 400, "invalid_data_url"),
    ("data-url-not-base64", {"json": {"input": ["data:image/png,rawbytes"]}}, 400, "invalid_data_url"),
    ("data-url-long-header", {"json": {"input": ["data:image/png;" + "x" * 300 + ";base64,AAAA"]}}, 400,
     "invalid_data_url"),
    ("data-url-text-media", {"json": {"input": ["data:text/plain;base64,aGVsbG8="]}}, 415, "unsupported_media_type"),
    ("data-url-svg", {"json": {"input": [data_url(b"<svg xmlns='http://www.w3.org/2000/svg'/>", "image/svg+xml")]}},
     415, "unsupported_image_format"),
    ("zero-bytes", {"json": {"input": [""]}}, 400, "invalid_image"),
    ("empty-data-url", {"json": {"input": ["data:image/png;base64,"]}}, 400, "invalid_image"),
    ("random-bytes", {"json": {"input": [data_url(np.random.default_rng(0).bytes(4096))]}}, 400, "invalid_image"),
    ("truncated-png", {"json": {"input": [data_url(_truncated("PNG"))]}}, 400, "invalid_image"),
    ("truncated-jpeg", {"json": {"input": [data_url(_truncated("JPEG"), "image/jpeg")]}}, 400, "invalid_image"),
    ("truncated-webp", {"json": {"input": [data_url(_truncated("WEBP"), "image/webp")]}}, 400, "invalid_image"),
    ("png-signature-only", {"json": {"input": [data_url(b"\x89PNG\r\n\x1a\n")]}}, 400, "invalid_image"),
    ("image-1x100000", {"json": {"input": [data_url(_zeros_png(1, 100_000))]}}, 400, "invalid_image"),
    ("image-100000x1", {"json": {"input": [data_url(_zeros_png(100_000, 1))]}}, 400, "invalid_image"),
    ("over-limit-pixels", {"json": {"input": [data_url(_zeros_png(1500, 1500))]}}, 413, "image_too_large"),
    ("png-decompression-bomb", {"json": {"input": [data_url(png_bomb_header(30000, 30000))]}}, 413, "image_too_large"),
    ("bmp-decompression-bomb", {"json": {"input": [data_url(_bmp_bomb(60000, 60000), "image/bmp")]}}, 413,
     "image_too_large"),
    ("unsupported-format-ico", {"json": {"input": [data_url(encode(random_image("RGB", 32, 32), "ICO"))]}}, 415,
     "unsupported_image_format"),
    ("unsupported-format-ppm", {"json": {"input": [data_url(encode(random_image("RGB", 32, 32), "PPM"))]}}, 415,
     "unsupported_image_format"),
    ("too-many-images", {"json": {"input": [data_url(GOOD)] * 5}}, 413, "too_many_images"),
    ("too-many-patches", {"json": {"input": [data_url(_zeros_png(448, 448))] * 3}}, 413, "too_many_patches"),
    ("image-over-byte-limit", {"json": {"input": [data_url(_noise_png(300))]}}, 413, "image_too_large"),
    ("over-size-payload", {"json": {"input": [data_url(GOOD)], "user": "x" * 600_000}}, 413, "request_too_large"),
    ("content-type-text",
     {"content": json.dumps({"input": [data_url(GOOD)]}), "headers": {"Content-Type": "text/plain"}}, 415,
     "unsupported_content_type"),
    ("content-type-form", {"data": {"input": "x"}}, 415, "unsupported_content_type"),
    ("missing-api-key", {"headers": {"Authorization": ""}}, 401, "missing_api_key"),
    ("wrong-api-key", {"headers": {"Authorization": "Bearer not-the-key"}}, 401, "invalid_api_key"),
    ("basic-auth-instead-of-bearer", {"headers": {"Authorization": "Basic dXNlcjpwdw=="}}, 401, "invalid_api_key"),
    ("url-not-allowlisted", {"json": {"input": ["http://169.254.169.254/latest/meta-data/x.png"]}}, 400,
     "url_not_allowed"),
    ("url-file-scheme", {"json": {"input": ["file:///etc/passwd"]}}, 400, "url_not_allowed"),
    ("url-ftp-scheme", {"json": {"input": ["ftp://example.com/a.png"]}}, 400, "url_not_allowed"),
    # 40,000 unknown fields in 400 KB (quadratic: a minute of the ingress's event loop) and a 256 KB field name
    ("unknown-field-bomb", {"content": b'{"input":"a",' + b",".join(b'"f%d":1' % i for i in range(40_000)) + b"}"},
     422, "invalid_schema"),
    ("huge-field-name", {"json": {"input": [data_url(GOOD)], "x" * 2**18: 1}}, 422, "invalid_schema"),
]  # fmt: skip
HOST_MALFORMED = [  # need the local image host's address
    ("url-with-credentials", "http://user:pw@{host}/good.png", 400, "url_not_allowed"),
    ("url-https-not-allowed", "https://{host}/good.png", 400, "url_not_allowed"),
    ("url-404", "http://{host}/missing", 400, "image_fetch_failed"),
    ("url-redirect", "http://{host}/redirect", 400, "image_fetch_failed"),
    ("url-too-big", "http://{host}/big.png", 413, "image_too_large"),
    ("url-not-an-image", "http://{host}/text", 400, "invalid_image"),
    ("url-with-tab", "http://{host}/go\tod.png", 400, "invalid_image_url"),
    ("url-with-cr", "http://{host}/go\rod.png", 400, "invalid_image_url"),
    ("url-with-lf", "http://{host}/go\nod.png", 400, "invalid_image_url"),
    ("url-with-nul", "http://{host}/go\x00od.png", 400, "invalid_image_url"),
    ("url-64k-long", "http://{host}/" + "a" * 2**16, 400, "invalid_image_url"),
]


def send(client: httpx.Client, kwargs: dict) -> httpx.Response:
    kwargs = dict(kwargs)
    if not {"json", "content", "data"} & set(kwargs):
        kwargs["json"] = {"input": [data_url(GOOD)]}
    headers = dict(AUTH) | kwargs.pop("headers", {})  # an empty value: no such header
    headers = {k: v for k, v in headers.items() if v}
    if "json" in kwargs:  # httpx would send `json=None` as no body
        kwargs["content"] = json.dumps(kwargs.pop("json")).encode()
        headers.setdefault("Content-Type", J)
    return client.post("/v1/embeddings", headers=headers, **kwargs)


def check_error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, (response.status_code, response.text[:500])
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["code"] == code and len(error["message"]) >= 10, error
    assert len(response.content) < 2000 and (error["param"] is None or len(error["param"]) <= 101), error
    if status == 401:
        assert response.headers["www-authenticate"] == "Bearer"


def test_malformed_inputs_get_their_4xx_and_none_a_5xx(client, image_host, reference):
    cases = MALFORMED + [(n, {"json": {"input": [u.format(host=image_host)]}}, s, c) for n, u, s, c in HOST_MALFORMED]
    assert len(cases) >= 40 and len({name for name, *_ in cases}) == len(cases)
    failures, statuses = [], {}
    for name, kwargs, status, code in cases:
        response = send(client, kwargs)
        statuses[name] = response.status_code
        try:
            check_error(response, status, code)
        except (AssertionError, ValueError, KeyError) as e:
            failures.append(f"{name}: {e!r}")
    assert not [n for n, s in statuses.items() if s >= 500], statuses
    assert not failures, "\n".join(failures)
    # other routes and methods
    check_error(client.get("/v1/nothing-here", headers=AUTH), 404, "not_found")
    check_error(client.get("/v1/embeddings", headers=AUTH), 405, "method_not_allowed")
    check_error(client.get("/v1/models"), 401, "missing_api_key")
    # ... and the service still answers a good request correctly
    np.testing.assert_allclose(
        vectors(embed(client, [data_url(GOOD)]))[0], reference.encode([GOOD], pooling="mean")[0].numpy(), atol=ATOL
    )


def test_api_key_on_every_route_but_health(app, client, reference):
    from openai import AuthenticationError, OpenAI

    assert httpx.get(f"{app.base_url}/health", timeout=30).status_code == 200  # load balancers: no key
    assert client.get("/v1/models", headers=AUTH).json()["data"][0]["id"] == "tiny"
    good = OpenAI(base_url=f"{app.base_url}/v1", api_key=KEY, timeout=60, max_retries=0)
    out = good.embeddings.create(model="tiny", input=[data_url(GOOD)])
    np.testing.assert_allclose(out.data[0].embedding, reference.encode([GOOD], pooling="mean")[0].numpy(), atol=ATOL)
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=f"{app.base_url}/v1", api_key="wrong", timeout=60, max_retries=0).embeddings.create(
            model="tiny", input=[data_url(GOOD)]
        )


def test_allowlisted_image_urls_are_fetched(client, image_host, reference):
    got = vectors(embed(client, [f"http://{image_host}/good.png", data_url(GOOD)]))
    np.testing.assert_allclose(got[0], got[1], atol=1e-6)
    np.testing.assert_allclose(got[0], reference.encode([GOOD], pooling="mean")[0].numpy(), atol=ATOL)


# ------------------------------------------------------------------------------------------ unusual valid images


def _animated(fmt: str) -> bytes:
    frames = [random_image("RGB", 48, 64, seed) for seed in range(3)]
    buf = io.BytesIO()
    frames[0].save(buf, format=fmt, save_all=True, append_images=frames[1:], duration=50, loop=0)
    return buf.getvalue()


def _palette_with_transparency() -> bytes:
    img = random_image("P", 40, 40, 4)
    img.info["transparency"] = 0
    return encode(img, "PNG", transparency=0)


UNUSUAL = {
    "1x1": encode(random_image("RGB", 1, 1, 1), "PNG"),
    "grayscale-png": png(50, 70, 2, "L"),
    "grayscale-alpha-png": png(50, 70, 3, "LA"),
    "palette-png": png(50, 70, 4, "P"),
    "palette-transparency-png": _palette_with_transparency(),
    "rgba-png": png(50, 70, 5, "RGBA"),
    "16-bit-png": png(50, 70, 6, "I;16"),
    "1-bit-png": png(50, 70, 7, "1"),
    "cmyk-jpeg": encode(random_image("CMYK", 50, 70, 8), "JPEG", quality=90),
    "cmyk-tiff": encode(random_image("CMYK", 50, 70, 9), "TIFF"),
    "grayscale-jpeg": encode(random_image("L", 50, 70, 10), "JPEG", quality=90),
    "progressive-jpeg": encode(random_image("RGB", 80, 60, 11), "JPEG", quality=90, progressive=True),
    "exif-rotated-jpeg": jpeg_with_orientation(40, 90, 6, seed=12),
    "animated-gif": _animated("GIF"),
    "animated-webp": _animated("WEBP"),
    "lossless-webp": encode(random_image("RGBA", 50, 70, 13), "WEBP", lossless=True),
    "bmp": encode(random_image("RGB", 50, 70, 14), "BMP"),
    "tiff": encode(random_image("RGB", 50, 70, 15), "TIFF", compression="tiff_lzw"),
}


def test_unusual_but_valid_images_are_encoded_as_rgb(client, reference):
    names = list(UNUSUAL)
    got = {}
    for start in range(0, len(names), LIMITS["max_request_images"]):
        batch = names[start : start + LIMITS["max_request_images"]]
        for name, vec in zip(batch, vectors(embed(client, [data_url(UNUSUAL[n]) for n in batch])), strict=True):
            got[name] = vec
    for name in names:
        # load_image's rules: EXIF orientation, first frame, alpha onto white, RGB conversion
        expected = reference.encode([UNUSUAL[name]], pooling="mean")[0].numpy()
        np.testing.assert_allclose(got[name], expected, atol=ATOL, err_msg=name)
    rotated = encoder.load("tiny").preprocess([UNUSUAL["exif-rotated-jpeg"]]).grid_thw[0].tolist()
    assert rotated[1] > rotated[2]  # 40x90 stored, displayed 90 tall: the rotation was applied


# ------------------------------------------------------------------------------------------ memory


def test_bad_requests_do_not_grow_ingress_memory(app, client):
    cheap = [kwargs for name, kwargs, status, _ in MALFORMED if name not in ("over-size-payload", "deeply-nested-json")]

    def rss() -> int:
        return app.handle.ingress_stats.remote().result(timeout_s=30)["rss_bytes"]

    def hammer(n: int) -> list[int]:
        def worker(k: int) -> list[int]:
            with httpx.Client(base_url=app.base_url, timeout=60) as c:
                return [send(c, cheap[(k + 4 * i) % len(cheap)]).status_code for i in range(n // 4)]

        with ThreadPoolExecutor(4) as pool:
            return [s for part in pool.map(worker, range(4)) for s in part]

    hammer(200)  # warm-up: allocator pools, Pillow plugins, pydantic and FastAPI caches
    before = rss()
    started = time.monotonic()
    statuses = hammer(1000)
    elapsed = time.monotonic() - started
    grown = rss() - before
    assert len(statuses) == 1000 and all(400 <= s < 500 for s in statuses), sorted(set(statuses))
    assert grown < 32 * 2**20, f"ingress RSS grew {grown / 2**20:.1f} MiB over 1000 bad requests ({elapsed:.1f}s)"
    np.testing.assert_allclose(vectors(embed(client, [data_url(GOOD)])).shape, (1, 128))
