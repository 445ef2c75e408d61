"""CLIP text towers against Hugging Face transformers (float32, CPU): token ids against the checkpoint's HF
tokenizer, `encode_text` against `get_text_features`, zero-shot logits against `logits_per_image`, presets'
parameter counts, errors.

Checkpoints are tiny random CLIPModels written by `save_pretrained`, with a tiny byte-level BPE tokenizer
(the CLIP pipeline, a few merges) written by transformers' CLIPTokenizer: no network.
"""

from __future__ import annotations

import pytest
import torch

import encoder
from encoder import InvalidArgumentError
from encoder.loading.presets import TEXT_PRESETS
from encoder.models.text import build_text_tower
from encoder.tokenization import TextTokenizer
from tests.graph_cases import rel_err
from tests.text_checkpoints import CLIP_TEXT, CLIP_VISION, SIGLIP_TEXT, SIGLIP_VISION, write_clip, write_siglip

TEXTS = [
    "a photo of a cat",
    "A PHOTO of a Cat!",
    "Ünïcode façade — naïve 東京",
    "emoji 😀🐱 ok",
    "cat " * 40,  # over-long: truncated, EOS kept
    "x",
    "  spaces\tand\nnewlines  ",
]


@pytest.fixture(scope="module", params=["eos-id", "legacy-eos"])
def clip(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(f"clip-{request.param}")
    model, tok = write_clip(directory, legacy_eos=request.param == "legacy-eos")
    return directory, model, tok


def hf_ids(tok, texts, seq_len):
    return tok(texts, padding="max_length", max_length=seq_len, truncation=True)["input_ids"]


def test_token_ids_equal_hf(clip):
    directory, model, _ = clip
    import transformers as tf

    hf_tok = tf.AutoTokenizer.from_pretrained(directory)  # as a user loads it
    ours = TextTokenizer(directory, CLIP_TEXT["max_position_embeddings"])
    ids = ours(TEXTS)
    assert ids == hf_ids(hf_tok, TEXTS, 16)
    assert all(len(row) == 16 for row in ids)
    assert ids[4][-1] == hf_tok.eos_token_id  # truncated, EOS kept


def test_encode_text_equals_hf(clip):
    directory, model, tok = clip
    enc = encoder.load(directory, device="cpu", dtype="float32")
    assert enc.supports_text
    got = torch.stack(enc.encode_text(TEXTS))
    inputs = tok(TEXTS, padding="max_length", max_length=16, truncation=True, return_tensors="pt")
    with torch.no_grad():  # with the tokenizer's attention mask, as the processor calls it, and without
        ref = model.get_text_features(**inputs).pooler_output
        ref_no_mask = model.get_text_features(input_ids=inputs["input_ids"]).pooler_output
    assert got.dtype == torch.float32 and got.shape == (len(TEXTS), 24)
    assert rel_err(got, ref) <= 1e-5 and rel_err(got, ref_no_mask) <= 1e-5
    l2 = torch.stack(enc.encode_text(TEXTS, pooling="model-l2"))
    assert rel_err(l2, torch.nn.functional.normalize(ref, dim=-1)) <= 1e-5


def test_zero_shot_logits_equal_hf(clip):
    directory, model, tok = clip
    enc = encoder.load(directory, device="cpu", dtype="float32")
    n, size, patch = 3, CLIP_VISION["image_size"], CLIP_VISION["patch_size"]
    pixel_values = torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(1))
    grid = size // patch
    patches = pixel_values.reshape(n, 3, grid, patch, grid, patch).permute(0, 2, 4, 1, 3, 5).reshape(-1, 3 * patch**2)
    image = torch.stack(enc.encode(encoder.PatchBatch(patches, torch.tensor([[1, grid, grid]] * n))))
    text = torch.stack(enc.encode_text(TEXTS))
    ids = torch.tensor(hf_ids(tok, TEXTS, 16))
    with torch.no_grad():
        ref = model(input_ids=ids, pixel_values=pixel_values).logits_per_image
    got = enc.text.logits(image, text)
    assert got.shape == (n, len(TEXTS))
    assert rel_err(got, ref) <= 1e-5


def test_text_errors(clip, tmp_path):
    directory, _, _ = clip
    enc = encoder.load(directory, device="cpu", dtype="float32")
    with pytest.raises(InvalidArgumentError, match=r"texts\[1\] is an empty string"):
        enc.encode_text(["ok", ""])
    with pytest.raises(InvalidArgumentError, match=r"texts\[2\] must be a string"):
        enc.encode_text(["ok", "fine", 3])
    with pytest.raises(InvalidArgumentError, match="list of strings"):
        enc.encode_text("a cat")
    with pytest.raises(InvalidArgumentError, match="text pooling"):
        enc.encode_text(["a cat"], pooling="mean")
    assert enc.encode_text([]) == []
    # a checkpoint without tokenizer files serves images only
    write_clip(tmp_path, with_tokenizer=False)
    images_only = encoder.load(tmp_path, device="cpu", dtype="float32")
    assert not images_only.supports_text
    with pytest.raises(InvalidArgumentError, match=f"model '{images_only.name}' takes no text"):
        images_only.encode_text(["a cat"])
    with pytest.warns(encoder.RandomWeightsWarning):
        tiny = encoder.load("tiny-clip", device="cpu")
    assert not tiny.supports_text


def test_text_presets_match_hf_sizes():
    """The presets' text towers have the parameters of transformers' text models of the same config."""
    import transformers as tf

    for name, cfg in TEXT_PRESETS.items():
        fields = cfg.model_dump(exclude={"family"})
        with torch.device("meta"):
            ours = build_text_tower(cfg)
            if cfg.family == "clip":
                theirs = tf.CLIPTextModelWithProjection(tf.CLIPTextConfig(**fields))
            else:
                theirs = tf.SiglipTextModel(tf.SiglipTextConfig(**fields))
        keys = {k.removeprefix("text_model.") for k in theirs.state_dict() if "position_ids" not in k}
        assert set(ours.state_dict()) == keys, name
        assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters()), name


# -- SigLIP and SigLIP2 -----------------------------------------------------------------------------


def test_siglip_tower_equals_hf_and_zero_shot_logits(tmp_path):
    """SigLIP's text tower on token ids (its sentencepiece tokenizer is not read: images only) and the zero-shot
    logits with its logit_bias."""
    from encoder.loading.text_weights import read_text_state
    from encoder.text_encoder import TextEncoder, text_config_of

    model, _ = write_siglip(tmp_path, "siglip")
    cfg = text_config_of(tmp_path)
    assert cfg.family == "siglip" and not cfg.mask_padding and cfg.out_dim == 64
    tower = build_text_tower(cfg)
    state, scalars = read_text_state(tmp_path, tower)
    tower.load_state_dict(state)
    assert set(scalars) == {"logit_scale", "logit_bias"}
    ids = torch.randint(0, SIGLIP_TEXT.get("vocab_size", 32000), (5, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = tower(ids)
        ref = model.get_text_features(input_ids=ids).pooler_output
    assert rel_err(got, ref) <= 1e-5
    # zero-shot: our image embeddings and text embeddings against HF's logits_per_image
    enc = encoder.load(tmp_path, device="cpu", dtype="float32")
    assert not enc.supports_text  # no tokenizer.json
    n, size, patch = 2, SIGLIP_VISION["image_size"], SIGLIP_VISION["patch_size"]
    pixel_values = torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(1))
    grid = size // patch
    patches = pixel_values.reshape(n, 3, grid, patch, grid, patch).permute(0, 2, 4, 1, 3, 5).reshape(-1, 3 * patch**2)
    image = torch.stack(enc.encode(encoder.PatchBatch(patches, torch.tensor([[1, grid, grid]] * n))))
    text_side = TextEncoder(cfg, tower, None, scalars["logit_scale"], scalars["logit_bias"])
    with torch.no_grad():
        expected = model(input_ids=ids, pixel_values=pixel_values).logits_per_image
    assert rel_err(text_side.logits(image, got), expected) <= 1e-5


def test_siglip2_tokens_and_text_equal_hf(tmp_path):
    """SigLIP2: Gemma tokenizer (left padding, attention mask) and the SigLIP text tower with pads masked out."""
    import transformers as tf

    from encoder.text_encoder import load_text_side

    model, tok = write_siglip(tmp_path, "siglip2")
    text = load_text_side(tmp_path, torch.device("cpu"), torch.float32)
    assert text is not None and text.config.mask_padding and text.tokenizer.padding_side == "left"
    hf_tok = tf.AutoTokenizer.from_pretrained(tmp_path)
    inputs = hf_tok(TEXTS, padding="max_length", max_length=16, truncation=True, return_tensors="pt")
    ids, mask = text.tokenize(TEXTS)
    assert torch.equal(ids, inputs["input_ids"]) and torch.equal(mask, inputs["attention_mask"])
    got = torch.stack(text.encode(TEXTS))
    with torch.no_grad():
        ref = model.get_text_features(**inputs).pooler_output
    assert rel_err(got, ref) <= 1e-5
    l2 = torch.stack(text.encode(TEXTS, pooling="model-l2"))
    assert rel_err(l2, torch.nn.functional.normalize(ref, dim=-1)) <= 1e-5


def test_siglip2_through_load_searches_images_by_text(tmp_path):
    """`encoder.load` of a Siglip2Model checkpoint: the NaFlex image tower and the text side together; text
    features equal HF's, and zero-shot logits from our image and text features equal HF's `logits_per_image`."""
    import transformers as tf

    model, _ = write_siglip(tmp_path, "siglip2")
    enc = encoder.load(str(tmp_path), device="cpu", dtype=torch.float32)
    assert enc.supports_text and type(enc.config).__name__ == "Siglip2VisionConfig"
    images_only = encoder.load(str(tmp_path), device="cpu", dtype=torch.float32, text=False)
    assert not images_only.supports_text and images_only.text is None
    hf_tok = tf.AutoTokenizer.from_pretrained(tmp_path)
    inputs = hf_tok(TEXTS, padding="max_length", max_length=16, truncation=True, return_tensors="pt")
    with torch.no_grad():
        ref = model.get_text_features(**inputs).pooler_output
    assert rel_err(torch.stack(enc.encode_text(TEXTS)), ref) <= 1e-5
    gen = torch.Generator().manual_seed(3)
    sizes = ((40, 64), (72, 24))
    images = [torch.randint(0, 256, (h, w, 3), generator=gen, dtype=torch.uint8).numpy() for h, w in sizes]
    image = torch.stack(enc.encode(images, pooling="model"))
    text = torch.stack(enc.encode_text(TEXTS))
    logits = enc.text.logits(image, text)
    assert logits.shape == (len(images), len(TEXTS)) and torch.isfinite(logits).all()
    want = (
        model.logit_scale.exp()
        * torch.nn.functional.normalize(image, dim=-1)
        @ torch.nn.functional.normalize(ref, dim=-1).t()
        + model.logit_bias
    )
    assert rel_err(logits, want.detach()) <= 1e-5


def test_hub_download_fetches_the_tokenizer_and_text_shards(monkeypatch, tmp_path):
    """From the Hub (replaced by a directory): a sharded CLIPModel's tokenizer files and text shards come with
    its vision shards; a repository without a tokenizer serves images only."""
    import fnmatch
    import shutil

    import huggingface_hub

    from encoder.loading.checkpoint import read_weight_map, vision_shards
    from tests.hub_cache import COMMIT, use_cache

    cache = use_cache(monkeypatch, tmp_path / "hf_home", offline=False)
    remotes = {"org/clip": tmp_path / "clip", "org/clip-images": tmp_path / "clip-images"}
    for name, remote in remotes.items():
        model, _ = write_clip(remote, with_tokenizer=name == "org/clip")
        if name == "org/clip":  # sharded again: text weights in shards of their own
            for f in remote.glob("model*.safetensors*"):
                f.unlink()
            model.save_pretrained(remote, max_shard_size="20KB")

    def snapshot_download(repo_id, *, revision=None, allow_patterns=None, **kwargs):
        snapshot = cache / f"models--{repo_id.replace('/', '--')}" / "snapshots" / COMMIT
        snapshot.mkdir(parents=True, exist_ok=True)
        for f in remotes[repo_id].iterdir():
            if any(fnmatch.fnmatch(f.name, p) for p in allow_patterns):
                shutil.copy(f, snapshot / f.name)
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    weight_map = read_weight_map(remotes["org/clip"] / "model.safetensors.index.json")
    assert set(weight_map.values()) - set(vision_shards(weight_map))  # some shards hold text weights only
    enc = encoder.load("org/clip", device="cpu", dtype="float32")
    assert enc.supports_text
    local = encoder.load(remotes["org/clip"], device="cpu", dtype="float32")
    assert torch.equal(torch.stack(enc.encode_text(TEXTS)), torch.stack(local.encode_text(TEXTS)))
    assert not encoder.load("org/clip-images", device="cpu", dtype="float32").supports_text


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["clip", "siglip2"])
def test_text_on_cuda_bf16_matches_float32(family, tmp_path):
    """The text towers on a GPU in bfloat16 (the activation kernels on [B * S, F] rows) against float32 on the CPU."""
    from encoder.text_encoder import load_text_side

    if family == "clip":
        write_clip(tmp_path)
    else:
        write_siglip(tmp_path, "siglip2")
    ref = torch.stack(load_text_side(tmp_path, torch.device("cpu"), torch.float32).encode(TEXTS))
    got = torch.stack(load_text_side(tmp_path, torch.device("cuda"), torch.bfloat16).encode(TEXTS))
    assert got.dtype == torch.float32 and got.device.type == "cpu"
    assert torch.nn.functional.cosine_similarity(got, ref, dim=-1).min() >= 0.995


def test_tokenizer_and_config_errors(tmp_path):
    """A broken tokenizer.json, a tokenizer without a pad token, a bad text config: one CheckpointError each."""
    import json

    from encoder import CheckpointError
    from encoder.text_encoder import load_text_side

    write_clip(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"text_config": {**config["text_config"],
                                                                             "num_attention_heads": 5}}))  # fmt: skip
    with pytest.raises(CheckpointError, match=r"config.json: invalid text config: .*5 heads"):
        load_text_side(tmp_path, torch.device("cpu"), torch.float32)
    (tmp_path / "config.json").write_text(json.dumps(config))
    settings = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(settings | {"pad_token": "<nope>"}))
    with pytest.raises(CheckpointError, match="the pad token '<nope>' is not in tokenizer.json's vocabulary"):
        TextTokenizer(tmp_path, 16)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(settings | {"pad_token": None, "eos_token": None}))
    with pytest.raises(CheckpointError, match="no pad token"):
        TextTokenizer(tmp_path, 16)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"tokenizer.json: cannot read the tokenizer"):
        TextTokenizer(tmp_path, 16)
