"""FP8 on request (`encoder.models.fp8`, `encoder.load(..., quantization="fp8")`) on the CPU: the quantisation
arithmetic against a float reference, the load-time conversion on the tiny presets, the refusals.

The bound every test uses: e4m3 keeps 3 mantissa bits, so a value v = x / scale (|v| <= 448) rounds to within
half a unit in the last place, 2^-4 |v| (relative to v, for normal values: |v| >= 2^-6), and to within half the
subnormal step, 2^-10, below that. Back in x's units: |dequantise(quantise(x)) - x| <= max(|x| / 16, scale / 1024).
The GPU side (`_scaled_mm`, graph == eager, quality against bf16) is test_fp8_gpu.py.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import encoder
from encoder.api import check_quantization, quantize_tower
from encoder.errors import ConfigError
from encoder.models.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    Fp8Linear,
    dequantize,
    quantize_blocks,
    quantize_rows,
    quantize_weight,
)

SLACK = 1 + 1e-5  # float32 division and product around the e4m3 rounding


def element_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The largest |dequantised - x| e4m3 allows, per element (the module docstring's derivation)."""
    return torch.maximum(x.abs() / 16, scale / 1024) * SLACK


def rows_of_many_magnitudes(rows: int, cols: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    magnitudes = 10.0 ** torch.linspace(-4, 3, rows)[:, None]  # each row's own range: the scales must follow it
    return torch.randn(rows, cols, generator=gen) * magnitudes


def test_quantize_weight_is_per_output_channel_within_the_e4m3_bound():
    w = rows_of_many_magnitudes(48, 96, seed=0)
    q, scale = quantize_weight(w)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (48,)
    torch.testing.assert_close(scale, w.abs().amax(1) / FP8_MAX)  # amax / 448 per row
    err = (dequantize(q, scale[:, None]) - w).abs()
    bound = element_bound(w, scale[:, None])
    assert (err <= bound).all(), (err / bound).max()
    assert (err / bound).max() > 0.25  # the bound is near what happens, not vacuous
    assert q.float().abs().amax(1).eq(FP8_MAX).all()  # each row's largest value uses e4m3's whole range


def test_quantize_rows_is_per_token_within_the_e4m3_bound():
    x = rows_of_many_magnitudes(33, 64, seed=1).to(torch.bfloat16)  # activations come in the model dtype
    q, scale = quantize_rows(x)
    assert q.dtype == FP8_DTYPE and q.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == (33, 1)
    err = (dequantize(q, scale) - x.float()).abs()
    bound = element_bound(x.float(), scale)
    assert (err <= bound).all(), (err / bound).max()


def test_exact_scales_and_values_on_hand_made_rows():
    # a row whose amax is 448 * s has scale s; with s a power of two, values k * s with k representable in
    # e4m3 (integers up to 16, 448, 0.5, ...) come back exactly
    x = torch.tensor(
        [
            [448 * 0.25, -3 * 0.25, 0.5 * 0.25, 0.0],
            [-448 * 2.0, 16 * 2.0, 1 * 2.0, -0.125 * 2.0],
            [448.0, 448.0, -448.0, 1.0],
        ]
    )
    q, scale = quantize_rows(x)
    assert scale.view(-1).tolist() == [0.25, 2.0, 1.0]
    assert torch.equal(dequantize(q, scale), x)
    qw, sw = quantize_weight(x)
    assert sw.tolist() == [0.25, 2.0, 1.0] and torch.equal(qw.float(), q.float())
    # a value between two e4m3 neighbours rounds to the nearer: 448 and 416 are neighbours (step 32 above 256)
    q, scale = quantize_rows(torch.tensor([[448.0, 430.0, 434.0]]))
    assert dequantize(q, scale).tolist() == [[448.0, 416.0, 448.0]]


def test_zero_rows_give_zeros_and_finite_scales():
    x = torch.zeros(3, 32)
    x[1, 5] = 7.0
    for q, scale in (quantize_rows(x), (lambda qw, sw: (qw, sw[:, None]))(*quantize_weight(x))):
        assert torch.isfinite(scale).all() and (scale > 0).all()
        deq = dequantize(q, scale)
        assert torch.isfinite(deq).all()
        assert torch.equal(deq[0], torch.zeros(32)) and torch.equal(deq[2], torch.zeros(32))
        assert deq[1, 5] == 7.0


def test_values_a_hair_over_the_range_saturate_instead_of_nan():
    # x / (amax / 448) can round above 448 in float32; e4m3fn has no infinity, so the cast would give NaN
    x = torch.tensor([[3.0e-3, 1.1e-3], [1.0 / 3.0, -1.0 / 7.0], [123.456, 1e-7]])
    q, scale = quantize_rows(x)
    assert not torch.isnan(q.float()).any()
    assert q.float().abs().amax(1).eq(FP8_MAX).all()


def test_activation_quantisation_reads_nothing_back_to_the_host(monkeypatch):
    """What a CUDA graph can capture: no `.item()`, `.tolist()`, bool or number of a tensor (each a host sync)."""

    def refuse(*args, **kwargs):
        raise AssertionError("a host read inside the activation quantisation")

    x = torch.randn(10, 32, dtype=torch.bfloat16)
    layer = Fp8Linear.from_linear(nn.Linear(32, 16).to(torch.bfloat16))
    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    q, scale = quantize_rows(x)
    y = layer(x)
    monkeypatch.undo()
    assert isinstance(q, torch.Tensor) and isinstance(scale, torch.Tensor) and y.shape == (10, 16)


def linear_error_bound(x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """Per output: sum_k |dx_k| |w_k| + |x_k| |dw_k| + |dx_k| |dw_k| with each |d| at its element bound, plus
    float32 accumulation; in float64."""
    x2 = x.reshape(-1, x.shape[-1]).double()
    w = linear.weight.double()
    dx = element_bound(x2, x2.abs().amax(1, keepdim=True) / FP8_MAX)
    dw = element_bound(w, w.abs().amax(1, keepdim=True) / FP8_MAX)
    accumulate = 1e-5 * (x2.abs() @ w.abs().t())
    return dx @ w.abs().t() + x2.abs() @ dw.t() + dx @ dw.t() + accumulate


@pytest.mark.parametrize("bias", [True, False])
def test_fp8_linear_reference_is_nn_linear_within_the_quantisation_bound(bias):
    torch.manual_seed(2)
    linear = nn.Linear(64, 48, bias=bias)
    layer = Fp8Linear.from_linear(linear)
    assert (layer.in_features, layer.out_features) == (64, 48)
    assert layer.weight.dtype == FP8_DTYPE and layer.weight_scale.shape == (1, 48)
    assert list(layer.parameters()) == []  # buffers: nothing trains them; VisionEncoder.dtype stays the model's
    x = torch.randn(3, 5, 64) * torch.linspace(0.01, 10, 5)[None, :, None]  # leading dims, tokens of all sizes
    with torch.no_grad():
        want, got = linear(x), layer(x)
    assert got.shape == want.shape == (3, 5, 48) and got.dtype == x.dtype
    err = (got - want).abs().reshape(-1, 48).double()
    bound = linear_error_bound(x, linear)
    assert (err <= bound).all(), (err / bound).max()
    assert torch.nn.functional.cosine_similarity(got.reshape(-1, 48), want.reshape(-1, 48)).min() > 0.99


TINY = [
    "tiny", "tiny-qwen2-vl", "tiny-qwen3-vl", "tiny-clip", "tiny-siglip", "tiny-siglip2", "tiny-dinov2", "tiny-dinov3",
]  # fmt: skip
# the linear layers of one block after `fuse()`, per tower: what the conversion must replace, and nothing else
BLOCK_LINEARS = {
    "tiny": ("attn.qkv", "attn.proj", "mlp.gate_up", "mlp.down_proj"),
    "tiny-qwen2-vl": ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2"),
    "tiny-qwen3-vl": ("attn.qkv", "attn.proj", "mlp.linear_fc1", "mlp.linear_fc2"),
    "tiny-clip": ("self_attn.qkv_proj", "self_attn.out_proj", "mlp.fc1", "mlp.fc2"),
    "tiny-siglip": ("self_attn.qkv_proj", "self_attn.out_proj", "mlp.fc1", "mlp.fc2"),
    "tiny-siglip2": ("self_attn.qkv_proj", "self_attn.out_proj", "mlp.fc1", "mlp.fc2"),
    "tiny-dinov2": ("attention.qkv_proj", "attention.output.dense", "mlp.fc1", "mlp.fc2"),
    "tiny-dinov3": ("attention.qkv_proj", "attention.o_proj", "mlp.up_proj", "mlp.down_proj"),
}


def load_quiet(name: str) -> encoder.VisionEncoder:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", encoder.RandomWeightsWarning)
        return encoder.load(name, device="cpu")


def random_images(vision: encoder.VisionEncoder, sizes, seed: int) -> encoder.PatchBatch:
    gen = torch.Generator().manual_seed(seed)
    return vision.preprocess(
        [torch.randint(0, 256, (h, w, 3), generator=gen, dtype=torch.uint8).numpy() for h, w in sizes]
    )


@pytest.mark.parametrize("name", TINY)
def test_conversion_replaces_exactly_the_blocks_linear_layers(name):
    vision = load_quiet(name)
    assert vision.quantization is None
    tower = vision.model
    batch = random_images(vision, [(56, 84), (120, 120)], seed=3)
    before = vision.run_packed(batch)
    linears_before = {n for n, m in tower.named_modules() if type(m) is nn.Linear}

    converted = quantize_tower(tower, "fp8")

    depth = len(tower.transformer_blocks())
    assert converted == [f"{i}.{layer}" for i in range(depth) for layer in BLOCK_LINEARS[name]]
    fp8 = {n for n, m in tower.named_modules() if isinstance(m, Fp8Linear)}
    assert len(fp8) == 4 * depth
    kept = {n for n, m in tower.named_modules() if type(m) is nn.Linear}
    assert kept and not any(".blocks." in f".{n}" or ".layers." in n for n in kept)  # the blocks hold none
    assert kept <= linears_before  # patch embedding, mergers, heads: the same modules as before
    assert all(n.split(".")[0] in ("patch_embed", "merger", "deepstack_merger_list", "embeddings", "head",
                                   "visual_projection") for n in kept)  # fmt: skip
    # attention backends untouched; the GEMM widths fit _scaled_mm (multiples of 16)
    assert all(
        getattr(b, "attn", getattr(b, "self_attn", getattr(b, "attention", None))).backend is not None
        for b in tower.transformer_blocks()
    )
    assert all(
        m.in_features % 16 == 0 and m.out_features % 16 == 0 for m in tower.modules() if isinstance(m, Fp8Linear)
    )
    # GraphEncoder's own fuse() afterwards (any multiple) changes nothing: the layout is final
    modules = dict(tower.named_modules())
    tower.fuse(128)
    tower.fuse(256)
    assert dict(tower.named_modules()).keys() == modules.keys()
    assert all(m is modules[n] for n, m in tower.named_modules())
    # the quantised tower (float32 reference GEMMs here) stays close to the float one
    after = vision.run_packed(batch)
    cos = torch.nn.functional.cosine_similarity(after.tokens.float(), before.tokens.float())
    assert torch.isfinite(after.tokens).all() and cos.min() > 0.99, cos.min()


def test_no_quantization_changes_nothing():
    vision = load_quiet("tiny")
    modules = dict(vision.model.named_modules())
    assert quantize_tower(vision.model, None) == []
    assert dict(vision.model.named_modules()) == modules


def test_layers_the_fp8_gemm_cannot_take_stay_in_the_model_dtype():
    block = nn.Module()
    block.ok, block.odd = nn.Linear(32, 48), nn.Linear(32, 40)  # 40 is not a multiple of 16
    assert quantize_blocks([block]) == ["0.ok"]
    assert isinstance(block.ok, Fp8Linear) and type(block.odd) is nn.Linear


def test_load_refuses_fp8_on_the_cpu_naming_quantization_and_the_device():
    with pytest.raises(ConfigError) as err:
        encoder.load("tiny", device="cpu", quantization="fp8")
    msg = str(err.value)
    assert "quantization 'fp8'" in msg and "compute capability 8.9" in msg and "this device is cpu" in msg
    assert "\n" not in msg


@pytest.mark.parametrize("bad", ["int8", "FP8", "", 8, ["fp8"]])
def test_load_refuses_unknown_quantizations(bad):
    with pytest.raises(ConfigError, match=r"^unknown quantization .*; expected None or fp8$"):
        encoder.load("tiny", device="cpu", quantization=bad)


def test_fp8_is_refused_on_gpus_older_than_ada_and_outside_bfloat16(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(
        ConfigError, match=r"quantization 'fp8' needs .* 8\.9 or newer .*cuda:0 \(NVIDIA A100.*\) is 8\.0"
    ):
        check_quantization("fp8", cuda, torch.bfloat16)
    for capability in ((8, 9), (9, 0), (10, 0)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert check_quantization("fp8", cuda, torch.bfloat16) == "fp8"
    with pytest.raises(ConfigError, match=r"quantization 'fp8' runs with dtype bfloat16 only .*float16"):
        check_quantization("fp8", cuda, torch.float16)
    assert check_quantization(None, torch.device("cpu"), torch.float32) is None


# -- producers that write FP8 rows themselves (the norm before qkv / fc1, the MLP activation before fc2) --
def norm_reference(s: torch.Tensor, weight, bias, eps: float, rms: bool) -> torch.Tensor:
    if rms:
        return weight.float() * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps))
    return torch.nn.functional.layer_norm(s, (s.shape[-1],), weight.float(), bias.float(), eps)


@pytest.mark.parametrize("rms", [True, False])
def test_add_norm_writes_fp8_rows_of_the_float32_norm(rms):
    from encoder.kernels.elementwise import add_norm
    from encoder.kernels.fp8 import Fp8Rows

    gen = torch.Generator().manual_seed(4)
    x, r = torch.randn(9, 48, generator=gen) * 3, torch.randn(9, 48, generator=gen).to(torch.bfloat16)
    weight = (torch.rand(48, generator=gen) + 0.5).to(torch.bfloat16)
    bias = torch.randn(48, generator=gen).to(torch.bfloat16)
    total, rows = add_norm(x, r, weight, bias, 1e-6, rms=rms, fp8=True)
    assert isinstance(rows, Fp8Rows) and rows.q.dtype == FP8_DTYPE and rows.scale.shape == (9, 1)
    torch.testing.assert_close(total, x + r.float())  # the float32 stream is unchanged by fp8
    want = norm_reference(total, weight, bias, 1e-6, rms)
    torch.testing.assert_close(rows.scale, want.abs().amax(1, keepdim=True) / FP8_MAX)
    err = (dequantize(*rows) - want).abs()
    assert (err <= element_bound(want, rows.scale)).all()


@pytest.mark.parametrize("act", ["silu_mul", "quick_gelu", "gelu_tanh"])
def test_activations_write_fp8_rows_of_the_float32_activation(act):
    from encoder.kernels import elementwise

    gen = torch.Generator().manual_seed(5)
    h = (torch.randn(7, 64, generator=gen) * 4).to(torch.bfloat16)
    fn = getattr(elementwise, act)
    want16 = fn(h)
    rows = fn(h, fp8=True)
    hf = h.float()
    if act == "silu_mul":
        want = torch.nn.functional.silu(hf[:, :32]) * hf[:, 32:]
    elif act == "quick_gelu":
        want = hf * torch.sigmoid(1.702 * hf)
    else:
        want = torch.nn.functional.gelu(hf, approximate="tanh")
    assert want16.dtype == torch.bfloat16 and want16.shape == want.shape == rows.q.shape
    torch.testing.assert_close(want16.float(), want, rtol=1e-2, atol=1e-2)
    err = (dequantize(*rows) - want).abs()
    assert (err <= element_bound(want, rows.scale)).all()
    assert (err > 0).any()  # quantised, not passed through


def test_fp8_linear_takes_rows_its_producer_quantised_as_it_quantises_a_tensor():
    from encoder.kernels.fp8 import Fp8Rows

    torch.manual_seed(6)
    layer = Fp8Linear.from_linear(nn.Linear(32, 24).to(torch.bfloat16))
    x = torch.randn(5, 32).to(torch.bfloat16)
    q, scale = quantize_rows(x)
    from_rows = layer(Fp8Rows(q, scale))
    assert from_rows.dtype == torch.bfloat16 and from_rows.shape == (5, 24)
    torch.testing.assert_close(from_rows, layer(x), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen3-vl", "tiny-clip"])
def test_layers_kept_in_the_model_dtype_by_role_and_block_and_the_tower_still_runs(name):
    """`quantize_blocks(keep=...)` (what benchmarks/fp8_quality.py --keep measures): the kept layers stay
    nn.Linear, their producers then write 16-bit activations, and the mixed tower stays close to the float one."""
    vision = load_quiet(name)
    tower = vision.model
    batch = random_images(vision, [(56, 84), (120, 120)], seed=7)
    before = vision.run_packed(batch)
    tower.fuse()
    blocks = tower.transformer_blocks()
    depth = len(blocks)
    converted = quantize_blocks(blocks, keep=lambda i, n, role: role == "mlp_out" or i == n - 1)
    want = [f"{i}.{layer}" for i in range(depth - 1) for layer in BLOCK_LINEARS[name][:3]]
    assert converted == want
    assert all(type(m) is nn.Linear for m in blocks[-1].modules() if isinstance(m, (nn.Linear, Fp8Linear)))
    after = vision.run_packed(batch)
    cos = torch.nn.functional.cosine_similarity(after.tokens.float(), before.tokens.float())
    assert torch.isfinite(after.tokens).all() and cos.min() > 0.99, cos.min()
