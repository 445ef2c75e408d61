"""`HttpRoutes` (the ingress's HTTP routes) against a fake encoder client and decoder, without Serve (fast): the
checks of `POST /v1/embeddings` before and after the encoder call, and `/v1/models`. End to end: test_serve.py."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import orjson
from starlette.requests import Request

from deployments.config import AppArgs
from deployments.ingress.http_routes import HttpRoutes
from deployments.ingress.limits import Admission
from deployments.ingress.openai_api import EmbeddingRequest
from deployments.ingress.security import ApiKeyAuth
from deployments.llm_outputs import to_wire
from deployments.metrics import IngressTelemetry
from encoder.poolings import POOLINGS

DIMS = {"mean": 4, "none": 4}


class FakeClient:
    """The encoder: per image a [4] vector (pooled) or a 2 x 4 token matrix in the wire dtype (pooling none)."""

    async def info(self) -> dict:
        return {"vector_pooling": "mean", "output_dims": DIMS, "preprocess_config": None}

    async def encode(self, arrays, pooling, llm, deadline):
        if llm is None:
            return [np.full(4, i, np.float32) for i in range(len(arrays))], 7
        return [(to_wire(np.full((2, 4), 1.5, np.float32), llm), [], (1, 4, 2)) for _ in arrays], 7


class FakeDecoder:
    async def prepare(self, inputs, pp, where, max_patches, reserve):
        return list(inputs)


def routes(**args) -> HttpRoutes:
    a = AppArgs(**args)
    return HttpRoutes(
        a, FakeClient(), FakeDecoder(), Admission(4), ApiKeyAuth(None), IngressTelemetry(), None, None
    )  # fmt: skip


def post(r: HttpRoutes, body: dict) -> tuple[int, dict]:
    data = orjson.dumps(body)
    sent = []

    async def receive():
        if sent:
            return {"type": "http.disconnect"}
        sent.append(1)
        return {"type": "http.request", "body": data, "more_body": False}

    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    request = Request({"type": "http", "method": "POST", "path": "/v1/embeddings", "headers": headers}, receive)
    response = asyncio.run(r.embeddings(request))
    return response.status_code, orjson.loads(response.body)


def error_of(status: int, body: dict, want_status: int, code: str, param: str | None) -> None:
    assert status == want_status, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body  # OpenAI's four keys, param too
    assert (body["error"]["code"], body["error"]["param"]) == (code, param), body


def test_the_model_name_must_be_the_served_one_exactly():
    """`model` is the served name or absent: not a prefix of it, nor the name in another case (OpenAI's ids are
    case-sensitive; a client naming another model must not be answered by this one)."""
    r = routes(served_model_name="Tiny-VL")
    for ok in ({}, {"model": "Tiny-VL"}):
        status, body = post(r, {"input": ["a"], **ok})
        assert status == 200 and body["model"] == "Tiny-VL", body
    for other in ("tiny-vl", "Tiny", "Tiny-VL-2", ""):
        error_of(*post(r, {"input": ["a"], "model": other}), 404, "model_not_found", "model")


def test_the_image_limit_lets_exactly_max_request_images_in():
    r = routes(max_request_images=3)
    status, body = post(r, {"input": ["a", "b", "c"]})
    assert status == 200 and [d["index"] for d in body["data"]] == [0, 1, 2], body
    assert [d["embedding"][0] for d in body["data"]] == [0.0, 1.0, 2.0]  # each index is its own image's
    assert body["usage"] == {"prompt_tokens": 7, "total_tokens": 7}
    error_of(*post(r, {"input": ["a"] * 4}), 413, "too_many_images", "input")


def test_pooling_and_dimensions_are_checked_against_the_model():
    r = routes()
    assert post(r, {"input": "a", "dimensions": 4})[0] == 200
    for dim in (3, 5, 0):
        error_of(*post(r, {"input": "a", "dimensions": dim}), 400, "invalid_dimensions", "dimensions")
    error_of(*post(r, {"input": "a", "pooling": "model"}), 400, "invalid_pooling", "pooling")


def test_pooling_names_of_any_family_pass_the_schema_and_the_models_own_are_served():
    """The rule: the schema takes every family's pooling names (`encoder.poolings.POOLINGS`); a name of no family
    is 422 invalid_schema; a name the served model does not offer ('model' for Qwen) is 400 invalid_pooling,
    naming the pooling, the model and its poolings. Broken: that message said neither the model nor 'poolings'."""
    r = routes(served_model_name="tiny-qwen")
    assert set(EmbeddingRequest.model_fields["pooling"].annotation.__args__[0].__args__) == set(POOLINGS)
    for pooling in POOLINGS:
        status, body = post(r, {"input": "a", "pooling": pooling})
        if pooling in DIMS:
            assert status == 200, body
            continue
        error_of(status, body, 400, "invalid_pooling", "pooling")
        assert body["error"]["message"] == (
            f"pooling {pooling!r} is not offered by the served model 'tiny-qwen'; its poolings: mean, none"
        )
    status, body = post(r, {"input": "a", "pooling": "max"})
    error_of(status, body, 422, "invalid_schema", "pooling")
    assert "pooling" in body["error"]["message"] and "'model-l2'" in body["error"]["message"]


def test_an_unknown_field_is_a_422_naming_it():
    error_of(*post(routes(), {"input": "a", "poolling": "none"}), 422, "invalid_schema", "poolling")


def test_pooling_none_base64_answers_are_in_the_asked_embedding_dtype():
    for dtype, size in (("float32", 4), ("float16", 2), ("bfloat16", 2)):
        body = {"input": "a", "pooling": "none", "encoding_format": "base64", "embedding_dtype": dtype}
        status, answer = post(routes(), body)
        (item,) = answer["data"]
        assert status == 200 and item["shape"] == [2, 4] and item["grid_thw"] == [1, 4, 2], answer
        raw = base64.b64decode(item["embedding"])
        assert len(raw) == 8 * size, dtype
        want = {"float32": "<f4", "float16": "<f2", "bfloat16": "<u2"}[dtype]
        np.testing.assert_array_equal(np.frombuffer(raw, want), to_wire(np.full(8, 1.5, np.float32), dtype))


def test_models_name_the_served_model_and_retrieve_it_by_its_exact_id():
    r = routes(model="tiny", served_model_name="vision-x")
    request = Request({"type": "http", "method": "GET", "path": "/v1/models", "headers": []})
    listed = orjson.loads(asyncio.run(r.models(request)).body)
    assert [(m["id"], m["object"], m["random_weights"]) for m in listed["data"]] == [("vision-x", "model", True)]
    got = asyncio.run(r.model(request, "vision-x"))
    assert got.status_code == 200 and orjson.loads(got.body) == listed["data"][0]
    for other in ("vision", "Vision-X", "tiny", "vision-x/"):
        response = asyncio.run(r.model(request, other))
        error_of(response.status_code, orjson.loads(response.body), 404, "model_not_found", "model")


def test_health_is_503_unless_an_encoder_replica_serves_and_names_the_served_model():
    r = routes(model="tiny", served_model_name="vision-x")
    warmed = []
    r._decoder.warm = warmed.append
    for ready, status, code in ((True, "ok", 200), (False, "starting", 503)):

        async def readiness(ready=ready, status=status):
            return ready, {"status": status}

        r.readiness = readiness
        response = asyncio.run(r.health())
        assert response.status_code == code and orjson.loads(response.body) == {"status": status, "model": "vision-x"}
    assert warmed == [None]  # the decode processes start once a replica can serve, not before
