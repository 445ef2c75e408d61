"""`GraphEncoder`'s text side on the CPU (the text buckets, run eagerly) against `VisionEncoder.encode_text`, for
tiny CLIP and SigLIP2 checkpoints: chunks, shorter graphs (CLIP), eager fallback, padding rows; the text table;
token counts; errors; `max_text_batch`, text-only engines (`images=False`), `encode_text_ids_async`. Graph replay
on the GPU: `test_text_graphs_gpu.py`."""

from __future__ import annotations

import pytest
import torch

import encoder
import workspace
from encoder import InvalidArgumentError
from tests.graph_cases import rel_err
from tests.text_checkpoints import write_clip, write_siglip
from workspace.buckets import BucketError
from workspace.text_buckets import MAX_GRAPH_TEXTS, TextKey, TextTable, default_text_batches, text_table

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


# -- the text table: keys, chunks, refusals ---------------------------------------------------------------
def test_default_text_tables():
    """A prefix-exact tower (CLIP's 77 columns) gets shorter column counts; one that is not (SigLIP's 64) only
    its full length."""
    clip = text_table(77, prefix_exact=True)
    assert clip.batches == (1, 2, 4, 8, 16, 32, 64, 128, 256) and clip.seqs == (8, 16, 32, 64, 77)
    assert len(clip.keys) == len(clip) == 45 and TextKey(256, 77) in clip.keys
    assert text_table(64, prefix_exact=False).seqs == (64,)
    assert text_table(16, prefix_exact=True, batches=[4, 1, 4]) == TextTable((1, 4), (8, 16))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(seq_len=64, prefix_exact=False, seqs=[16, 64]), "depend on every one of its 64 columns"),
        (dict(seq_len=77, prefix_exact=True, seqs=[8, 100]), "columns 100 exceed the tower's 77"),
        (dict(seq_len=77, prefix_exact=True, batches=[]), "one or more sizes in batches"),
        (dict(seq_len=77, prefix_exact=True, batches=8), "one or more sizes in batches"),
        (dict(seq_len=77, prefix_exact=True, batches=[0, 4]), "TextTable.batches must be a positive int, got 0"),
        (dict(seq_len=77, prefix_exact=True, seqs=[8.0]), "TextTable.seqs must be a positive int"),
    ],
)
def test_text_table_refusals(kwargs, match):
    with pytest.raises(BucketError, match=match):
        text_table(**kwargs)


def test_keys_and_chunks():
    table = TextTable((1, 2, 4), (8, 16))
    assert table.key_for(3, 9) == TextKey(4, 16)
    assert table.key_for(1, 8) == TextKey(1, 8) and table.key_for(2, 1) == TextKey(2, 8)
    assert table.key_for(4, 17) is None  # longer than every column count: eager
    with pytest.raises(BucketError, match="1 to 4"):
        table.key_for(5, 8)
    spans = [3, 5, 8, 2, 16, 4, 1, 1, 17, 2, 9]
    chunks = table.chunks(spans)
    assert [(c.start, c.stop, c.span, c.key) for c in chunks] == [
        (0, 4, 8, TextKey(4, 8)),
        (4, 8, 16, TextKey(4, 16)),
        (8, 11, 17, None),
    ]
    assert [c.key for c in TextTable((1, 8), (8,)).chunks([1] * 9)] == [TextKey(8, 8), TextKey(1, 8)]
    assert str(TextKey(4, 16)) == "4x16"


# -- the runner on the CPU: chunks, shorter graphs, eager fallback, padding rows ----------------------------
SHORT = ["x", "a cat", "cat", "a dog"]  # a few tokens each: CLIP's spans fit 8 columns
LONG = ["cat " * 40, "a photo of a cat " * 3, "Ünïcode façade — naïve 東京", "dog " * 9]


def graph_with(enc, batches, seqs) -> workspace.GraphEncoder:
    return workspace.GraphEncoder(enc, buckets="64", text_buckets=TextTable(batches, seqs))


def test_chunks_short_columns_and_eager_fallback_equal_eager(pair):
    """11 texts through graphs of at most 4 texts: chunks of 4, 4 and 3 (in 4), CLIP's short texts in 8 columns;
    with no full-length graph, the long texts' chunk runs eagerly. Every output equals the eager encoder's."""
    enc, _ = pair
    seq_len, exact = enc.text.config.seq_len, enc.text.tower.prefix_exact
    texts = SHORT + LONG + SHORT[:3]
    want = enc.encode_text(texts)
    graph = graph_with(enc, (1, 2, 4), (8, seq_len) if exact else (seq_len,))
    assert_same(graph.encode_text(texts), want)
    stats = graph.stats()["text"]
    assert stats["texts"] == 11 and stats["eager_runs"] == 0
    if exact:
        assert stats["replays"] == {"4x8": 2, f"4x{seq_len}": 1} and stats["token_slots"] == 4 * (8 + seq_len + 8)
    else:
        assert stats["replays"] == {f"4x{seq_len}": 3} and stats["token_slots"] == 12 * seq_len
    assert stats["tokens"] == sum(enc.text_tokens(texts))
    if exact:  # only short columns: the long texts' chunk runs eagerly at the full length
        short_only = graph_with(enc, (1, 2, 4), (8,))
        assert_same(short_only.encode_text(texts), want)
        stats = short_only.stats()["text"]
        assert stats["eager_runs"] == 1 and stats["replays"] == {"4x8": 2}


def test_padding_rows_and_stale_buffers_do_not_change_outputs(pair):
    """One text alone in a 4-text graph (three padding rows), and the same after the static buffers were poisoned:
    ids outside the vocabulary, a zero mask, NaN outputs. Every row is rewritten before the forward."""
    enc, _ = pair
    seq_len = enc.text.config.seq_len
    graph = graph_with(enc, (4,), (seq_len,))
    first = graph.encode_text(["a photo of a cat"])
    assert_same(first, enc.encode_text(["a photo of a cat"]))
    with torch.inference_mode():  # the outputs were written under it (inference tensors)
        for ws in graph.text_runner.workspaces.values():
            ws.ids.fill_(enc.text.config.vocab_size + 7)
            ws.mask.zero_()
            ws.out.fill_(float("nan"))
    again = graph.encode_text(["a photo of a cat"])
    assert torch.equal(again[0], first[0])


def test_clip_columns_past_the_eos_change_nothing():
    """The exactness the shorter CLIP graphs rely on, for both EOS rules: the tower on the columns up to the last
    pooled position equals the tower on all of them (pads after the EOS equal to it or not). SigLIP's tower, which
    attends to every column, does change: that is why it keeps its full length."""
    from encoder.loading.presets import TEXT_PRESETS
    from encoder.models.text import build_text_tower
    from encoder.models.tower import TextGraphTower

    gen = torch.Generator().manual_seed(4)
    base = TEXT_PRESETS["tiny-clip"]
    for eos in (base.eos_token_id, 2):  # the first EOS id; legacy configs: the highest id
        tower = build_text_tower(base.model_copy(update={"eos_token_id": eos, "max_position_embeddings": 24}))
        assert isinstance(tower, TextGraphTower) and tower.prefix_exact
        ids = torch.randint(3, 500, (6, 24), generator=gen)
        ends = [3, 9, 5, 12, 4, 7]
        for row, end in enumerate(ends):
            ids[row, end] = 511  # the EOS (also the highest id)
            ids[row, end + 1 :] = 511 if row % 2 else 0  # pads: the EOS itself, or a low id
        mask = (torch.arange(24) <= torch.tensor(ends)[:, None]).long()
        spans = tower.output_spans(ids, mask)
        assert spans.tolist() == [e + 1 for e in ends] == mask.sum(1).tolist()
        with torch.no_grad():
            full, short = tower(ids, mask), tower(ids[:, :13], mask[:, :13])
        assert rel_err(short, full) <= 1e-5
    siglip = build_text_tower(TEXT_PRESETS["tiny-siglip"])
    assert isinstance(siglip, TextGraphTower) and not siglip.prefix_exact
    ids = torch.randint(0, 500, (2, 64), generator=gen)
    assert siglip.output_spans(ids, torch.ones_like(ids)).tolist() == [64, 64]
    with torch.no_grad():
        assert rel_err(siglip(ids[:, :32])[:, None], siglip(ids)[:, None]) > 1e-3  # pooled at the last column


def test_text_runner_refuses_what_does_not_fit(pair):
    from workspace.runner import GraphCaptureError
    from workspace.text_runner import TextGraphRunner

    enc, _ = pair
    tower = enc.text.tower
    with pytest.raises(TypeError, match="does not implement encoder.models.tower.TextGraphTower"):
        TextGraphRunner(enc.model, TextTable((1,), (8,)))
    with pytest.raises(GraphCaptureError, match="do not suit a tower"):
        TextGraphRunner(tower, TextTable((1,), (tower.seq_len + 1,)))
    if not tower.prefix_exact:
        with pytest.raises(GraphCaptureError, match="do not suit a tower"):
            TextGraphRunner(tower, TextTable((1,), (8, tower.seq_len)))


# -- the engine's text batch, text-only engines, the async text path ----------------------------------------
def test_max_text_batch_is_the_text_tables_largest_batch(pair, tmp_path):
    enc, graph = pair
    assert graph.max_text_batch == max(default_text_batches()) == MAX_GRAPH_TEXTS
    assert graph.max_text_batch == graph.text_runner.table.batches[-1]
    assert graph_with(enc, (1, 2, 4), (enc.text.config.seq_len,)).max_text_batch == 4
    write_clip(tmp_path, with_tokenizer=False)  # images only
    vision_only = encoder.load(tmp_path, device="cpu", dtype="float32")
    assert workspace.GraphEncoder(vision_only, buckets="64").max_text_batch is None


def test_a_text_only_engine_has_no_image_side_and_equal_text_outputs(pair, tmp_path):
    """`images=False`: no image table, runner or graphs; texts as the full engine (and the eager encoder) embeds
    them; every image call is a clear ConfigError; a model without text is refused."""
    from encoder.errors import ConfigError

    enc, full = pair
    graph = workspace.GraphEncoder(enc, images=False)
    assert graph.runner is None and graph.table is None and not graph.images
    assert graph.supports_text and graph.max_text_batch == full.max_text_batch
    assert_same(graph.encode_text(TEXTS), enc.encode_text(TEXTS))
    assert_same(graph.encode_text(TEXTS, pooling="model-l2"), full.encode_text(TEXTS, pooling="model-l2"), 0.0)
    stats = graph.stats()
    assert stats["text"]["texts"] == 2 * len(TEXTS) and "captures" not in stats and "attention" in stats
    image = torch.zeros(56, 56, 3, dtype=torch.uint8)
    batch = graph.preprocess([image.numpy()])  # preprocessing is the CPU's: still there
    calls = (lambda: graph.encode(batch), lambda: graph.encode_async(batch), lambda: graph.encode_llm(batch),
             lambda: graph.encode_llm_async(batch), lambda: graph.encode([image.numpy()], pooling="model"))  # fmt: skip
    for call in calls:
        with pytest.raises(ConfigError, match=r"built for text only \(images=False\): it has no image graphs"):
            call()
    write_clip(tmp_path, with_tokenizer=False)
    vision_only = encoder.load(tmp_path, device="cpu", dtype="float32")
    with pytest.raises(ConfigError, match="builds the text side only, but model .* takes no text"):
        workspace.GraphEncoder(vision_only, images=False)


def test_encode_text_ids_async_equals_the_sync_path(pair):
    enc, graph = pair
    ids, mask = enc.text.tokenize(TEXTS)
    for pooling in (None, "model", "model-l2"):
        pending = graph.encode_text_ids_async(ids, mask, pooling)
        assert_same(pending.result(), graph.encode_text_ids(ids, mask, pooling), 0.0)
        assert pending.done()  # on the CPU the work was done in the call
    assert_same(graph.encode_text_ids_async(ids, mask).result(), enc.encode_text(TEXTS))
    empty = graph.encode_text_ids_async(ids[:0], mask[:0])
    assert empty.done() and empty.result() == []
    with pytest.raises(InvalidArgumentError, match="text pooling"):  # checked in the call, not at result()
        graph.encode_text_ids_async(ids, mask, "mean")
    bad = mask.clone()
    bad[0] = 0
    with pytest.raises(InvalidArgumentError, match=r"mask\[0\] has no token"):
        graph.encode_text_ids_async(ids, bad)
