"""FP8 on request as the service and batch jobs take it: `AppArgs.quantization`, the replica's ready line and
`/v1/models`, the batch CLI's `--quantization` and `EmbedOptions`. No GPU: the encoder side (the
arithmetic, the conversion, `encoder.load`'s refusals) is tests/unit/encoder/models/test_fp8.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import orjson
import pytest
import torch
from pydantic import ValidationError
from starlette.requests import Request

from deployments.batch.__main__ import parse_args
from deployments.batch.job import job_params
from deployments.batch.options import EmbedOptions
from deployments.config import AppArgs
from deployments.replica.deployment import precision
from encoder.errors import InvalidArgumentError
from tests.unit.deployments.ingress.test_http_routes_units import routes


def test_app_args_take_fp8_or_nothing():
    assert AppArgs().quantization is None
    assert AppArgs(quantization="fp8").quantization == "fp8"
    assert AppArgs.model_validate({"model": {"model": "tiny", "quantization": "fp8"}}).quantization == "fp8"
    assert AppArgs(quantization="fp8", dtype="bf16", device="cuda").quantization == "fp8"
    for bad in ("int8", "FP8", "fp4", 8):
        with pytest.raises(ValidationError) as err:
            AppArgs(quantization=bad)
        assert [e["loc"][-1] for e in err.value.errors()] == ["quantization"], err.value


@pytest.mark.parametrize(
    ("args", "words"),
    [
        ({"device": "cpu"}, "needs a CUDA GPU; device is 'cpu'"),
        ({"dtype": "float16"}, "runs with dtype bfloat16 only, not 'float16'"),
    ],
)
def test_app_args_refuse_fp8_where_the_arguments_alone_rule_it_out(args, words):
    with pytest.raises(ValidationError, match=words):
        AppArgs(quantization="fp8", **args)


def test_the_ready_line_and_describe_say_fp8():
    assert precision(SimpleNamespace(dtype=torch.bfloat16, quantization=None)) == "bfloat16"
    assert precision(SimpleNamespace(dtype=torch.bfloat16, quantization="fp8")) == "bfloat16 with fp8 block linears"


def test_v1_models_says_the_quantization():
    request = Request({"type": "http", "method": "GET", "path": "/v1/models", "headers": []})
    for quantization in (None, "fp8"):
        args = {"device": "cuda", "quantization": quantization} if quantization else {}
        (listed,) = orjson.loads(asyncio.run(routes(**args).models(request)).body)["data"]
        assert listed["quantization"] == quantization


def test_batch_cli_takes_quantization_fp8():
    base = ["--input", "in.parquet", "--output", "out"]
    assert parse_args(base).quantization is None
    assert parse_args([*base, "--quantization", "fp8"]).quantization == "fp8"
    with pytest.raises(SystemExit):
        parse_args([*base, "--quantization", "int8"])


def test_batch_options_refuse_fp8_on_cpu_actors_or_another_dtype():
    assert EmbedOptions.of(quantization="fp8").quantization == "fp8"
    with pytest.raises(InvalidArgumentError, match="quantization 'fp8' needs GPU encoder actors; num_gpus is 0"):
        EmbedOptions.of(quantization="fp8", num_gpus=0)
    with pytest.raises(InvalidArgumentError, match="bfloat16 only"):
        EmbedOptions.of(quantization="fp8", dtype="float32")
    with pytest.raises(InvalidArgumentError, match="quantization"):
        EmbedOptions.of(quantization="int8")


def test_a_job_manifest_names_quantization_only_when_set():
    """An fp8 job's output differs from a bf16 one's, so its parameters differ; jobs run before the option
    existed keep their parameters (a re-run still matches)."""
    base = parse_args(["--input", "in.parquet", "--output", "out"])
    fp8 = parse_args(["--input", "in.parquet", "--output", "out", "--quantization", "fp8"])
    assert "quantization" not in job_params(base, [], 100)
    assert job_params(fp8, [], 100)["quantization"] == "fp8"


def test_batch_cli_refuses_fp8_on_cpu_actors_with_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--input", "in.parquet", "--output", "out", "--quantization", "fp8", "--num-gpus", "0"])
    assert exit_.value.code == 2
    assert "quantization 'fp8' needs GPU encoder actors; num_gpus is 0" in capsys.readouterr().err
