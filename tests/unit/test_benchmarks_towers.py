"""`benchmarks/towers.py`'s CPU smoke run (tiny SigLIP2 NaFlex at two max_num_patches, tiny DINOv2 and DINOv3; float32,
buckets run eagerly): it runs end to end, prints its tables, and every output of ours equals HF's model of the family
holding the same weights (`benchmarks/hf_vision.py`), so a GPU session's run of it measures the right thing; and the
padded NaFlex inputs HF gets are what transformers' own processor gives."""

from __future__ import annotations

import json

import numpy as np
import torch
from PIL import Image

from benchmarks import towers
from benchmarks.hf_vision import naflex_inputs


def test_towers_benchmark_cpu_smoke(capsys, tmp_path):
    out = tmp_path / "towers.json"
    assert towers.main(["--device", "cpu", "--seconds", "0", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    table = [line for line in printed.splitlines() if line.startswith("| ") and not line.startswith("| ---")]
    # per model a header; NaFlex 2 settings, DINO 1; 2 sizes; HF, eager, graph path, graph path + host copy; then
    # issue 46's table after each model and at the end: a header, a row per model and setting (the 1-image column
    # only: 3 is no target)
    assert len(table) == 3 + (2 + 1 + 1) * 2 * 4 + (1 + 2) + (1 + 1) * 2 + (1 + 4)
    assert "| 1 image (>= 3x) | max rel. error vs HF |" in printed
    payload = json.loads(out.read_text())
    rows = payload["rows"]
    assert {r["model"] for r in rows} == {"tiny-siglip2", "tiny-dinov2", "tiny-dinov3"}
    assert {r["max_patches"] for r in rows if r["model"] == "tiny-siglip2"} == {16, 64}
    assert {r["impl"] for r in rows} == {
        "HF transformers eager (sdpa)", "ours, eager", "ours, buckets run eagerly (no CUDA)",
        "ours, buckets run eagerly (no CUDA) + host copy",
    }  # fmt: skip
    errs = [r["rel_err_vs_hf"] for r in rows if "rel_err_vs_hf" in r]
    assert len(errs) == 3 * (2 + 1 + 1) * 2 and max(errs) <= 1e-5, errs
    naflex = [r for r in rows if r["model"] == "tiny-siglip2" and r["impl"].startswith("HF")]
    assert all(0 < r["patches"] <= r["max_patches"] * r["images"] for r in naflex)
    graph = [r for r in rows if "replays" in r]
    assert graph and all(r["replays"] >= 1 and r["eager_packs"] == 0 for r in graph)
    assert len(payload["notes"]) == 3 + 4  # an HF twin per model; a GraphEncoder per NaFlex setting and DINO


def test_naflex_inputs_are_the_hf_processors():
    """Our packed rows padded by `naflex_inputs` equal `Siglip2ImageProcessorPil`'s output, mask and shapes."""
    from transformers.models.siglip2.image_processing_pil_siglip2 import Siglip2ImageProcessorPil

    import encoder
    from encoder.preprocessing.naflex import NaflexPreprocessConfig

    rng = np.random.default_rng(0)
    sizes = [(30, 200), (64, 64), (200, 31), (1, 1)]
    imgs = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]
    enc = encoder.load("tiny-siglip2", device="cpu", dtype=torch.float32)
    enc.preprocess_config = NaflexPreprocessConfig.for_model(enc.config, max_num_patches=48)
    ours = naflex_inputs(enc.preprocess(imgs), 48)
    hf = Siglip2ImageProcessorPil(patch_size=16, max_num_patches=48)(images=imgs, return_tensors="pt")
    for key in ("pixel_values", "pixel_attention_mask", "spatial_shapes"):
        assert torch.equal(ours[key], hf[key].to(ours[key].dtype)), key
