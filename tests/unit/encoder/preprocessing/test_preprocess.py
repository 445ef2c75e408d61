"""encoder.preprocessing.qwen and images against transformers' Qwen2VLImageProcessorPil, plus input validation."""

from __future__ import annotations

import io
from functools import lru_cache

import numpy as np
import pytest
import torch
from PIL import Image, ImageFile, ImageOps
from pydantic import ValidationError
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from encoder.errors import ConfigError, ImageDecodeError, ImageTooLargeError, InvalidImageError
from encoder.patchify import patchify, patchify_many, preprocess
from encoder.preprocessing.images import load_image
from encoder.preprocessing.qwen import PreprocessConfig, num_patches, resize_image, smart_resize
from tests.images_util import encode, jpeg_with_orientation, png_bomb_header, random_array, random_image

DEFAULT = PreprocessConfig()
SMALL = PreprocessConfig(min_pixels=128 * 28 * 28, max_pixels=256 * 28 * 28)


@lru_cache
def hf_processor(min_pixels: int, max_pixels: int) -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels)


def hf_outputs(images: list, cfg: PreprocessConfig) -> tuple[np.ndarray, np.ndarray]:
    out = hf_processor(cfg.min_pixels, cfg.max_pixels)(images=images, return_tensors="np")
    return out["pixel_values"], out["image_grid_thw"]


def assert_matches_hf(ours_input, hf_input, cfg: PreprocessConfig = DEFAULT) -> None:
    batch = preprocess(ours_input, cfg)
    pixel_values, grid = hf_outputs([hf_input], cfg)
    assert batch.pixel_values.dtype == torch.float32 and batch.grid_thw.dtype == torch.int64
    np.testing.assert_array_equal(batch.grid_thw.numpy(), grid)
    assert batch.pixel_values.shape == pixel_values.shape
    assert np.abs(batch.pixel_values.numpy() - pixel_values).max() <= 1e-5


def opened(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data))


# ------------------------------------------------------------------------------ parity with HF


@pytest.mark.parametrize(
    "height,width",
    [(10, 10), (224, 224), (300, 517), (1000, 80), (80, 1000), (1400, 1300), (1, 200), (57, 29)],
)
@pytest.mark.parametrize("cfg", [DEFAULT, SMALL], ids=["default", "small"])
def test_sizes_match_hf(height, width, cfg):
    data = encode(random_image("RGB", height, width, seed=height * 7 + width), "PNG")
    assert_matches_hf(data, opened(data), cfg)


@pytest.mark.parametrize(
    "fmt,mode,kwargs",
    [
        ("PNG", "RGB", {}),
        ("PNG", "RGBA", {}),
        ("JPEG", "RGB", {"quality": 85}),
        ("JPEG", "L", {}),
        ("JPEG", "CMYK", {}),
        ("WEBP", "RGB", {"quality": 80}),
        ("WEBP", "RGBA", {"lossless": True}),
        ("GIF", "P", {}),
        ("GIF", "P", {"transparency": 3}),
        ("BMP", "RGB", {}),
        ("TIFF", "RGB", {}),
        ("TIFF", "CMYK", {}),
    ],
)
def test_encoded_formats_match_hf(fmt, mode, kwargs):
    data = encode(random_image(mode, 123, 211, seed=len(fmt)), fmt, **kwargs)
    assert_matches_hf(data, opened(data))


def test_byte_like_containers():
    data = encode(random_image("RGB", 64, 90, seed=3), "PNG")
    for wrapped in (bytearray(data), memoryview(data)):
        assert_matches_hf(wrapped, opened(data))


@pytest.mark.parametrize("mode", ["RGB", "L", "P", "RGBA", "LA", "CMYK", "1"])
def test_pil_modes_match_hf(mode):
    img = random_image(mode, 150, 97, seed=11)
    assert load_image(img).mode == "RGB"
    assert_matches_hf(img, img)


def test_16_bit_images_match_hf_given_their_high_byte():
    """16-bit grayscale is our rule, not HF's (its conversion saturates at 255: test_image_modes.py): once
    narrowed to 8 bits, the rest of the preprocessing is HF's, from a PIL image and from a PNG file."""
    img = random_image("I;16", 123, 211, seed=11)
    high_byte = Image.fromarray((np.asarray(img) >> 8).astype(np.uint8))
    assert_matches_hf(img, high_byte)
    assert_matches_hf(encode(img, "PNG"), high_byte)


def test_palette_with_transparency_is_composited_on_white():
    img = random_image("P", 60, 60, seed=5)
    img.info["transparency"] = 0
    rgb = np.asarray(load_image(img))
    transparent = np.asarray(img) == 0
    assert transparent.any() and (rgb[transparent] == 255).all()
    assert_matches_hf(img, img)


@pytest.mark.parametrize("channels", [None, 1, 3, 4])
def test_uint8_arrays_match_hf(channels):
    arr = random_array(111, 203, channels, seed=17)
    # HF refuses bare HxW arrays; give it the equivalent HxWx1 one.
    assert_matches_hf(arr, arr if channels is not None else arr[:, :, None])


def test_rgba_array_conversion_equals_hf_for_every_value_and_alpha():
    from transformers.image_transforms import convert_to_rgb

    value, alpha = np.meshgrid(np.arange(256), np.arange(256))
    arr = np.stack([value, 255 - value, value, alpha], axis=-1).astype(np.uint8)
    np.testing.assert_array_equal(np.asarray(load_image(arr)), convert_to_rgb(arr, return_numpy=True))


def test_exif_rotated_jpeg_matches_hf():
    data = jpeg_with_orientation(60, 100, orientation=6, seed=2)
    assert opened(data).size == (100, 60)
    assert load_image(data).size == (60, 100)  # rotated: width and height swapped
    # HF does not apply EXIF itself; give it the upright image.
    assert_matches_hf(data, ImageOps.exif_transpose(opened(data)))


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientations_swap_size(orientation):
    size = load_image(jpeg_with_orientation(40, 70, orientation)).size
    assert size == ((40, 70) if orientation >= 5 else (70, 40))


def test_batch_of_mixed_inputs_matches_hf():
    png = encode(random_image("RGB", 300, 517, seed=1), "PNG")
    img = random_image("RGBA", 90, 40, seed=2)
    arr = random_array(224, 224, 3, seed=3)
    batch = preprocess([png, img, arr])
    pixel_values, grid = hf_outputs([opened(png), img, arr], DEFAULT)
    np.testing.assert_array_equal(batch.grid_thw.numpy(), grid)
    assert np.abs(batch.pixel_values.numpy() - pixel_values).max() <= 1e-5


def test_empty_batch():
    batch = preprocess([])
    assert batch.pixel_values.shape == (0, DEFAULT.patch_dim) and batch.grid_thw.shape == (0, 3)


# ------------------------------------------------------------------------------ bad inputs

_PNG = encode(random_image("RGB", 64, 64, seed=9), "PNG")
_JPEG = encode(random_image("RGB", 64, 64, seed=9), "JPEG")


@pytest.mark.parametrize(
    "value,error,match",
    [
        (b"", ImageDecodeError, "empty"),
        (random_array(1, 300, None, seed=4).tobytes(), ImageDecodeError, "cannot identify"),
        (_PNG[: len(_PNG) // 2], ImageDecodeError, "PNG image is truncated"),
        (_JPEG[: len(_JPEG) // 2], ImageDecodeError, "JPEG image is truncated"),
        (encode(random_image("RGB", 32, 32), "ICO"), ImageDecodeError, "format ICO is not allowed"),
        (encode(random_image("RGB", 32, 32), "PPM"), ImageDecodeError, "format PPM is not allowed"),
        (png_bomb_header(20000, 20000), ImageTooLargeError, "decompression bomb"),
        (5, InvalidImageError, "unsupported image type int"),
        ("cat.png", InvalidImageError, "paths and URLs are not accepted"),
        ([1, 2], InvalidImageError, "unsupported image type list"),
        (np.zeros((8, 8, 3)), InvalidImageError, "dtype uint8, got float64"),
        (random_array(8, 8, 5), InvalidImageError, r"got shape \(8, 8, 5\)"),
        (np.zeros((0, 10, 3), np.uint8), InvalidImageError, "zero size"),
        (Image.new("RGB", (0, 4)), InvalidImageError, "zero size"),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else None,
)
def test_bad_inputs(value, error, match):
    with pytest.raises(error, match=match):
        load_image(value)


def test_truncated_lazily_opened_pil_image():
    with pytest.raises(ImageDecodeError, match="PNG image is truncated"):
        load_image(Image.open(io.BytesIO(_PNG[: len(_PNG) // 2])))


@pytest.mark.parametrize("height,width", [(1, 300), (1, 201), (402, 2)])
def test_extreme_aspect_ratio(height, width):
    with pytest.raises(InvalidImageError, match="aspect ratio .* exceeds the limit 200:1"):
        preprocess(random_array(height, width, 3))


def test_aspect_ratio_limit_is_configurable():
    cfg = PreprocessConfig(max_aspect_ratio=4)
    with pytest.raises(InvalidImageError, match="limit 4:1"):
        num_patches(100, 500, cfg)


def test_size_limit_checked_from_header_before_decoding(monkeypatch):
    def no_decode(self):
        raise AssertionError("pixel data was decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decode)
    with pytest.raises(ImageTooLargeError, match="2000x2000 = 4000000 pixels, over the limit of 1000000"):
        load_image(png_bomb_header(2000, 2000), PreprocessConfig(max_image_pixels=1_000_000))


def test_size_limit_applies_to_arrays():
    with pytest.raises(ImageTooLargeError, match="over the limit"):
        load_image(random_array(50, 50, 3), PreprocessConfig(max_image_pixels=2000))


def test_size_limit_is_inclusive():
    """Exactly max_image_pixels is accepted (bytes, PIL image, array); one more column is refused."""
    cfg = PreprocessConfig(max_image_pixels=40 * 50)
    for x in (encode(random_image("RGB", 40, 50), "PNG"), random_image("RGB", 40, 50), random_array(40, 50, 3)):
        assert load_image(x, cfg).size == (50, 40)
    for x in (encode(random_image("RGB", 40, 51), "PNG"), random_image("RGB", 40, 51), random_array(40, 51, 3)):
        with pytest.raises(ImageTooLargeError, match="51x40 = 2040 pixels, over the limit of 2000"):
            load_image(x, cfg)


def test_batch_errors_name_the_image():
    with pytest.raises(InvalidImageError, match="image 1: unsupported image type int"):
        preprocess([random_array(30, 30, 3), 7])


def test_allowlist_is_configurable():
    cfg = PreprocessConfig(allowed_formats={"png"})
    with pytest.raises(ImageDecodeError, match="format JPEG is not allowed"):
        load_image(_JPEG, cfg)
    assert load_image(_PNG, cfg).size == (64, 64)


# ------------------------------------------------------------------------------ patchify / counts


def hf_patchify(resized: np.ndarray) -> np.ndarray:
    hf = hf_processor(DEFAULT.min_pixels, DEFAULT.max_pixels)
    chw = hf.rescale(np.moveaxis(resized, -1, 0), 1 / 255)
    chw = hf.normalize(chw, list(DEFAULT.image_mean), list(DEFAULT.image_std))
    return hf.patchify(chw, patch_size=14, merge_size=2, temporal_patch_size=2)[0]


def test_patchify_is_bit_identical_to_hf_numpy_steps():
    resized = resize_image(load_image(random_array(300, 517, 3, seed=8)))
    assert resized.dtype == np.uint8 and resized.shape == (308, 504, 3)
    ours = patchify(torch.from_numpy(resized))
    assert torch.equal(ours, torch.from_numpy(np.ascontiguousarray(hf_patchify(resized))))


def test_patchify_accepts_non_contiguous_and_meta_tensors():
    resized = resize_image(load_image(random_array(100, 60, 3, seed=1)))
    flipped = torch.from_numpy(resized[:, :, ::-1].copy()).flip(-1)  # a negative-stride view
    assert torch.equal(patchify(flipped), patchify(torch.from_numpy(resized)))
    meta = patchify(torch.empty(56, 84, 3, dtype=torch.uint8, device="meta"))
    assert meta.device.type == "meta" and meta.shape == (24, DEFAULT.patch_dim)


@pytest.mark.gpu
def test_patchify_on_cuda_equals_cpu():
    resized = torch.from_numpy(resize_image(load_image(random_array(300, 517, 3, seed=8))))
    assert torch.equal(patchify(resized.cuda()).cpu(), patchify(resized))


@pytest.mark.parametrize(
    "pixels,match",
    [
        (torch.zeros(28, 28, 3), "uint8 tensor"),
        (torch.zeros(28, 28, dtype=torch.uint8), r"shape \[H, W, 3\]"),
        (torch.zeros(28, 30, 3, dtype=torch.uint8), "multiples of 28"),
    ],
)
def test_patchify_rejects_bad_tensors(pixels, match):
    with pytest.raises(InvalidImageError, match=match):
        patchify(pixels)


def test_patchify_many_concatenates_with_grid():
    sizes = [(50, 90), (300, 40)]
    arrays = [torch.from_numpy(resize_image(load_image(random_array(h, w, 3)))) for h, w in sizes]
    batch = patchify_many(arrays)
    assert batch.grid_thw.tolist() == [[1, 4, 6], [1, 22, 2]]
    assert torch.equal(batch.pixel_values, torch.cat([patchify(a) for a in arrays]))


@pytest.mark.parametrize("height,width", [(10, 10), (224, 224), (300, 517), (1000, 80), (4000, 3000), (1, 200)])
@pytest.mark.parametrize("cfg", [DEFAULT, SMALL], ids=["default", "small"])
def test_num_patches(height, width, cfg):
    hf = hf_processor(cfg.min_pixels, cfg.max_pixels)
    assert num_patches(height, width, cfg) == hf.get_number_of_image_patches(height, width)
    if height * width < 2_000_000:
        grid = preprocess(random_array(height, width, 3), cfg).grid_thw
        assert num_patches(height, width, cfg) == int(grid.prod())


def test_smart_resize_matches_hf():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

    # Squared noise spreads sizes over 1..5000: upscaled, downscaled and over-the-ratio cases.
    for h, w in random_array(500, 2, None, seed=21).astype(int) ** 2 // 13 + 1:
        if max(h, w) / min(h, w) > 200:
            with pytest.raises(InvalidImageError, match="aspect ratio"):
                smart_resize(h, w)
            with pytest.raises(ValueError):
                hf_smart_resize(h, w, max_pixels=28 * 28 * 1280)
        else:
            assert smart_resize(h, w) == hf_smart_resize(h, w, max_pixels=28 * 28 * 1280)


# ------------------------------------------------------------------------------ config


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_pixels": -1},
        {"min_pixels": 5000, "max_pixels": 4000},
        {"image_mean": (0.5, 0.5)},
        {"image_std": (0.5, 0.0, 0.5)},
        {"patch_size": 0},
        {"max_aspect_ratio": 0.5},
        {"allowed_formats": {"NOPE"}},
        {"allowed_formats": set()},
        {"no_such_field": 1},
    ],
)
def test_config_rejects_nonsense(kwargs):
    with pytest.raises(ValidationError):
        PreprocessConfig(**kwargs)


def test_config_is_frozen():
    with pytest.raises(ValidationError):
        DEFAULT.min_pixels = 1


QWEN2_VL_JSON = {
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2VLProcessor",
}


def test_from_hf_dict_flat_keys():
    cfg = PreprocessConfig.from_hf_dict(QWEN2_VL_JSON)
    assert (cfg.min_pixels, cfg.max_pixels) == (3136, 12845056)
    assert cfg.image_mean == DEFAULT.image_mean and cfg.factor == 28


def test_from_hf_dict_size_and_precedence():
    size_only = {"size": {"shortest_edge": 1000, "longest_edge": 50000}, "patch_size": 16, "extra": 1}
    cfg = PreprocessConfig.from_hf_dict(size_only)
    assert (cfg.min_pixels, cfg.max_pixels, cfg.patch_size) == (1000, 50000, 16)
    both = size_only | {"max_pixels": 60000}
    hf = Qwen2VLImageProcessorPil(**both)
    assert PreprocessConfig.from_hf_dict(both).max_pixels == hf.size["longest_edge"] == 60000


@pytest.mark.parametrize(
    "d,match",
    [
        ({"do_normalize": False}, "do_normalize"),
        ({"rescale_factor": 1 / 127.5}, "rescale_factor"),
        ({"rescale_factor": "1/255"}, "unsupported rescale_factor '1/255'"),
        ({"resample": 2}, "resample"),
        ({"min_pixels": -5}, "invalid preprocessor config"),
        ({"size": 5}, "must be a dict"),
    ],
)
def test_from_hf_dict_errors(d, match):
    with pytest.raises(ConfigError, match=match):
        PreprocessConfig.from_hf_dict(d)
