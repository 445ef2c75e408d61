"""Text in `POST /v1/embeddings` and `embed_text`, against fake encoder clients without Serve (fast): `input` items
(`{"text"}` / `{"image"}` objects, `input_type`), mixed requests answered in order, `usage.prompt_tokens`, the text
errors (400 / 422 with their codes, naming the item), text pooling, and `input_items` alone. End to end:
tests/integration/serve/test_serve_text.py."""

from __future__ import annotations

import asyncio

import numpy as np
import orjson
import pytest
from starlette.requests import Request

from deployments.config import AppArgs
from deployments.errors import RequestError
from deployments.ingress.handle_calls import HandleCalls
from deployments.ingress.http_routes import HttpRoutes
from deployments.ingress.limits import Admission
from deployments.ingress.openai_api import input_items
from deployments.ingress.security import ApiKeyAuth
from deployments.metrics import IngressTelemetry
from encoder.errors import InvalidArgumentError
from tests.unit.deployments.ingress.test_http_routes_units import FakeDecoder, error_of, post

SEQ_LEN = 16


class TextClient:
    """An encoder that takes text: an image is [4] of 1000 + its position among the images, a text [4] of its
    length (its "real tokens" too); records the text calls."""

    def __init__(self, text: bool = True):
        self.text = text
        self.text_calls: list[tuple[list[str], str]] = []

    async def info(self) -> dict:
        text = {"seq_len": SEQ_LEN, "max_batch_texts": 8, "output_dims": {"model": 4, "model-l2": 4}}
        return {
            "vector_pooling": "model",
            "output_dims": {"model": 4, "mean": 4, "none": 4},
            "preprocess_config": None,
            "text": text if self.text else None,
        }

    async def encode(self, arrays, pooling, llm, deadline):
        return [np.full(4, 1000 + i, np.float32) for i in range(len(arrays))], 10 * len(arrays)

    async def encode_texts(self, texts, pooling, deadline):
        self.text_calls.append((list(texts), pooling))
        return [(np.full(4, len(t), np.float32), len(t)) for t in texts]


def routes(client=None, **args) -> HttpRoutes:
    client = client or TextClient()
    return HttpRoutes(AppArgs(**args), client, FakeDecoder(), Admission(4), ApiKeyAuth(None), IngressTelemetry(), None)


def vectors(body: dict) -> list[float]:
    return [d["embedding"][0] for d in body["data"]]


def test_items_are_split_by_kind_and_answered_in_input_order():
    client = TextClient()
    status, body = post(routes(client), {"input": [{"text": "abc"}, "img0", {"image": "img1"}, {"text": "hello"}]})
    assert status == 200, body
    assert [d["index"] for d in body["data"]] == [0, 1, 2, 3]
    assert vectors(body) == [3.0, 1000.0, 1001.0, 5.0]
    assert client.text_calls == [(["abc", "hello"], "model")]  # one text call, the texts in order
    assert body["usage"] == {"prompt_tokens": 20 + 3 + 5, "total_tokens": 28}  # patches + real text tokens


def test_input_type_text_makes_plain_strings_texts():
    """What `client.embeddings.create(input=[...], extra_body={"input_type": "text"})` sends."""
    client = TextClient()
    status, body = post(routes(client), {"input": ["a red bicycle", {"image": "x"}], "input_type": "text",
                                         "model": "tiny", "encoding_format": "float"})  # fmt: skip
    assert status == 200 and vectors(body) == [13.0, 1000.0], body
    status, body = post(routes(client), {"input": "one text", "input_type": "text"})
    assert status == 200 and vectors(body) == [8.0] and body["usage"]["prompt_tokens"] == 8, body
    error_of(*post(routes(), {"input": "a", "input_type": "audio"}), 422, "invalid_schema", "input_type")


def test_text_errors_are_400s_naming_the_item():
    r = routes()
    error_of(*post(r, {"input": ["img", {"text": ""}]}), 400, "invalid_text", "input[1]")
    status, body = post(r, {"input": ["", "b"], "input_type": "text"})
    error_of(status, body, 400, "invalid_text", "input[0]")
    assert body["error"]["message"] == "input[0]: the text is an empty string"
    for bad in (5, None, ["a"], {"t": 1}):
        status, body = post(r, {"input": [{"text": bad}]})
        error_of(status, body, 400, "invalid_text", "input[0]")
        assert "a text must be a string" in body["error"]["message"], body
    error_of(*post(r, {"input": [{"text": "a", "image": "b"}]}), 422, "invalid_schema", "input[0]")
    error_of(*post(r, {"input": [{"texts": "a"}]}), 422, "invalid_schema", "input[0]")
    error_of(*post(r, {"input": ["a", {"image": 3}]}), 422, "invalid_schema", "input[1]")


def test_text_on_a_model_without_a_text_tower_is_text_not_supported():
    for body in ({"input": [{"text": "a cat"}]}, {"input": "a cat", "input_type": "text"}):
        status, answer = post(routes(TextClient(text=False)), body)
        error_of(status, answer, 400, "text_not_supported", "input")
        assert "takes no text" in answer["error"]["message"]
    assert post(routes(TextClient(text=False)), {"input": ["img"]})[0] == 200  # images as before


def test_text_off_for_the_deployment_is_text_not_supported_saying_so():
    """`text=false`: a text request is 400 `text_not_supported` saying text is off (not that the model lacks it),
    before any encoder call, even where the replica could take text; images are served; /v1/models lists no
    text."""
    client = TextClient()  # an encoder that would take text
    for body in ({"input": [{"text": "a cat"}, "img"]}, {"input": "a cat", "input_type": "text"}):
        status, answer = post(routes(client, text=False), body)
        error_of(status, answer, 400, "text_not_supported", "input")
        assert answer["error"]["message"] == (
            "text is off for this deployment: it serves the model 'tiny' for images only (application argument "
            "text=false)"
        )
    assert client.text_calls == []
    status, body = post(routes(client, text="false"), {"input": ["img"]})  # `serve run ... text=false`
    assert status == 200 and vectors(body) == [1000.0]
    with pytest.raises(RequestError, match="text is off for this deployment") as info:
        asyncio.run(HandleCalls(AppArgs(text=False), client, FakeDecoder(), Admission(4), IngressTelemetry())
                    .text(["a"], None))  # fmt: skip
    assert info.value.code == "text_not_supported" and client.text_calls == []

    request = Request({"type": "http", "method": "GET", "path": "/v1/models", "headers": []})
    listed = orjson.loads(asyncio.run(routes(client, text=False).models(request)).body)
    assert listed["data"][0]["input_types"] == ["image"]  # the encoder could, the deployment does not
    listed = orjson.loads(asyncio.run(routes(client).models(request)).body)
    assert listed["data"][0]["input_types"] == ["image", "text"]


def test_the_text_argument_is_a_bool():
    assert AppArgs().text is True and AppArgs(text="off").text is False and AppArgs(model={"text": 0}).text is False
    with pytest.raises(ValueError, match="text"):
        AppArgs(text="maybe")
    with pytest.raises(ValueError, match="text"):
        AppArgs(model={"text": "sometimes"})


def test_text_pooling_is_model_or_model_l2_and_an_image_only_pooling_is_a_clear_400():
    client = TextClient()
    assert post(routes(client), {"input": [{"text": "a"}], "pooling": "model-l2"})[0] == 200
    assert client.text_calls[-1] == (["a"], "model-l2")
    for pooling in ("mean", "none", "mean-l2"):
        status, body = post(routes(), {"input": [{"text": "a"}, "img"], "pooling": pooling})
        error_of(status, body, 400, "invalid_pooling", "pooling")
        assert (
            body["error"]["message"] == f"pooling {pooling!r} applies to images only; text items take model or model-l2"
        )
    assert post(routes(), {"input": ["img"], "pooling": "mean"})[0] == 200  # an image-only request keeps it


def test_dimensions_and_the_item_limit_count_texts():
    assert post(routes(), {"input": [{"text": "a"}], "dimensions": 4})[0] == 200
    error_of(*post(routes(), {"input": [{"text": "a"}], "dimensions": 8}), 400, "invalid_dimensions", "dimensions")
    status, body = post(routes(max_request_images=2), {"input": ["a", "b", "c"], "input_type": "text"})
    error_of(status, body, 413, "too_many_images", "input")
    assert body["error"]["message"] == "3 texts in one request; the limit is 2"


def test_input_items_alone():
    assert input_items("x") == (["x"], [], ["image"], [])
    assert input_items("x", "text") == ([], ["x"], ["text"], [])
    items = input_items(["a", {"text": "t"}, {"image": "i"}], "text")
    assert items == (["i"], ["a", "t"], ["text", "text", "image"], []) and items.positions("image") == [2]
    with pytest.raises(RequestError, match=r"input: the text is an empty string"):
        input_items("", "text")


def handles(client=None) -> HandleCalls:
    return HandleCalls(AppArgs(), client or TextClient(), FakeDecoder(), Admission(4), IngressTelemetry())


def test_embed_text_returns_one_vector_per_text_and_raises_the_encoders_errors():
    got = asyncio.run(handles().text(["a", "abcd"], None))
    assert [v.tolist() for v in got] == [[1.0] * 4, [4.0] * 4] and all(v.dtype == np.float32 for v in got)
    assert [v.tolist() for v in asyncio.run(handles().text("abc", "model-l2"))] == [[3.0] * 4]
    with pytest.raises(InvalidArgumentError, match=r"texts\[1\] is an empty string"):
        asyncio.run(handles().text(["a", ""], None))
    with pytest.raises(InvalidArgumentError, match=r"texts\[0\] must be a string"):
        asyncio.run(handles().text([b"a"], None))
    with pytest.raises(RequestError, match="takes no text") as info:
        asyncio.run(handles(TextClient(text=False)).text(["a"], None))
    assert info.value.code == "text_not_supported"
    with pytest.raises(RequestError, match="applies to images only"):
        asyncio.run(handles().text(["a"], "mean"))
    with pytest.raises(InvalidArgumentError, match="unknown pooling"):
        asyncio.run(handles().text(["a"], "max"))
    assert asyncio.run(handles().text([], None)) == []
