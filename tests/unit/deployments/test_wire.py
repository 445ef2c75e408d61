"""`deployments.wire`: the request record both wings hold and the one grouping function both use (the ingress's
merged encoder calls, the replica's engine calls per batch)."""

from __future__ import annotations

import numpy as np

from deployments.wire import EncodeRequest, TextRequest, group


def _request(tag: int, images: int, pooling: str = "mean", llm: str | None = None, deadline=None) -> EncodeRequest:
    arrays = [np.full((1, 1, 3), tag * 10 + k, np.uint8) for k in range(images)]
    return EncodeRequest(arrays, [4] * images, pooling, llm, deadline)


def test_group_merges_by_output_form_in_order_and_scatter_gives_each_request_its_own_outputs():
    requests = [
        _request(0, 2, deadline=5.0),
        _request(1, 1, "none", "bfloat16", deadline=1.0),
        _request(2, 1, deadline=9.0),
        _request(3, 3, "none", "bfloat16"),
    ]
    groups = group(requests)
    assert [(g.members, g.merged.form) for g in groups] == [([0, 2], ("mean", None)), ([1, 3], ("none", "bfloat16"))]
    assert [g.merged.images for g in groups] == [3, 4] and [g.merged.patches for g in groups] == [12, 16]
    assert [g.merged.deadline for g in groups] == [9.0, None]  # the last caller's; none when one caller has none
    out: list = [None] * len(requests)
    for g in groups:
        g.scatter([int(x[0, 0, 0]) for x in g.merged.arrays], requests, out)  # outputs: the images' tags
    assert out == [[0, 1], [10], [20], [30, 31, 32]]


def test_a_pack_keeps_the_form_and_deadline_and_its_call_names_what_routers_read():
    r = _request(0, 3, deadline=7.0)
    pack = r.pack(1, 3)
    assert (pack.images, pack.patches, pack.form, pack.deadline) == (2, 8, ("mean", None), 7.0)
    assert pack.call() == ("encode_pixels", {"pooling": "mean", "num_patches": 8, "num_images": 2, "deadline": 7.0})
    name, kwargs = _request(1, 1, "none", "float16").call()
    assert name == "encode_llm_pixels"
    assert kwargs == {"dtype": "float16", "num_patches": 4, "num_images": 1, "deadline": None}


def test_text_records_are_sized_by_tokens_and_never_merged_with_images():
    """A text record's size is tokens (the tower's fixed length per text); its form is ("text", pooling): the
    grouping keeps texts out of image calls, even where an image pooling has the same name ("model")."""
    texts = [
        TextRequest(["a red bicycle", "a cat"], [77, 77], "model", deadline=3.0),
        _request(0, 2, "model"),
        TextRequest(["a dog"], [77], "model", deadline=4.0),
        TextRequest(["x"], [77], "model-l2"),
    ]
    assert (texts[0].patches, texts[0].images) == (154, 2)
    groups = group(texts)
    assert [(g.members, g.merged.form) for g in groups] == [
        ([0, 2], ("text", "model")),
        ([1], ("model", None)),
        ([3], ("text", "model-l2")),
    ]
    merged = groups[0].merged
    assert isinstance(merged, TextRequest) and merged.texts == ["a red bicycle", "a cat", "a dog"]
    assert (merged.patches, merged.deadline) == (231, 4.0)
    out: list = [None] * len(texts)
    groups[0].scatter(merged.texts, texts, out)
    assert out[0] == ["a red bicycle", "a cat"] and out[2] == ["a dog"]


def test_a_text_pack_and_its_call_name_tokens_and_texts():
    r = TextRequest(["a", "b", "c"], [64] * 3, "model-l2", deadline=2.0)
    pack = r.pack(1, 3)
    assert (pack.texts, pack.patches, pack.form, pack.deadline) == (["b", "c"], 128, ("text", "model-l2"), 2.0)
    assert pack.call() == (
        "encode_texts",
        {"pooling": "model-l2", "num_tokens": 128, "num_texts": 2, "deadline": 2.0},
    )
