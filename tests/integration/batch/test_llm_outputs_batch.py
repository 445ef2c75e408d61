"""LLM-ready outputs in batch jobs (issue 14): `--pooling none` writes the patch grid (`grid_t`, `grid_h`,
`grid_w`, `grid_thw`) and, for DeepStack models, a `deepstack` column; both equal `VisionEncoder.encode_llm`.

The actor tests need no Ray; the CLI test shares the session's Ray instance (`tests.serve_fixtures`).
"""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import encoder
from deployments.batch import EncoderActor, decode_batch, output_schema
from deployments.batch.job import JobConfig, resolve_part_rows
from deployments.batch.model_facts import deepstack_layers, preprocess_config_for
from encoder.loading.presets import PRESETS, preset
from tests.batch_data import cli, make_rows, read_output

DEEPSTACK_MODEL = "tiny-qwen3-vl"
MODELS = [
    "tiny",
    "tiny-clip",
    pytest.param(DEEPSTACK_MODEL, marks=pytest.mark.skipif(DEEPSTACK_MODEL not in PRESETS, reason="no preset yet")),
]
REL_TOL = 1e-4  # as tests/batch_data.py: batched vs one-by-one float32 sums; wrong rows differ by O(1)


def assert_close(got, want) -> None:
    got, want = np.asarray(got, dtype=np.float32), want.numpy()
    assert got.shape == want.shape
    assert float(np.abs(got - want).max()) <= REL_TOL * max(float(np.abs(want).max()), 1e-6)


def check_rows(out: pa.Table, ids: list[int], images: dict[int, bytes], bad: set[int], model: str) -> None:
    """Every good row equals `encode_llm` of its image; error rows are null / 0."""
    ref = encoder.load(model)
    m = ref.config.spatial_merge_size
    layers = deepstack_layers(ref.config)
    good = [i for i in ids if i not in bad]
    want = dict(zip(good, ref.encode_llm([images[i] for i in good]), strict=True))
    for row in out.to_pylist():
        i = row["id"]
        if i in bad:
            assert row["error"] and row["embedding"] is None and row["grid_thw"] is None
            assert row["num_tokens"] == row["grid_t"] == row["grid_h"] == row["grid_w"] == 0
            assert row.get("deepstack") is None
            continue
        w = want[i]
        t, h, wd = w.grid_thw
        assert row["error"] is None and row["grid_thw"] == [t, h, wd]
        assert (row["grid_t"], row["grid_h"], row["grid_w"]) == (t, h, wd)  # the patch grid: HF image_grid_thw
        assert row["num_tokens"] == t * h * wd // (m * m) == w.tokens.shape[0]
        assert_close(row["embedding"], w.tokens)
        if layers:
            assert len(row["deepstack"]) == layers == len(w.deepstack)
            for got, ref_layer in zip(row["deepstack"], w.deepstack, strict=True):
                assert_close(got, ref_layer)
        else:
            assert "deepstack" not in row


@pytest.mark.parametrize("model", MODELS)
def test_actor_per_token_columns_equal_encode_llm(model):
    pp = preprocess_config_for(model)
    ids, images, bad = make_rows(7, seed=7, corrupt_every=2)  # 7 good rows, 7 kinds of bad ones
    table = pa.table({"id": ids, "image": pa.array(images, pa.binary())})
    decoded = decode_batch(table, image_column="image", pp=pp, path_root=None)
    actor = EncoderActor(model, "none", "256,512" if model == "tiny-clip" else None, preprocess_config=pp)
    out = actor(decoded)
    layers = deepstack_layers(preset(model))
    assert (layers > 0) == (model == DEEPSTACK_MODEL)
    assert out.schema == output_schema(table.schema, "image", "none", actor.dim, layers)
    if layers:
        assert out.schema.field("deepstack").type == pa.list_(pa.list_(pa.list_(pa.float32(), actor.dim)))
    assert out.schema.field("grid_thw").type == pa.list_(pa.int32(), 3)
    check_rows(out, ids, dict(zip(ids, images, strict=True)), bad, model)


def test_default_part_rows_shrink_with_deepstack_layers():
    def rows(model, pooling="none"):
        return resolve_part_rows(JobConfig(input=[], output="", model=model, pooling=pooling))

    assert rows("tiny") == 1_000 and rows("tiny", "mean") == 10_000
    if DEEPSTACK_MODEL in PRESETS:
        assert rows(DEEPSTACK_MODEL) == 1_000 // (1 + deepstack_layers(preset(DEEPSTACK_MODEL)))


@pytest.mark.slow
@pytest.mark.parametrize(
    "model", [pytest.param(DEEPSTACK_MODEL if DEEPSTACK_MODEL in PRESETS else "tiny", id="deepstack-or-tiny")]
)
def test_cli_per_token_writes_grid_and_deepstack_columns(ray_cluster, tmp_path, model):
    ids, images, bad = make_rows(11, seed=9, corrupt_every=2)
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": ids, "image": pa.array(images, pa.binary())}), src, row_group_size=16)
    out = tmp_path / "out"
    assert cli("--input", src, "--output", out, "--model", model, "--pooling", "none", "--part-rows", 8) == 0
    result = read_output(out)
    assert sorted(result.column("id").to_pylist()) == ids
    layers = deepstack_layers(preset(model))
    expected = ["id", "embedding", "num_tokens", "grid_t", "grid_h", "grid_w", "grid_thw"]
    assert result.column_names == expected + (["deepstack"] if layers else []) + ["error"]
    check_rows(result, ids, dict(zip(ids, images, strict=True)), bad, model)


# ------------------------------------------------------------------------------------------ vLLM's forms (issue 47)

VLLM_MODELS = ["tiny", pytest.param(DEEPSTACK_MODEL, marks=pytest.mark.skipif(DEEPSTACK_MODEL not in PRESETS,
                                                                                reason="no preset yet"))]  # fmt: skip


@pytest.mark.parametrize("model", VLLM_MODELS)
def test_actor_vllm_layout_is_the_tokens_then_each_deepstack_layer(model):
    pp = preprocess_config_for(model)
    ids, images, bad = make_rows(7, seed=3, corrupt_every=2)
    table = pa.table({"id": ids, "image": pa.array(images, pa.binary())})
    actor = EncoderActor(model, None, preprocess_config=pp, layout="vllm")  # pooling none implied
    out = actor(decode_batch(table, image_column="image", pp=pp, path_root=None))
    layers = deepstack_layers(preset(model))
    assert out.schema == output_schema(table.schema, "image", "none", actor.dim, layers, layout="vllm")
    assert "deepstack" not in out.column_names
    ref = encoder.load(model)
    good = [i for i in ids if i not in bad]
    want = dict(zip(good, ref.encode_llm([dict(zip(ids, images, strict=True))[i] for i in good]), strict=True))
    for row in out.to_pylist():
        if row["id"] in bad:
            assert row["embedding"] is None and row["error"]
            continue
        w = want[row["id"]]
        got = np.asarray(row["embedding"], np.float32)
        assert got.shape == (w.tokens.shape[0], actor.dim * (1 + layers)) and row["grid_thw"] == list(w.grid_thw)
        for k, part in enumerate([w.tokens, *w.deepstack]):  # column block k is part k, in model order
            assert_close(got[:, k * actor.dim : (k + 1) * actor.dim], part)


@pytest.mark.parametrize("model", VLLM_MODELS)
def test_actor_ec_cache_writes_the_file_vllm_loads_and_a_bad_uuid_is_an_error_row(model, tmp_path):
    import torch
    from safetensors.torch import load_file

    pp = preprocess_config_for(model)
    ids, images, bad = make_rows(7, seed=5, corrupt_every=2)
    uuids = [f"u-{i}" for i in ids]
    uuids[0] = "../escape"  # a good image with an unsafe uuid: an error row, no file
    table = pa.table({"id": ids, "image": pa.array(images, pa.binary()), "uuid": uuids})
    actor = EncoderActor(model, None, preprocess_config=pp, ec_cache_dir=str(tmp_path), uuid_column="uuid")
    out = actor(decode_batch(table, image_column="image", pp=pp, path_root=None))
    layers = deepstack_layers(preset(model))
    assert out.schema == output_schema(table.schema, "image", "none", actor.dim, layers, ec_cache=True)
    assert "embedding" not in out.column_names and "deepstack" not in out.column_names
    ref = encoder.load(model)
    by_id = dict(zip(ids, images, strict=True))
    rows = out.to_pylist()
    assert ids[0] not in bad and "ec_cache" in rows[0]["error"] and rows[0]["ec_cache"] is None
    written = []
    for row in rows[1:]:
        if row["id"] in bad:
            assert row["ec_cache"] is None and row["error"]
            continue
        (w,) = ref.encode_llm([by_id[row["id"]]])
        assert row["ec_cache"] == str(tmp_path / row["uuid"] / "encoder_cache.safetensors") and row["error"] is None
        tensor = load_file(row["ec_cache"])["ec_cache"]
        assert tensor.dtype == torch.float32  # the CPU tower's dtype
        assert_close(tensor, w.vllm_embeds())
        written.append(row["uuid"])
    assert written and sorted(os.listdir(tmp_path)) == sorted(written)


def test_vllm_options_are_checked_before_anything_runs(tmp_path):
    from deployments.batch.options import EmbedOptions
    from encoder.errors import InvalidArgumentError

    for bad, match in (
        ({"ec_cache_dir": str(tmp_path)}, "go together"),
        ({"layout": "vllm", "pooling": "mean"}, "per-token"),
        ({"layout": "parts", "ec_cache_dir": str(tmp_path), "uuid_column": "u"}, "does not apply"),
        ({"layout": "vllm", "text_column": "t"}, "not text_column"),
    ):
        with pytest.raises(InvalidArgumentError, match=match):
            EmbedOptions.of(**bad)
    with pytest.raises(InvalidArgumentError, match="Qwen VLM towers"):
        EncoderActor("tiny-clip", None, layout="vllm")
