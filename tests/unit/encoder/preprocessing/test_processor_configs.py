"""The two preprocessing families behind one interface (`encoder.preprocessing.config.ProcessorConfig`): callers
resize and count patches through the config's methods, never by asking which family it is."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from pydantic import ValidationError

from encoder.errors import InvalidImageError
from encoder.preprocessing.config import ProcessorConfig
from encoder.preprocessing.families import preprocess_config_from_dump
from encoder.preprocessing.images import load_image
from encoder.preprocessing.qwen import PreprocessConfig, num_patches, resize_image
from encoder.preprocessing.vit import VitPreprocessConfig, resize_crop

ROOT = Path(__file__).resolve().parents[4]
QWEN = PreprocessConfig(min_pixels=28 * 28, max_pixels=28 * 28 * 16)
CLIP = VitPreprocessConfig(shortest_edge=56, crop_height=56, crop_width=56)
SIGLIP = VitPreprocessConfig(height=42, width=42, image_mean=(0.5,) * 3, image_std=(0.5,) * 3)


def picture(height: int, width: int) -> Image.Image:
    rng = np.random.default_rng(height * 1000 + width)
    return load_image(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def test_kinds_and_the_shared_interface():
    assert (QWEN.kind, CLIP.kind, SIGLIP.kind) == ("qwen", "vit", "vit")
    assert all(isinstance(c, ProcessorConfig) for c in (QWEN, CLIP, SIGLIP))
    assert (QWEN.factor, QWEN.patch_dim) == (28, 3 * 2 * 14 * 14)
    assert (CLIP.factor, CLIP.patch_dim, CLIP.merge_size, CLIP.temporal_patch_size) == (14, 3 * 14 * 14, 1, 1)
    with pytest.raises(TypeError):
        ProcessorConfig()  # the interface alone has no resize rule


@pytest.mark.parametrize(("height", "width"), [(30, 30), (100, 37), (37, 100), (300, 200)])
def test_methods_are_the_family_rules(height, width):
    img = picture(height, width)
    assert np.array_equal(QWEN.resize(img), resize_image(img, QWEN))
    assert QWEN.num_patches(height, width) == num_patches(height, width, QWEN)
    for vit in (CLIP, SIGLIP):
        out = vit.resize(img)
        assert np.array_equal(out, resize_crop(img, vit)) and out.shape[:2] == vit.output_size
        assert vit.num_patches(height, width) == (out.shape[0] // 14) * (out.shape[1] // 14)
    for cfg in (QWEN, CLIP, SIGLIP):
        out = cfg.resize(img)
        assert out.dtype == np.uint8 and out.shape[0] % cfg.factor == 0 and out.shape[1] % cfg.factor == 0


def test_resize_refuses_what_load_image_did_not_make():
    with pytest.raises(InvalidImageError, match="resize_image expects an RGB PIL image"):
        QWEN.resize(Image.new("L", (28, 28)))
    with pytest.raises(InvalidImageError, match="resize_crop expects an RGB PIL image"):
        CLIP.resize(Image.new("L", (28, 28)))


def test_dumps_come_back_as_their_family():
    for cfg in (QWEN, CLIP, SIGLIP):
        for mode in ("python", "json"):
            back = preprocess_config_from_dump(cfg.model_dump(mode=mode))
            assert type(back) is type(cfg) and back == cfg
    old = QWEN.model_dump()
    del old["kind"]  # a dump from before the Qwen config had a kind
    assert preprocess_config_from_dump(old) == QWEN


@pytest.mark.parametrize("make", [PreprocessConfig, lambda **kw: VitPreprocessConfig(height=28, width=28, **kw)])
def test_shared_validators_hold_in_both_families(make):
    with pytest.raises(ValidationError, match="image_std must be > 0"):
        make(image_std=(0.5, 0.0, 0.5))
    with pytest.raises(
        ValidationError, match=r"allowed_formats must be non-empty Pillow format names; unknown: \['NOPE'\]"
    ):
        make(allowed_formats=["nope"])
    assert make(allowed_formats=["png"]).allowed_formats == frozenset({"PNG"})


def test_no_caller_asks_which_family_a_config_is():
    """The families' differences live in their methods: no isinstance dispatch on the configs elsewhere."""
    asks = re.compile(r"isinstance\([^)]*(PreprocessConfig|ProcessorConfig)")
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for package in ("encoder", "workspace", "deployments")
        for path in sorted((ROOT / package).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if asks.search(line)
    ]
    assert not found, found
