"""Limits, error mapping, admission, retries, API key and URL policy without a running Serve (fast).

The same paths run end to end in test_security.py and test_reliability*.py.
"""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import orjson
import pytest
from PIL import Image
from pydantic import ValidationError
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError

from deployments.config import DEFAULT_IMAGE_FORMATS, AppArgs
from deployments.errors import ErrorCode, RequestError, classify
from deployments.ingress.encoder_calls import call_with_retries
from deployments.ingress.inputs import finish_input, ingress_preprocess_config, open_input
from deployments.ingress.limits import Admission, check_content_type, check_request_patches
from deployments.ingress.openai_api import error_response, parse_embedding_request
from deployments.ingress.security import ApiKeyAuth, UrlFetcher, host_allowed
from deployments.metrics import rss_bytes
from encoder.errors import ConfigError, ImageDecodeError, ImageTooLargeError, InvalidImageError
from encoder.preprocessing.images import DEFAULT_FORMATS
from encoder.preprocessing.qwen import PreprocessConfig
from tests.images_util import encode, png_bomb_header, random_array, random_image

PP = ingress_preprocess_config(PreprocessConfig(), 2_000_000, DEFAULT_IMAGE_FORMATS)


# ------------------------------------------------------------------------------------------ arguments


def test_limit_defaults_are_the_documented_ones_and_validated():
    a = AppArgs()
    assert (a.max_request_bytes, a.max_image_bytes, a.max_image_pixels) == (64 * 2**20, 20 * 2**20, 50_000_000)
    assert (a.max_request_images, a.max_request_patches) == (256, 262_144)
    assert set(a.image_formats) == set(DEFAULT_FORMATS)
    assert (a.max_queued_requests, a.ingress_max_queued_requests, a.inflight_limit) == (1024, 1024, 384)
    assert (a.request_timeout_s, a.encoder_retries, a.retry_after_s) == (60.0, 3, 1.0)
    assert (a.health_check_period_s, a.graceful_shutdown_timeout_s) == (10.0, 70.0)
    assert a.api_key is None and a.url_allowlist == () and a.enable_fault_injection is False
    assert AppArgs(ingress_max_ongoing_requests=64).inflight_limit == 48
    assert AppArgs(ingress_max_inflight_requests=7).inflight_limit == 7
    cli = AppArgs.model_validate({"image_formats": "png, jpeg", "url_allowlist": "Img.Example.com,*.cdn.org:8443"})
    assert cli.image_formats == ("JPEG", "PNG") and cli.url_allowlist == ("img.example.com", "*.cdn.org:8443")
    assert "sekrit" not in repr(AppArgs(api_key="sekrit"))  # never in logs
    for bad in ({"image_formats": "PNG,NOPE"}, {"image_formats": ""}, {"max_queued_requests": 0},
                {"url_schemes": "ftp"}, {"url_allowlist": "http://x.com/"}, {"url_allowlist": "*"},
                {"max_image_pixels": 0}, {"request_timeout_s": 0}):  # fmt: skip
        with pytest.raises(ValidationError):
            AppArgs.model_validate(bad)


POSITIVE = """max_request_images max_request_bytes max_image_bytes max_image_pixels max_request_patches
    max_inflight_bytes max_inflight_patches body_min_rate body_timeout_s decode_timeout_s url_fetch_timeout_s
    request_timeout_s
    ingress_max_inflight_requests ingress_max_ongoing_requests max_ongoing_requests ingress_max_concurrent_batches
    ingress_packs_in_flight decode_threads decode_processes num_replicas ingress_replicas""".split()
NON_NEGATIVE = "retry_after_s encoder_retries encoder_retry_backoff_s num_cpus ingress_num_cpus num_gpus".split()


def test_limits_refuse_zero_or_negative_values_and_queues_take_minus_one_only():
    """A zero limit would refuse every request (or, for time limits, time every one out), a negative one is
    meaningless: refused when the app is configured, not at the first request."""
    for field in POSITIVE:
        for bad in (0, -1):
            with pytest.raises(ValidationError, match=field):
                AppArgs.model_validate({field: bad})
        assert getattr(AppArgs.model_validate({field: 1}), field) == 1
    for field in NON_NEGATIVE:
        with pytest.raises(ValidationError, match=field):
            AppArgs.model_validate({field: -1})
        assert getattr(AppArgs.model_validate({field: 0}), field) == 0
    for field in ("max_queued_requests", "ingress_max_queued_requests"):
        assert getattr(AppArgs.model_validate({field: -1}), field) == -1  # no limit
        for bad in (0, -2):
            with pytest.raises(ValidationError, match=field):
                AppArgs.model_validate({field: bad})


def test_build_app_sets_backpressure_health_and_shutdown_options():
    from deployments import build_app

    app = build_app({"max_queued_requests": 7, "health_check_period_s": 2, "graceful_shutdown_timeout_s": 9})
    ingress = app._bound_deployment
    enc = ingress.init_args[0]._bound_deployment
    assert enc.max_queued_requests == 7 and ingress.max_queued_requests == 1024
    config = enc._deployment_config
    assert (config.health_check_period_s, config.graceful_shutdown_timeout_s) == (2, 9)
    assert ingress._deployment_config.backpressure_config.retry_after_s == 1.0


# ------------------------------------------------------------------------------------------ inputs


def _b64(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def test_open_input_checks_headers_before_decoding():
    png = encode(random_image("RGB", 60, 90), "PNG")
    opened = open_input(_b64(png), PP, max_image_bytes=10**6)
    assert opened.patches == (56 // 14) * (84 // 14) and opened.image._im is None  # opened, nothing decoded
    assert finish_input(opened, PP).shape == (56, 84, 3)
    with pytest.raises(ImageTooLargeError):
        open_input(png_bomb_header(30000, 30000), PP)  # header only: never decoded
    with pytest.raises(ImageTooLargeError):
        open_input(random_array(2000, 1001, 3), PP)  # arrays too
    with pytest.raises(RequestError) as info:
        open_input(_b64(png), PP, max_image_bytes=len(png) - 1)
    assert (info.value.status, info.value.code) == (413, "image_too_large")
    with pytest.raises(RequestError) as info:  # refused from the base64 length, before decoding
        open_input("A" * 4000, PP, max_image_bytes=1000)
    assert info.value.status == 413 and "estimated" in str(info.value)
    with pytest.raises(InvalidImageError, match="aspect ratio"):
        open_input(encode(random_image("L", 1, 1000), "PNG"), PP)
    with pytest.raises(ImageDecodeError, match="empty"):
        open_input(b"", PP)
    for data, media in ((encode(random_image("RGB", 16, 16), "ICO"), None), (b"<svg xmlns='x'/>", "image/svg+xml")):
        with pytest.raises(RequestError) as info:
            open_input(data if media is None else _b64(data, media), PP)
        assert (info.value.status, info.value.code) == (415, "unsupported_image_format")
    only_png = ingress_preprocess_config(PreprocessConfig(), 10**6, ["PNG"])
    with pytest.raises(RequestError) as info:
        open_input(encode(random_image("RGB", 16, 16), "JPEG"), only_png)
    assert info.value.status == 415 and "JPEG" in str(info.value)
    with pytest.raises(RequestError) as info:
        check_request_patches(5000, 4096)
    assert (info.value.status, info.value.code) == (413, "too_many_patches")


def test_an_image_of_exactly_max_image_bytes_is_accepted():
    png = encode(random_image("RGB", 60, 90), "PNG")
    for x in (png, _b64(png)):  # the bytes path and the data URL path
        assert open_input(x, PP, max_image_bytes=len(png)).data == png
        with pytest.raises(RequestError) as info:
            open_input(x, PP, max_image_bytes=len(png) - 1)
        assert (info.value.status, info.value.code) == (413, "image_too_large")


def test_phone_mpo_pictures_are_jpeg_to_the_allowlist():
    mpo = encode(random_image("RGB", 40, 50), "MPO", save_all=True, append_images=[random_image("RGB", 40, 50, 1)])
    opened = open_input(mpo, PP)
    assert opened.image.format == "MPO" and finish_input(opened, PP).ndim == 3


def test_only_allowed_plugins_parse_the_header(monkeypatch):
    """Bytes are opened with the allowlisted plugins only: no other parser sees what is accepted."""
    seen, real = [], Image.open

    def spy(fp, mode="r", formats=None):
        seen.append(formats)
        return real(fp, mode, formats)

    monkeypatch.setattr(Image, "open", spy)
    only_png = ingress_preprocess_config(PreprocessConfig(), 10**6, ["PNG"])
    open_input(encode(random_image("RGB", 16, 16), "PNG"), only_png)
    assert seen == [["PNG"]]


def test_request_parsing_and_content_type():
    assert parse_embedding_request(b'{"input": "abc"}').input == "abc"
    cases = [(b"{bad", 400), (b"[" * 5000, 400), (b"\xff\xfe", 400), (b"", 400), (b"[1]", 422),
             (b'{"input": []}', 422), (b'{"input": 1}', 422), (b'{"input": "a", "pooling": "max"}', 422)]  # fmt: skip
    for body, status in cases:
        with pytest.raises(RequestError) as info:
            parse_embedding_request(body)
        assert info.value.status == status, body
    for ok in (None, "application/json", "application/json; charset=utf-8", "application/vnd.api+json"):
        check_content_type(ok)
    for bad in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        with pytest.raises(RequestError) as info:
            check_content_type(bad)
        assert info.value.status == 415
    check_content_type("application/json", "identity")
    for encoding in ("gzip", "br, gzip"):  # broken: read as JSON, answered 400 "not valid JSON"
        with pytest.raises(RequestError, match=f"Content-Encoding '{encoding}' is not supported") as info:
            check_content_type("application/json", encoding)
        assert info.value.status == 415
    with pytest.raises(RequestError) as info:  # a misspelt extension is refused by name, not ignored
        parse_embedding_request(b'{"input": "a", "embeding_dtype": "bfloat16"}')
    assert (info.value.status, info.value.code, info.value.param) == (422, "invalid_schema", "embeding_dtype")
    assert "unknown field 'embeding_dtype'" in str(info.value)


# ------------------------------------------------------------------------------------------ error mapping


def test_error_mapping_table():
    cases = [
        (RequestError("k", ErrorCode.MISSING_API_KEY, None), 401, "authentication_error"),
        (RequestError("x", ErrorCode.REQUEST_TOO_LARGE, None), 413, "invalid_request_error"),
        (BackPressureError(5, 5, status_code=429, retry_after_s=2), 429, "rate_limit_error"),
        (BackPressureError(5, 5), 503, "server_error"),
        (ActorDiedError(), 503, "server_error"),
        (TimeoutError(), 504, "server_error"),
        (RuntimeError("bug"), 500, "server_error"),
    ]
    for exc, status, type_ in cases:
        error = classify(exc).error
        assert (error.status, error.type) == (status, type_), exc
    r = error_response(BackPressureError(5, 5, status_code=429), retry_after_s=1.5)
    assert r.status_code == 429 and r.headers["retry-after"] == "2"
    r = error_response(RequestError("no key", ErrorCode.MISSING_API_KEY, None))
    assert r.headers["www-authenticate"] == "Bearer" and b"no key" in r.body
    assert b"bug" not in error_response(RuntimeError("bug")).body  # no internals leak
    for exc, param in ((RequestError("x", ErrorCode.INVALID_POOLING, "pooling"), "pooling"), (RuntimeError(), None)):
        error = orjson.loads(error_response(exc).body)["error"]  # OpenAI's four keys, `param` included
        assert set(error) == {"message", "type", "param", "code"} and error["param"] == param and error["code"]


def test_every_error_code_has_its_documented_status_type_and_outcome():
    """The whole table, row by row (README "Errors"): one row mapped to another status, type or metrics outcome
    (a 408 answered 504, a drain refusal counted as a server error) changes what clients and dashboards see."""
    rows = {
        (400, "invalid_request_error", "client_error"): "INVALID_REQUEST INVALID_JSON INVALID_BASE64 INVALID_DATA_URL "
        "INVALID_IMAGE_URL URL_NOT_ALLOWED IMAGE_FETCH_FAILED INVALID_IMAGE INVALID_ARGUMENT INVALID_POOLING "
        "INVALID_DIMENSIONS INVALID_EMBEDDING_DTYPE INVALID_TEXT TEXT_NOT_SUPPORTED INVALID_LAYOUT INVALID_UUID "
        "EC_CACHE_NOT_CONFIGURED INVALID_VIDEO VIDEO_NOT_SUPPORTED",
        (401, "authentication_error", "client_error"): "MISSING_API_KEY INVALID_API_KEY",
        (404, "invalid_request_error", "client_error"): "MODEL_NOT_FOUND ROUTE_NOT_FOUND",
        (405, "invalid_request_error", "client_error"): "METHOD_NOT_ALLOWED",
        (408, "invalid_request_error", "timeout"): "REQUEST_TIMEOUT",
        (413, "invalid_request_error", "client_error"): "IMAGE_TOO_LARGE IMAGE_TOO_COMPLEX IMAGE_DECODE_TIMEOUT "
        "TOO_MANY_IMAGES TOO_MANY_PATCHES REQUEST_TOO_LARGE VIDEO_TOO_LARGE",
        (415, "invalid_request_error", "client_error"): "UNSUPPORTED_MEDIA_TYPE UNSUPPORTED_CONTENT_TYPE "
        "UNSUPPORTED_IMAGE_FORMAT",
        (422, "invalid_request_error", "client_error"): "INVALID_SCHEMA",
        (429, "rate_limit_error", "overloaded"): "RATE_LIMITED",
        (503, "server_error", "overloaded"): "OVERLOADED ENCODER_UNAVAILABLE SHUTTING_DOWN",
        (500, "server_error", "server_error"): "INTERNAL_ERROR",
        (504, "server_error", "timeout"): "TIMEOUT",
    }
    want = {name: row for row, names in rows.items() for name in names.split()}
    assert {e.name: (e.status, e.type, e.outcome) for e in ErrorCode} == want
    retried = {e.name for e in ErrorCode if e.retry_after}
    assert retried == {"RATE_LIMITED", "OVERLOADED", "ENCODER_UNAVAILABLE", "SHUTTING_DOWN"}


# ------------------------------------------------------------------------------------------ admission, retries


def test_admission_rejects_at_once_above_the_limit():
    gate = Admission(2)
    assert gate.try_enter() and gate.try_enter() and not gate.try_enter()
    gate.leave()
    assert gate.try_enter() and (gate.inflight, gate.peak, gate.rejected) == (2, 2, 1)
    with pytest.raises(ValueError):
        Admission(0)


def test_retries_only_unavailable_replicas_and_stop_at_the_bound():
    calls: list[int] = []

    def flaky(errors):
        async def call():
            calls.append(1)
            if errors:
                raise errors.pop(0)
            return "ok"

        return call

    async def run(errors, retries=3):
        calls.clear()
        return await call_with_retries(flaky(errors), retries, base_s=0.001)

    assert asyncio.run(run([ActorDiedError(), ActorUnavailableError("x", b"\0" * 16)])) == "ok" and len(calls) == 3
    with pytest.raises(RayActorError):
        asyncio.run(run([ActorDiedError()] * 5, retries=2))
    assert len(calls) == 3
    for error in (BackPressureError(1, 1), ImageDecodeError("bad"), RuntimeError("bug")):
        with pytest.raises(type(error)):
            asyncio.run(run([error]))
        assert len(calls) == 1


def test_rss_is_read_from_proc():
    before = rss_bytes()
    block = np.ones(64 * 2**20, dtype=np.uint8)  # 64 MiB touched
    assert rss_bytes() - before > 32 * 2**20
    del block


# ------------------------------------------------------------------------------------------ API key, URLs


def test_api_key_is_compared_in_constant_time_and_401_otherwise(monkeypatch):
    import hmac

    from deployments.ingress import security

    compared, constant_time = [], hmac.compare_digest

    def compare_digest(a, b):  # the constant-time comparison is what decides (a `==` passed this test before)
        compared.append((a, b))
        return constant_time(a, b)

    monkeypatch.setattr(security.hmac, "compare_digest", compare_digest)
    auth = ApiKeyAuth("s3cret")
    auth.check("Bearer s3cret")
    assert compared == [(b"s3cret", b"s3cret")]
    auth.check("bearer   s3cret ")
    for header, code in ((None, "missing_api_key"), ("", "missing_api_key"), ("Bearer", "invalid_api_key"),
                         ("Basic czNjcmV0", "invalid_api_key"), ("Bearer s3cre", "invalid_api_key"),
                         ("Bearer s3cret2", "invalid_api_key"), ("Bearer ñ", "invalid_api_key")):  # fmt: skip
        with pytest.raises(RequestError) as info:
            auth.check(header)
        assert (info.value.status, info.value.code) == (401, code), header
    ApiKeyAuth(None).check(None)  # no key configured: open
    assert ApiKeyAuth.from_args(AppArgs(), environ={"VISION_API_KEY": "env-key"}).enabled
    assert not ApiKeyAuth.from_args(AppArgs(), environ={}).enabled


def test_an_api_key_no_header_can_carry_is_refused_at_configuration():
    """Broken: a key outside printable ASCII was accepted and then never matched (Starlette reads header bytes as
    latin-1: a client's UTF-8 `clé` arrives as `clÃ©`), so every request got 401."""
    sent = "Bearer clé".encode().decode("latin-1")  # what the ingress sees of a UTF-8 client's header
    for key in ("clé", "two words", "tab\there"):
        with pytest.raises(ValidationError, match="api_key must be printable ASCII"):
            AppArgs(api_key=key)
        with pytest.raises(ConfigError, match="VISION_API_KEY: api_key must be printable ASCII"):
            ApiKeyAuth.from_args(AppArgs(), environ={"VISION_API_KEY": key})
    assert sent != "Bearer clé"
    assert not ApiKeyAuth.from_args(AppArgs(api_key=""), environ={}).enabled  # '' is no key, as before
    ApiKeyAuth("s3cr3t-!~/+=").check("Bearer s3cr3t-!~/+=")


def test_url_policy_allowlist_schemes_and_credentials():
    assert not UrlFetcher(()).enabled
    with pytest.raises(RequestError, match="not fetched"):
        UrlFetcher(()).check("https://example.com/a.png")
    fetcher = UrlFetcher(("img.example.com", "*.cdn.org", "10.0.0.5:8080"), schemes=("https",))
    fetcher.check("https://img.example.com/a.png")
    fetcher.check("https://IMG.example.com./a.png")
    fetcher.check("https://a.b.cdn.org/x")
    for bad in ("http://img.example.com/a.png", "https://evil.com/a.png", "https://cdn.org/x",
                "https://img.example.com.evil.com/", "https://user:pw@img.example.com/a.png",
                "https://10.0.0.5/x", "https://10.0.0.5:9090/x", "https://169.254.169.254/latest/meta-data",
                "https://img.example.com:99999/x", "file:///etc/passwd"):  # fmt: skip
        with pytest.raises(RequestError) as info:
            fetcher.check(bad)
        assert info.value.status == 400, bad
    assert host_allowed("10.0.0.5", 8080, ("10.0.0.5:8080",)) and not host_allowed("10.0.0.5", None, ("10.0.0.5:8080",))


def test_each_error_outcome_feeds_its_own_ingress_counter():
    """`ingress_stats()`'s error counters, by the outcome of the answer: 429/503 are `rejected`, 408/504 `timed_out`."""
    from deployments.metrics import IngressTelemetry

    telemetry = IngressTelemetry()
    for error in ErrorCode.RATE_LIMITED, ErrorCode.SHUTTING_DOWN, ErrorCode.ENCODER_UNAVAILABLE, ErrorCode.TIMEOUT:
        telemetry.answered(error.outcome)
    for error in ErrorCode.REQUEST_TIMEOUT, ErrorCode.INVALID_JSON, ErrorCode.INTERNAL_ERROR:
        telemetry.answered(error.outcome)
    counts = telemetry.snapshot()
    assert {k: counts[k] for k in ("rejected", "timed_out", "client_errors", "server_errors")} == {
        "rejected": 3, "timed_out": 2, "client_errors": 1, "server_errors": 1,
    }  # fmt: skip


def test_url_fetch_enforces_the_byte_limit_while_reading():
    """A server that sends no Content-Length (or lies) is cut off once the body passes `max_image_bytes`; a body of
    exactly the limit is read whole."""
    import httpx

    def fetch(body: bytes) -> bytes:
        async def main():
            fetcher = UrlFetcher(("img.example.com",), max_bytes=8)

            async def chunks():  # streamed, no Content-Length
                yield body[:5]
                yield body[5:]

            fetcher._client = httpx.AsyncClient(
                transport=httpx.MockTransport(lambda request: httpx.Response(200, content=chunks()))
            )
            return (await fetcher.fetch("https://img.example.com/a.png"))[0]

        return asyncio.run(main())

    assert fetch(b"12345678") == b"12345678"
    with pytest.raises(RequestError) as info:
        fetch(b"123456789")
    assert info.value.error is ErrorCode.IMAGE_TOO_LARGE


def test_urls_with_control_characters_or_too_long_are_400_before_any_fetch():
    """A tab, CR, LF, NUL or DEL anywhere in an allowlisted URL, or a URL over `MAX_URL_CHARS`, is 400
    `invalid_image_url` naming the problem (httpx's InvalidURL made them 500 internal_error)."""
    from deployments.ingress.security import MAX_URL_CHARS

    fetcher = UrlFetcher(("example.com",), timeout_s=0.01)
    bad = {f"https://example.com/a{c}b.png": f"U+{ord(c):04X}" for c in "\t\r\n\x00\x7f"}
    bad["https://exa\tmple.com/a.png"] = "U+0009"
    bad["https://example.com/" + "a" * 2**16] = f"over the limit of {MAX_URL_CHARS}"
    for url, named in bad.items():
        with pytest.raises(RequestError) as info:
            asyncio.run(fetcher.fetch(url))
        error = info.value
        assert (error.status, error.code, error.param) == (400, "invalid_image_url", "input"), url[:40]
        assert named in str(error) and len(str(error)) < 300, str(error)[:300]
    fetcher.check("https://example.com/" + "a" * (MAX_URL_CHARS - 20))
