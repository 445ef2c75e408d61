"""`GraphEncoder`'s text side on the CPU (the bucket logic, run eagerly) against `VisionEncoder.encode_text`, for
tiny CLIP and SigLIP2 checkpoints; token counts; errors."""

from __future__ import annotations

import pytest
import torch

import encoder
import workspace
from encoder import InvalidArgumentError
from tests.graph_cases import rel_err
from tests.text_checkpoints import write_clip, write_siglip

TEXTS = ["a photo of a cat", "A PHOTO of a Cat!", "Ünïcode façade — naïve 東京", "cat " * 40, "x", "two\nlines"]


@pytest.fixture(scope="module", params=["clip", "siglip2"])
def pair(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    if request.param == "clip":
        write_clip(directory)
    else:
        write_siglip(directory, "siglip2")
    enc = encoder.load(directory, device="cpu", dtype="float32")
    return enc, workspace.GraphEncoder(enc, buckets="64,256")


def assert_same(got: list[torch.Tensor], want: list[torch.Tensor], tol: float = 1e-5) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.float32 and g.device.type == "cpu" and g.shape == w.shape
        assert torch.isfinite(g).all() and rel_err(g, w) <= tol


def test_encode_text_equals_the_eager_encoder(pair):
    enc, graph = pair
    assert graph.supports_text
    assert_same(graph.encode_text(TEXTS), enc.encode_text(TEXTS))
    assert_same(graph.encode_text(TEXTS, pooling="model-l2"), enc.encode_text(TEXTS, pooling="model-l2"))
    assert graph.encode_text([]) == []


def test_encode_text_ids_equals_encode_text(pair):
    enc, graph = pair
    ids, mask = enc.text.tokenize(TEXTS)  # [B, seq_len] int64 each
    assert_same(graph.encode_text_ids(ids, mask), enc.encode_text(TEXTS))
    assert_same(enc.encode_text_ids(ids, mask), enc.encode_text(TEXTS))


def test_text_tokens_count_the_real_tokens(pair):
    enc, graph = pair
    ids, mask = enc.text.tokenize(TEXTS)
    counts = graph.text_tokens(TEXTS)
    assert counts == enc.text_tokens(TEXTS) == mask.sum(1).tolist()
    seq_len = enc.text.config.seq_len
    assert counts[3] == seq_len  # truncated: every position is a token
    assert all(0 < counts[i] < seq_len for i in (0, 1, 4, 5))  # short texts: pads not counted
    assert counts[4] < counts[0]  # "x" is shorter than "a photo of a cat"
    assert graph.text_tokens([]) == []


def test_text_errors_name_the_input(pair):
    enc, graph = pair
    with pytest.raises(InvalidArgumentError, match=r"texts\[1\] is an empty string"):
        graph.encode_text(["ok", ""])
    with pytest.raises(InvalidArgumentError, match=r"texts\[1\] is an empty string"):
        graph.text_tokens(["ok", ""])
    with pytest.raises(InvalidArgumentError, match=r"texts\[0\] must be a string"):
        graph.encode_text([b"bytes"])
    with pytest.raises(InvalidArgumentError, match="list of strings"):
        graph.encode_text("a cat")
    with pytest.raises(InvalidArgumentError, match="text pooling"):
        graph.encode_text(["a cat"], pooling="mean")
    ids, mask = enc.text.tokenize(["a cat", "a dog"])
    vocab, seq_len = enc.text.config.vocab_size, enc.text.config.seq_len
    bad = ids.clone()
    bad[1, 0] = vocab
    with pytest.raises(InvalidArgumentError, match=r"ids\[1\] has a token id outside the vocabulary"):
        graph.encode_text_ids(bad, mask)
    bad = mask.clone()
    bad[0] = 0
    with pytest.raises(InvalidArgumentError, match=r"mask\[0\] has no token"):
        graph.encode_text_ids(ids, bad)
    bad[0], bad[1, 0] = mask[0], 2
    with pytest.raises(InvalidArgumentError, match=r"mask\[1\] has values other than 0 and 1"):
        graph.encode_text_ids(ids, bad)
    with pytest.raises(InvalidArgumentError, match=rf"ids must be a \[B, {seq_len}\] int64 tensor"):
        graph.encode_text_ids(ids[:, :-1], mask[:, :-1])
    with pytest.raises(InvalidArgumentError, match=rf"mask must be a \[B, {seq_len}\] int64 tensor"):
        graph.encode_text_ids(ids, mask.int())
    with pytest.raises(InvalidArgumentError, match="ids must be a torch.Tensor"):
        graph.encode_text_ids(ids.tolist(), mask)
    with pytest.raises(InvalidArgumentError, match="differ in shape"):
        graph.encode_text_ids(ids, mask[:1])
    assert graph.encode_text_ids(ids[:0], mask[:0]) == []


def test_a_model_without_text_says_so(tmp_path):
    write_clip(tmp_path, with_tokenizer=False)  # no tokenizer files: images only
    enc = encoder.load(tmp_path, device="cpu", dtype="float32")
    graph = workspace.GraphEncoder(enc, buckets="64")
    assert not graph.supports_text
    ids, mask = torch.zeros(1, 16, dtype=torch.long), torch.ones(1, 16, dtype=torch.long)
    calls = (lambda: graph.encode_text(["a cat"]), lambda: graph.text_tokens(["a cat"]),
             lambda: graph.encode_text_ids(ids, mask))  # fmt: skip
    for call in calls:
        with pytest.raises(InvalidArgumentError, match=f"model '{enc.name}' takes no text"):
            call()
