"""FP8 quality (one GPU run): the FP8 tower's output tokens against the bf16 tower's, per token.

For each model, the same weights loaded twice (bf16, and `quantization="fp8"`), the same images through
the eager forward of each; the cosine similarity of every output token of the FP8 tower to the bf16 one,
and of every image's mean-pooled embedding. Two image sets: photographs (scikit-image's bundled ones, or
`--images DIR`) at their own sizes, and random-pixel images. Issue 45's bar: mean >= 0.999, worst token
>= 0.995. Prints a markdown table; `--json` writes the rows.

    python -m benchmarks.fp8_quality [--models qwen2.5-vl-7b,qwen3-vl-8b] [--images DIR]

A preset name draws random weights (no network on the GPU box); a Hub id or checkpoint directory loads
real ones.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import warnings

import numpy as np
import torch
from PIL import Image

import encoder
from benchmarks.common import require_cuda, write_results
from encoder.models.fp8 import ROLES, quantize_blocks

MODELS = "qwen2.5-vl-7b,qwen3-vl-8b,clip-vit-l-14,siglip-so400m-14-384"
MEAN_BAR, WORST_BAR = 0.999, 0.995


def photographs(directory: str | None, max_side: int) -> list[np.ndarray]:
    if directory is None:
        try:
            import skimage
        except ImportError:
            sys.exit("no photographs: install scikit-image (its bundled images) or pass --images DIR")
        directory = pathlib.Path(skimage.__file__).parent / "data"
    paths = sorted(p for p in pathlib.Path(directory).iterdir() if p.suffix.lower() in (".png", ".jpg", ".jpeg"))
    out = []
    for p in paths:
        img = Image.open(p).convert("RGB")
        img.thumbnail((max_side, max_side))  # the large ones would dominate the token count
        out.append(np.asarray(img))
    if not out:
        sys.exit(f"no .png/.jpg images in {directory}")
    return out


def keeper(policy: str):
    """'mlp_out+first1' -> keep(block, depth, role): true for the layers that policy keeps in bf16."""
    roles, first, last = set(), 0, 0
    for part in policy.split("+"):
        if part.startswith("first"):
            first = int(part[5:])
        elif part.startswith("last"):
            last = int(part[4:])
        elif part in ROLES:
            roles.add(part)
        else:
            sys.exit(f"--keep: {part!r} is not one of {', '.join(ROLES)}, firstN, lastN")
    return lambda i, depth, role: role in roles or i < first or i >= depth - last


def random_images(count: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    sides = [(224, 224), (448, 336), (336, 560), (672, 672)]
    return [rng.integers(0, 256, (*sides[i % len(sides)], 3), dtype=np.uint8) for i in range(count)]


@torch.inference_mode()
def compare(bf16: encoder.VisionEncoder, fp8: encoder.VisionEncoder, images: list[np.ndarray]) -> dict:
    token_cos, image_cos = [], []
    for img in images:  # one image per forward: per-image means need no segment bookkeeping
        batch = bf16.preprocess([img])
        want, got = bf16.forward_packed(batch).float(), fp8.forward_packed(batch).float()
        assert torch.isfinite(got).all(), "non-finite FP8 output"
        token_cos.append(torch.nn.functional.cosine_similarity(got, want, dim=-1))
        image_cos.append(torch.nn.functional.cosine_similarity(got.mean(0), want.mean(0), dim=0).view(1))
    tok, img = torch.cat(token_cos), torch.cat(image_cos)
    return {
        "images": len(images),
        "tokens": tok.numel(),
        "token_mean": tok.mean().item(),
        "token_worst": tok.min().item(),
        "token_p001": torch.quantile(tok, 0.001).item() if tok.numel() > 1 else tok.min().item(),
        "image_mean": img.mean().item(),
        "image_worst": img.min().item(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=MODELS, help="comma list of presets, Hub ids or checkpoint directories")
    parser.add_argument("--images", default=None, help="a folder of photographs (default: scikit-image's)")
    parser.add_argument("--max-side", type=int, default=768, help="photographs shrunk to fit this side")
    parser.add_argument("--random", type=int, default=8, help="random-pixel images")
    parser.add_argument("--fast-accum", action="store_true", help="fp8 GEMMs without float32 promotion")
    parser.add_argument(
        "--keep",
        default="",
        help="policies, each a row set: layers kept bf16, '+'-joined roles (qkv, proj, mlp_in, mlp_out) and/or "
        "firstN / lastN blocks, e.g. 'mlp_out,first1+last1' ('' = FP8 everywhere, as encoder.load does)",
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not require_cuda("benchmarks/fp8_quality.py"):
        return 2
    if args.fast_accum:
        from encoder.models.fp8 import Fp8Linear

        Fp8Linear.fast_accum = True
    photos, noise = photographs(args.images, args.max_side), random_images(args.random)
    rows = []
    policies = [""] + [p for p in args.keep.split(",") if p]
    for name in args.models.split(","):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", encoder.RandomWeightsWarning)
            bf16 = encoder.load(name, device="cuda")
            for policy in policies:
                if policy:  # the same weights, some layers kept bf16
                    fp8 = encoder.load(name, device="cuda")
                    fp8.model.fuse()
                    quantize_blocks(fp8.model.transformer_blocks(), keep=keeper(policy))
                else:
                    fp8 = encoder.load(name, device="cuda", quantization="fp8")
                for label, images in (("photographs", photos), ("random pixels", noise)):
                    r = {"model": name, "kept bf16": policy or "-", "set": label, **compare(bf16, fp8, images)}
                    r["meets_bar"] = r["token_mean"] >= MEAN_BAR and r["token_worst"] >= WORST_BAR
                    rows.append(r)
                del fp8
                torch.cuda.empty_cache()
        del bf16
        torch.cuda.empty_cache()
    lines = [
        f"{torch.cuda.get_device_name()}, FP8 tower vs bf16 tower (same weights), eager, per-token cosine",
        "",
        "| model | kept bf16 | images | set | tokens | token mean | token worst | token 0.1% | image mean "
        "| image worst | bar |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['kept bf16']} | {r['images']} | {r['set']} | {r['tokens']} | {r['token_mean']:.5f} | "
            f"{r['token_worst']:.5f} | {r['token_p001']:.5f} | {r['image_mean']:.6f} | {r['image_worst']:.6f} | "
            f"{'met' if r['meets_bar'] else 'MISSED'} |"
        )
    print("\n".join(lines))
    write_results(args.json, {"rows": rows}, None, "\n".join(lines))
    return 0 if all(r["meets_bar"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
