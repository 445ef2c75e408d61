"""`openai_api.parse_embedding_request` against hostile bodies: its cost is linear in the body and its error
answers echo at most `ECHO_LIMIT` characters of what the client sent (issue 44, cases 2 and 9)."""

from __future__ import annotations

import time

import pytest

from deployments.errors import ECHO_LIMIT, ErrorCode, RequestError
from deployments.ingress.openai_api import error_response, parse_embedding_request


def refused(body: bytes) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse_embedding_request(body)
    return info.value


def test_a_field_bomb_is_refused_in_time_linear_in_its_size():
    """200,000 unknown fields in 2 MB: a 422 naming the first few and the count, in well under a second per MiB
    (the per-field error list made it quadratic: 22,000 fields took 13 s, 200,000 would take hours)."""
    body = ("{" + ",".join(f'"f{i}":1' for i in range(200_000)) + ',"input":"x"}').encode()
    assert len(body) > 2_000_000
    started = time.perf_counter()
    error = refused(body)
    elapsed = time.perf_counter() - started
    assert elapsed < 10, elapsed  # linear: ~0.1 s on a shared CPU
    assert (error.status, error.code, error.param) == (422, "invalid_schema", "f0")
    assert "200000 unknown fields 'f0', 'f1', 'f2', 'f3', 'f4', ..." in str(error), str(error)
    assert len(str(error)) < 1000


def test_a_million_bad_input_items_make_one_error():
    """A 2 MB list of non-strings stops at the first (a million error dicts took 4 s)."""
    started = time.perf_counter()
    error = refused(b'{"input":[' + b",".join([b"1"] * 1_000_000) + b"]}")
    assert time.perf_counter() - started < 10
    item = 'a string or a {"text": ...} / {"image": ...} object'
    assert (error.status, str(error)) == (422, f"input[0] must be {item}")


def test_unknown_fields_are_named_beside_other_schema_errors_or_alone():
    error = refused(b'{"input": "a", "poolling": "none"}')
    assert (error.status, error.param) == (422, "poolling") and "unknown field 'poolling'" in str(error)
    error = refused(b'{"input": [], "poolling": "none"}')
    assert error.status == 422 and "input is an empty list" in str(error), str(error)
    assert parse_embedding_request(b'{"input": "a", "user": "u"}').user == "u"


def test_a_huge_field_name_is_not_echoed_in_param_or_message():
    name = "x" * 2**20
    error = refused(b'{"input": "a", "' + name.encode() + b'": 1}')
    assert error.status == 422
    assert len(error.param) <= ECHO_LIMIT + 1 and error.param.startswith("xxx"), len(error.param)
    assert len(str(error)) < 1000
    response = error_response(error)
    assert response.status_code == 422 and len(response.body) < 2000, len(response.body)


def test_error_answers_cap_any_param():
    response = error_response(RequestError("bad", ErrorCode.INVALID_SCHEMA, "p" * 5000))
    assert len(response.body) < 500, response.body[:200]
