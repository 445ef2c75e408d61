"""Every error the encoder raises for bad input is one line naming the input, without Python object reprs.

Pillow words an unidentified image as `cannot identify image file <_io.BytesIO object at 0x7f...>`;
that text reached HTTP answers, the batch `error` column and the CLI. Each bad input below goes
through every preprocessing entry point, alone and at position 2 of a list.
"""

from __future__ import annotations

import io
import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

import encoder
from encoder import ConfigError, EncoderError
from encoder.errors import reason
from encoder.patchify import preprocess
from encoder.preprocessing.qwen import PreprocessConfig
from encoder.preprocessing.vit import VitPreprocessConfig
from tests.hf_models import write_checkpoint

FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF")


def encoded(fmt: str, size=(40, 30)) -> bytes:
    buf = io.BytesIO()
    rgb = np.random.default_rng(0).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(rgb).save(buf, fmt)
    return buf.getvalue()


def lazily_opened_truncated_png() -> Image.Image:
    data = encoded("PNG")
    return Image.open(io.BytesIO(data[: len(data) // 2]))  # decoding fails only when pixels are read


def bad_inputs() -> dict[str, object]:
    cases: dict[str, object] = {
        "empty bytes": b"",
        "garbage bytes": b"garbage",
        "random bytes": np.random.default_rng(1).integers(0, 256, 300, dtype=np.uint8).tobytes(),
        "PNG signature only": b"\x89PNG\r\n\x1a\n" + b"\0" * 30,
        "GIF signature only": b"GIF89a" + b"\0" * 20,
        "JPEG signature only": b"\xff\xd8\xff" + b"\0" * 50,
        "WebP signature only": b"RIFF\0\0\0\0WEBPVP8 ",
        "BMP signature only": b"BM" + b"\0" * 40,
        "TIFF signature only": b"II*\0" + b"\0" * 40,
        "disallowed format (PPM)": encoded("PPM"),
        "disallowed format (ICO)": encoded("ICO", (32, 32)),
        "extreme aspect ratio": encoded("PNG", (1000, 2)),
        "bytearray garbage": bytearray(b"junk junk"),
        "memoryview garbage": memoryview(b"junk junk"),
        "lazily opened truncated PNG": lazily_opened_truncated_png(),
        "float array": np.zeros((8, 8, 3), dtype=np.float32),
        "4-d array": np.zeros((1, 8, 8, 3), dtype=np.uint8),
        "two-channel array": np.zeros((8, 8, 2), dtype=np.uint8),
        "empty array": np.zeros((0, 8, 3), dtype=np.uint8),
        "str": "images/cat.png",
        "int": 3,
        "None": None,
        "object": object(),
        "dict": {"image": b"x"},
        "tensor": torch.zeros(8, 8, 3, dtype=torch.uint8),
        "nested list": [b"x"],
    }
    for fmt in FORMATS:
        data = encoded(fmt)
        cases[f"truncated {fmt}"] = data[: len(data) // 2]
        cases[f"{fmt} header only"] = data[:20]
    return cases


BAD = bad_inputs()
GOOD = encoded("PNG")


@pytest.fixture(scope="module")
def encoders():
    return {name: encoder.load(name, device="cpu") for name in ("tiny", "tiny-clip", "tiny-siglip")}


def entry_points(encoders):
    points = {"preprocess": lambda x: preprocess(x, PreprocessConfig())}
    clip = encoders["tiny-clip"].preprocess_config
    points["preprocess(clip)"] = lambda x: preprocess(x, clip)
    for name, enc in encoders.items():
        points[f"{name}.preprocess"] = enc.preprocess
        points[f"{name}.encode"] = enc.encode
    return points


def assert_clean(message: str) -> None:
    assert message.strip(), "empty message"
    assert "object at 0x" not in message and " at 0x" not in message, message
    assert "\n" not in message, message


@pytest.mark.filterwarnings("ignore:Corrupt EXIF data:UserWarning")  # Pillow, on the TIFF header alone
@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_messages_are_clean_and_name_the_position(encoders, case):
    bad = BAD[case]
    if isinstance(bad, Image.Image):  # a fresh lazily opened image per call: a failed load() is cached
        bad = lazily_opened_truncated_png()
    for where, run in entry_points(encoders).items():
        if case == "extreme aspect ratio" and "siglip" in where:
            continue  # SigLIP squashes any image to its square: no aspect-ratio limit to break
        with pytest.raises(EncoderError) as alone:
            run([bad])
        assert_clean(str(alone.value))
        if isinstance(BAD[case], Image.Image):
            bad = lazily_opened_truncated_png()
        with pytest.raises(EncoderError) as in_list:
            run([GOOD, GOOD, bad])
        assert_clean(str(in_list.value))
        assert str(in_list.value).startswith("image 2: "), (where, str(in_list.value))


def test_unidentified_bytes_say_so_in_words():
    with pytest.raises(encoder.ImageDecodeError) as info:
        preprocess([GOOD, b"garbage"], PreprocessConfig())
    assert str(info.value) == (
        "image 1: cannot identify image data (7 bytes): not an image in a known format "
        "(accepted: BMP, GIF, JPEG, PNG, TIFF, WEBP)"
    )


def test_pixel_limit_message(encoders):
    with pytest.raises(encoder.ImageTooLargeError) as info:
        preprocess([GOOD], PreprocessConfig(max_image_pixels=100))
    assert_clean(str(info.value))
    assert "40x30 = 1200 pixels, over the limit of 100" in str(info.value)


def test_reason_strips_reprs_and_extra_lines():
    assert reason(OSError("cannot identify image file <_io.BytesIO object at 0x7f560c748770>")) == (
        "cannot identify image file"
    )
    assert reason(ValueError("first line\nsecond <x at 0xdead>")) == "first line"
    assert reason(KeyError()) == "KeyError"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"model": object()},
        {"model": "tiny", "dtype": object()},
        {"model": "tiny", "dtype": "int8"},
        {"model": "tiny", "dtype": torch.int64},  # torch's bare TypeError from Module.to
        {"model": "tiny", "dtype": torch.complex64},  # loaded, then NotImplementedError at the first encode
        {"model": "tiny", "dtype": torch.float8_e4m3fn},
        {"model": "tiny", "device": "gpu"},
        {"model": "tiny", "device": object()},
        {"model": "tiny", "device": "meta"},
        {"model": "tiny", "device": "cuda:99"},
        {"model": "tiny", "seed": "x"},
        {"model": "tiny", "attention": 3},
        {"model": "tiny", "attention": "nope"},
    ],
)
def test_load_argument_messages_are_clean(kwargs):
    with pytest.raises(EncoderError) as info:
        encoder.load(**{"device": "cpu", **kwargs})
    assert_clean(str(info.value))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has CUDA: device='cuda' is valid")
def test_cuda_without_cuda_is_a_config_error_at_load():
    """Before the fix: torch's bare `AssertionError: Torch not compiled with CUDA enabled`, after the weights."""
    with pytest.raises(ConfigError, match="device 'cuda' asked for, but .*; use device='cpu'") as info:
        encoder.load("tiny", device="cuda")
    assert_clean(str(info.value))


@pytest.mark.parametrize("pooling", [object(), "nope", 3])
def test_pooling_messages_are_clean(encoders, pooling):
    with pytest.raises(EncoderError) as info:
        encoders["tiny"].encode([GOOD], pooling=pooling)
    assert_clean(str(info.value))


def test_config_and_checkpoint_messages_are_clean(tmp_path):
    good = tmp_path / "good"
    write_checkpoint(good, "qwen2_5_vl", "full")
    cases = {
        "bad preprocessor values": ("preprocessor_config.json", json.dumps({"image_std": [0, 0, 0], "patch_size": -1})),
        "bad vision config": ("config.json", json.dumps({"model_type": "qwen2_5_vl", "depth": -1, "hidden_size": "x"})),
        "garbage safetensors": ("model.safetensors", "\0garbage" * 50),
        "config not JSON": ("config.json", "{not json"),
    }  # fmt: skip
    for case, (name, text) in cases.items():
        broken = tmp_path / case.replace(" ", "_")
        shutil.copytree(good, broken)
        (broken / name).write_text(text)
        with pytest.raises(EncoderError) as info:
            encoder.load(str(broken), device="cpu")
        assert_clean(str(info.value))
        assert str(broken) in str(info.value), (case, str(info.value))


def test_vit_preprocess_config_messages_are_clean(encoders):
    cfg = encoders["tiny-clip"].config
    with pytest.raises(EncoderError) as info:
        VitPreprocessConfig.from_hf_dict({"size": {"shortest_edge": -5}, "crop_size": 3}, cfg)
    assert_clean(str(info.value))


def test_a_batch_whose_grid_does_not_match_its_patches_is_refused(encoders):
    """The tower's geometry comes from `grid_thw`: with one patch row more or fewer than the grid says, images
    would be cut at the wrong rows, so the batch is refused by name (no test covered either check)."""
    from encoder.patch_batch import PatchBatch

    for enc in encoders.values():
        good = enc.preprocess([np.random.default_rng(1).integers(0, 255, (64, 48, 3), dtype=np.uint8)] * 2)
        enc.check_batch(good)
        for rows in (good.pixel_values[:-1], torch.cat([good.pixel_values, good.pixel_values[:1]])):
            with pytest.raises(EncoderError, match="grid_thw does not match the number of patches"):
                enc.encode(PatchBatch(rows, good.grid_thw), pooling="mean")


@pytest.mark.parametrize(
    "pixel_values, grid_thw, match",
    [
        ([[0.0] * 4], [[1, 2, 2]], "pixel_values must be a torch.Tensor, not list"),
        (torch.zeros(4, 8, dtype=torch.uint8), [[1, 2, 2]], "2-D floating-point tensor"),
        (torch.zeros(4, 8), torch.tensor([[1.0, 2.0, 2.0]]), "must hold integers, got torch.float32"),
        (torch.zeros(4, 8), torch.tensor([1, 2, 2]), r"\[num_images, 3\] \(t, h, w\) rows, got shape \[3\]"),
        (torch.zeros(4, 8), "1,2,2", "grid_thw must be"),
    ],
)
def test_a_patch_batch_built_wrong_names_the_field(pixel_values, grid_thw, match):
    """`PatchBatch` is public (`encode(PatchBatch(...))`): it asserted (an AttributeError for a list, a bare
    AssertionError with a shape, or a float grid accepted until the geometry failed)."""
    with pytest.raises(encoder.InvalidArgumentError, match=match):
        encoder.PatchBatch(pixel_values, grid_thw)


def test_a_patch_batch_takes_its_grid_as_rows():
    batch = encoder.PatchBatch(torch.zeros(4, 8), [[1, 2, 2]])
    assert batch.grid_thw.dtype == torch.int64 and batch.patch_counts() == [4]


@pytest.mark.parametrize("name", ["tiny", "tiny-clip"])
def test_paths_are_accepted_as_by_the_cli(encoders, name, tmp_path):
    """Broken: `enc.encode(["img.jpg"])` raised "paths and URLs are not accepted" though the CLI and the batch
    job take paths. A str or os.PathLike is a path to an image file, alone or in a list with other inputs."""
    enc = encoders[name]
    (tmp_path / "a.png").write_bytes(GOOD)
    jpeg = encoded("JPEG")
    (tmp_path / "b.jpg").write_bytes(jpeg)
    want = enc.encode([GOOD, jpeg, GOOD])
    got = enc.encode([str(tmp_path / "a.png"), tmp_path / "b.jpg", GOOD])
    assert all(torch.equal(w, g) for w, g in zip(want, got, strict=True))
    alone = enc.encode(tmp_path / "b.jpg")  # one path, not in a list (a batch of one: equal up to rounding)
    torch.testing.assert_close(alone[0], want[1], rtol=1e-4, atol=1e-5)
    assert torch.equal(enc.preprocess([str(tmp_path / "a.png")]).pixel_values, enc.preprocess([GOOD]).pixel_values)


def test_a_bad_path_is_named(encoders, tmp_path):
    enc = encoders["tiny"]
    missing = tmp_path / "missing.png"
    with pytest.raises(encoder.InvalidArgumentError) as info:
        enc.encode([missing])
    assert str(info.value) == f"{missing}: cannot read (No such file or directory)"
    (tmp_path / "a.png").write_bytes(GOOD)
    with pytest.raises(encoder.InvalidArgumentError) as info:
        enc.encode([tmp_path / "a.png", str(missing)])
    assert str(info.value) == f"image 1: {missing}: cannot read (No such file or directory)"
    (tmp_path / "bad.png").write_bytes(b"garbage")
    with pytest.raises(encoder.ImageDecodeError, match=f"^image 1: {tmp_path / 'bad.png'}: cannot identify image"):
        enc.encode([tmp_path / "a.png", tmp_path / "bad.png"])
    with pytest.raises(encoder.InvalidArgumentError, match="URLs and data URLs are not fetched here"):
        enc.encode(["https://example.com/cat.png"])
    with pytest.raises(encoder.InvalidArgumentError, match=r"\.\.\. \(4000 characters\): cannot read"):
        enc.encode(["QUJD" * 1000])  # base64 by mistake: named, cut short
