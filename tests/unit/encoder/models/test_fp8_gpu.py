"""FP8 on request on the GPU (compute capability 8.9 or newer): `torch._scaled_mm` against the CPU reference
of the same layer, the FP8 tower against bf16 (per-token cosine), graph replay against eager FP8.

Not run on the CPU (`gpu` mark); the CPU side of the arithmetic is test_fp8.py.
"""

from __future__ import annotations

import random
import warnings

import pytest
import torch
from torch import nn

import encoder
import workspace
from encoder.models.fp8 import Fp8Linear
from tests.graph_cases import graphs_only, random_batch, rel_err, split_grids

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
        reason="FP8 GEMMs need a CUDA GPU of compute capability 8.9 or newer",
    ),
]
# per-token cosine of the FP8 tower's output tokens against the bf16 tower's (issue 45's acceptance bar)
MEAN_COSINE, WORST_COSINE = 0.999, 0.995
MODELS = ["qwen2.5-vl-7b", "qwen2-vl-2b", "qwen3-vl-8b", "siglip-so400m-14-384", "clip-vit-l-14"]


def load(name: str, **kwargs) -> encoder.VisionEncoder:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", encoder.RandomWeightsWarning)
        return encoder.load(name, device="cuda", **kwargs)


def images_for(vision: encoder.VisionEncoder, seed: int) -> encoder.PatchBatch:
    if vision.fixed_resolution:
        grids = [[1, vision.config.grid, vision.config.grid]] * 4
    else:
        grids = [[1, 14, 14], [1, 28, 20], [1, 56, 40], [1, 64, 64]]
    return random_batch(grids, vision.config.patch_dim, seed=seed)


@pytest.mark.parametrize("shape", [(1, 1280, 3840), (37, 1280, 1280), (4096, 1280, 3456), (300, 4352, 1152)])
def test_scaled_mm_matches_the_cpu_reference(shape):
    """The cuBLASLt / CUTLASS GEMM computes what the CPU reference does (same quantised operands), up to
    the bf16 rounding of the output and the order of float32 accumulation."""
    m, k, n = shape
    torch.manual_seed(0)
    linear = nn.Linear(k, n).cuda().to(torch.bfloat16)
    layer = Fp8Linear.from_linear(linear)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        got = layer(x)
        want = layer.to("cpu")(x.cpu().float()).to(torch.bfloat16)  # the reference on the same e4m3 operands
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    assert rel_err(got.cpu(), want) <= 1e-2, rel_err(got.cpu(), want)


@pytest.mark.parametrize("name", MODELS)
def test_fp8_tower_is_close_to_bf16_per_token(name):
    bf16 = load(name)
    fp8 = load(name, quantization="fp8")
    assert fp8.quantization == "fp8" and fp8.dtype == torch.bfloat16
    assert sum(isinstance(m, Fp8Linear) for m in fp8.model.modules()) == 4 * len(fp8.model.transformer_blocks())
    for seed in range(3):
        batch = images_for(bf16, seed)
        want, got = bf16.forward_packed(batch).float(), fp8.forward_packed(batch).float()
        assert torch.isfinite(got).all()
        cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)
        assert cos.mean() >= MEAN_COSINE and cos.min() >= WORST_COSINE, (name, cos.mean().item(), cos.min().item())


@pytest.mark.parametrize("name", ["qwen2.5-vl-7b", "qwen3-vl-8b", "siglip-so400m-14-384"])
def test_graph_replay_equals_eager_fp8(name):
    """The activation scales are computed inside the captured graph: replay == eager FP8 on random splits
    (a host read during capture would have failed the capture)."""
    vision = load(name, quantization="fp8")
    graph = graphs_only(workspace.GraphEncoder(vision, debug=True))
    assert graph.stats()["captures"] > 0
    rng = random.Random(0)
    for case in range(30):
        if vision.fixed_resolution:
            grids = [[1, vision.config.grid, vision.config.grid]] * rng.randint(1, 16)
        else:
            grids = split_grids([256, 1024, 4096, 4092][case % 4], rng, max_side=64)
        batch = random_batch(grids, vision.config.patch_dim, seed=case)
        got = graph.encode(batch, pooling="none")
        want = vision.encode(batch, pooling="none")
        for a, b in zip(got, want, strict=True):
            assert a.shape == b.shape and torch.isfinite(a).all()
            assert rel_err(a, b) <= 1e-2, (case, rel_err(a, b))
    assert sum(graph.stats()["replays"].values()) >= 30


# -- the Triton kernels that write FP8 rows, against their torch references (same inputs) ---------------
E4M3_STEP = 1 / 8  # one e4m3 step, relative: the kernels and the references may round a tie differently


def assert_rows_close(got, want_values: torch.Tensor):
    """`got` (Fp8Rows) quantises `want_values` (float32) as the reference does: the same per-row scales, and
    every value within one e4m3 step of the reference's (division and rounding order may differ by an ulp)."""
    from encoder.kernels.fp8 import rows_reference

    ref = rows_reference(want_values.cpu())
    torch.testing.assert_close(got.scale.cpu(), ref.scale, rtol=1e-6, atol=0)
    a, b = got.q.float().cpu(), ref.q.float()
    assert ((a - b).abs() <= E4M3_STEP * b.abs() + 2**-9).all()
    assert (a == b).float().mean() > 0.99


@pytest.mark.parametrize("cols", [1280, 1152, 3456, 4352])
def test_quantize_rows_kernel_matches_the_reference(cols):
    from encoder.kernels.fp8 import quantize_rows

    x = (torch.randn(513, cols, device="cuda") * torch.logspace(-3, 2, 513, device="cuda")[:, None]).bfloat16()
    got = quantize_rows(x)
    assert got.q.dtype == torch.float8_e4m3fn and got.scale.shape == (513, 1)
    assert_rows_close(got, x.float())


@pytest.mark.parametrize("rms", [True, False])
def test_add_norm_fp8_kernel_matches_the_reference(rms):
    from encoder.kernels.elementwise import add_norm

    torch.manual_seed(1)
    x, r = torch.randn(300, 1280, device="cuda"), torch.randn(300, 1280, device="cuda").bfloat16()
    w, b = torch.rand(1280, device="cuda").bfloat16() + 0.5, torch.randn(1280, device="cuda").bfloat16()
    total, rows = add_norm(x, r, w, b, 1e-6, rms=rms, fp8=True)
    _, want = add_norm(x.cpu(), r.cpu(), w.cpu(), b.cpu(), 1e-6, rms=rms)  # the bf16 reference, for its values
    s = x.cpu() + r.cpu().float()
    ref = (
        w.cpu().float() * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6))
        if rms
        else torch.nn.functional.layer_norm(s, (1280,), w.cpu().float(), b.cpu().float(), 1e-6)
    )
    torch.testing.assert_close(total.cpu(), s)
    assert rel_err(want.float(), ref) < 1e-2
    assert_rows_close(rows, ref)


@pytest.mark.parametrize("act", ["silu_mul", "quick_gelu", "gelu_tanh"])
def test_activation_fp8_kernels_match_the_reference(act):
    from encoder.kernels import elementwise

    torch.manual_seed(2)
    h = (torch.randn(257, 2 * 3456 if act == "silu_mul" else 4352, device="cuda") * 3).bfloat16()
    fn = getattr(elementwise, act)
    rows, plain = fn(h, fp8=True), fn(h)
    want = fn(h.cpu().float())  # the float32 reference on the CPU
    assert rel_err(plain.float().cpu(), want) < 1e-2
    assert_rows_close(rows, want)
