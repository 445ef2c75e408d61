"""Every registered attention backend against a float64 reference, on the varlen contract.

CPU runs cover the backends usable here (sdpa; triton through TRITON_INTERPRET at tiny sizes) in
fp32/fp16; the rest skip with the backend's own reason. `gpu`-marked tests (bf16, real Qwen2.5-VL
sizes, CUDA-graph replay with rewritten cu_seqlens) run on the device only: the Triton interpreter
computes bf16 wrongly, so bf16 is never checked on CPU.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import types
from pathlib import Path

import pytest
import torch

# the package is not installed in the venv; make the repo root importable from a bare `pytest` run
_ROOT = str(Path(__file__).resolve().parents[3])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from encoder.attention import available_backends as _available_backends  # noqa: E402
from encoder.attention import backend_names, get_backend  # noqa: E402
from encoder.attention.base import AttentionBackend  # noqa: E402
from encoder.attention.registry import _REGISTRY  # noqa: E402
from encoder.errors import BackendUnavailableError  # noqa: E402

NAMES = backend_names()
TOL = {torch.float32: 1e-4, torch.float16: 2e-3}
SENTINEL = 8192.0  # exact in fp16 and bf16 (1e4 rounds to 9984 in bf16); padding rows must still hold it (or zero)

# name -> (segment lengths, trailing empty segments, bucket padding rows, max_seqlen or None = exact)
SPLITS = {
    "one_segment": ([37], 0, 0, None),
    "empty_mid_and_end": ([16, 0, 23, 9], 2, 7, None),
    "loose_max_seqlen": ([1, 5, 0, 0, 31], 1, 3, 64),
    "windows": ([8] * 6, 3, 5, 8),
    "full_block": ([64], 0, 0, None),
    "all_empty": ([0, 0], 1, 8, 16),
    "all_empty_zero_bound": ([0, 0], 1, 8, 0),  # 0 is an upper bound when every segment is empty
}


@functools.cache
def available_backends() -> dict[str, str | None]:
    return _available_backends()


def backend_or_skip(name: str, device, dtype: torch.dtype, head_dim: int) -> AttentionBackend:
    reason = available_backends()[name]
    if reason is not None:
        pytest.skip(f"backend {name!r} unavailable here: {reason}")
    backend = get_backend(name)
    reason = backend.supports(torch.device(device), dtype, head_dim)
    if reason is not None:
        pytest.skip(f"backend {name!r} does not support {device}/{dtype}/head_dim={head_dim}: {reason}")
    return backend


def make_case(lengths, trailing, pad, heads, head_dim, dtype, device="cpu", seed=0):
    """Random packed q/k/v (padding rows too, scaled up so any leak into real rows shows)."""
    g = torch.Generator().manual_seed(seed)
    real = sum(lengths)
    total = real + pad
    q, k, v = (torch.randn(total, heads, head_dim, generator=g) for _ in range(3))
    for x in (q, k, v):
        x[real:] *= 100
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    bounds += [bounds[-1]] * trailing  # trailing repeats = empty segments, as the graph runner pads
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    return tuple(x.to(device=device, dtype=dtype) for x in (q, k, v)) + (cu,)


def poisoned_out(like: torch.Tensor, real: int) -> torch.Tensor:
    """NaN in real rows (so unwritten rows fail), a finite sentinel in padding rows."""
    out = torch.full_like(like, float("nan"))
    out[real:] = SENTINEL
    return out


def reference(q, k, v, cu) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v per segment in float64; padding rows zero."""
    q, k, v = (x.double().cpu() for x in (q, k, v))
    out = torch.zeros_like(q)
    bounds = cu.tolist()
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        if b == a:
            continue
        qs, ks, vs = (x[a:b].transpose(0, 1) for x in (q, k, v))  # [H, L, D]
        p = torch.softmax(qs @ ks.transpose(1, 2) / math.sqrt(q.shape[-1]), dim=-1)
        out[a:b] = (p @ vs).transpose(0, 1)
    return out


def check(out, ref, real: int, dtype: torch.dtype, tol: float) -> None:
    got = out[:real].double().cpu()
    assert torch.isfinite(got).all(), "rows inside segments left unwritten (NaN) or non-finite"
    if real:
        err = ((got - ref[:real]).abs().max() / ref[:real].abs().max()).item()
        assert err <= tol, f"relative error {err:.3g} > {tol:g} ({dtype})"
    pad = out[real:].float().cpu()
    assert torch.isfinite(pad).all(), "padding rows past cu_seqlens[-1] became non-finite"
    assert ((pad == SENTINEL) | (pad == 0)).all(), "padding rows must be left untouched or zeroed"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 72, 80])
@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("name", NAMES)
def test_matches_reference_cpu(name, split, head_dim, dtype):
    backend = backend_or_skip(name, "cpu", dtype, head_dim)
    lengths, trailing, pad, max_seqlen = SPLITS[split]
    q, k, v, cu = make_case(lengths, trailing, pad, heads=2, head_dim=head_dim, dtype=dtype)
    real = sum(lengths)
    out = poisoned_out(q, real)
    result = backend(q, k, v, cu, max_seqlen or max(lengths), out)
    assert result is out
    check(out, reference(q, k, v, cu), real, dtype, TOL[dtype])


@pytest.mark.parametrize("name", NAMES)
def test_strided_qkv_views(name):
    """q/k/v as views of one fused qkv projection [S, 3, H, D], the layout the towers produce."""
    backend = backend_or_skip(name, "cpu", torch.float32, 80)
    lengths, trailing, pad = [20, 0, 12], 1, 4
    q, k, v, cu = make_case(lengths, trailing, pad, heads=2, head_dim=80, dtype=torch.float32)
    qkv = torch.stack([q, k, v], dim=1)
    out = poisoned_out(q, sum(lengths))
    backend(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu, max(lengths), out)
    check(out, reference(q, k, v, cu), sum(lengths), torch.float32, TOL[torch.float32])


def test_unknown_backend_lists_known():
    with pytest.raises(BackendUnavailableError, match="nope") as info:
        get_backend("nope")
    assert "sdpa" in str(info.value)


class _NeverAvailable(AttentionBackend):
    name = "never"

    @classmethod
    def unavailable_reason(cls):
        return "needs hardware we do not have"

    def forward(self, q, k, v, cu_seqlens, max_seqlen, out):  # pragma: no cover
        raise AssertionError("must not be constructed")


def test_unavailable_backend_lists_available(monkeypatch):
    module = types.ModuleType("_fake_attention_backends")
    module.NeverAvailable = _NeverAvailable
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(_REGISTRY, "never", f"{module.__name__}:NeverAvailable")
    monkeypatch.setitem(_REGISTRY, "broken", "encoder.attention._no_such_module:Nothing")
    with pytest.raises(BackendUnavailableError) as info:
        get_backend("never")
    msg = str(info.value)
    assert "needs hardware we do not have" in msg
    available = msg.split("available:")[-1]
    assert "sdpa" in available and "never" not in available and "broken" not in available
    with pytest.raises(BackendUnavailableError, match="import failed"):
        get_backend("broken")


def test_flash_backends_refuse_fp32_and_cpu():
    from encoder.attention.flash import FlashAttn2, FlashAttn3
    from encoder.attention.torch_varlen import TorchVarlenAttention

    for cls in (FlashAttn2, FlashAttn3, TorchVarlenAttention):
        assert "fp16/bf16" in cls().supports(torch.device("cuda"), torch.float32, 80)
        assert "CUDA" in cls().supports(torch.device("cpu"), torch.float16, 80)


def test_hopper_only_backends_unavailable_on_older_gpus(monkeypatch):
    """fa3/fa4 where their package imports but every GPU is pre-Hopper: unavailable, with the reason (they were
    listed as usable there, so `encoder.load(attention="fa4")` and the `available` lists disagreed); compute
    capabilities read "9.0", not a tuple's repr."""
    from encoder.attention import flash

    caps = {0: (8, 0), 1: (8, 6)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(caps))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: caps[getattr(d, "index", d) or 0])
    for cls in (flash.FlashAttn2, flash.FlashAttn3, flash.FlashAttn4):
        monkeypatch.setattr(cls, "_loaded", (lambda *args, **kwargs: None, True))  # the package "imports"
    assert flash.FlashAttn2.unavailable_reason() is None  # Ampere is enough for FA2
    for cls in (flash.FlashAttn3, flash.FlashAttn4):
        why = cls.unavailable_reason()
        assert why == f"{cls.name} needs a GPU of compute capability >= 9.0; the GPUs here have 8.0, 8.6"
        assert cls().supports(torch.device("cuda", 0), torch.bfloat16, 80).endswith(">= 9.0, device has 8.0")
    caps[1] = (9, 0)  # one Hopper among them: available (`supports` still refuses the older device)
    assert flash.FlashAttn4.unavailable_reason() is None
    assert flash.FlashAttn4().supports(torch.device("cuda", 1), torch.bfloat16, 80) is None


def test_a_broken_optional_package_or_registration_is_a_reason_not_a_crash(monkeypatch):
    """A flash package that raises something other than ImportError at import (a CUDA init RuntimeError, a
    version check), or a registration naming a class its module lacks: that backend is unavailable with the
    reason, and `available_backends()` (and so `auto`, on CPU too) still answers. Both raised out of it before."""
    import importlib

    from encoder.attention import flash, registry

    real = importlib.import_module

    def broken(name, *args, **kwargs):
        if name.startswith(("flash_attn", "flash_attn_interface")):
            raise RuntimeError("CUDA driver initialization failed")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib, "import_module", broken)
    for cls in (flash.FlashAttn2, flash.FlashAttn3, flash.FlashAttn4):
        monkeypatch.setattr(cls, "_loaded", None)
    monkeypatch.setitem(registry._REGISTRY, "no_such_class", "encoder.attention.sdpa:NoSuchBackend")
    reasons = _available_backends()
    for name in ("flash_attn", "fa3", "fa4"):
        assert "RuntimeError: CUDA driver initialization failed" in reasons[name], reasons[name]
    assert "NoSuchBackend" in reasons["no_such_class"] and reasons["sdpa"] is None


def test_triton_config_table():
    pytest.importorskip("triton")
    from encoder.attention.triton_varlen import TritonVarlenAttention, pick_config

    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for head_dim in (16, 64, 72, 80, 128, 200, 256):
            for max_seqlen in (1, 16, 64, 100, 256, 1024, 32768):
                cfg = pick_config(dtype, head_dim, max_seqlen)
                for block in (cfg.block_m, cfg.block_n):
                    assert block >= 16 and block & (block - 1) == 0, cfg
    assert "head_dim" in TritonVarlenAttention().supports(torch.device("cuda"), torch.float16, 257)


# ---------------------------------------------------------------- GPU only (run on the device)


def _sdpa_fp32(q, k, v, cu, max_seqlen):
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    return get_backend("sdpa")(q.float(), k.float(), v.float(), cu, max_seqlen, out)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", [(32, 256), (4, 4096)], ids=["32x256", "4x4096"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", NAMES)
def test_gpu_real_sizes(name, dtype, layout):
    backend = backend_or_skip(name, "cuda", dtype, 80)
    n, length = layout
    # a bucket: two empty trailing segments and 128 padding rows, as the graph runner pads
    q, k, v, cu = make_case([length] * n, 2, 128, heads=16, head_dim=80, dtype=dtype, device="cuda")
    real = n * length
    out = poisoned_out(q, real)
    backend(q, k, v, cu, length, out)
    torch.cuda.synchronize()
    check(out, _sdpa_fp32(q, k, v, cu, length).double().cpu(), real, dtype, 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_gpu_graph_replay_with_new_cu_seqlens(name):
    dtype = torch.bfloat16
    backend = backend_or_skip(name, "cuda", dtype, 80)
    real, pad, max_seqlen = 1024, 64, 1024
    # every split has the same total and 8 segments (trailing zeros = empty segments)
    splits = [
        [256, 256, 256, 256, 0, 0, 0, 0],
        [1024, 0, 0, 0, 0, 0, 0, 0],
        [128] * 8,
        [1, 500, 0, 23, 500, 0, 0, 0],
    ]
    q, k, v, cu = make_case(splits[0], 0, pad, heads=16, head_dim=80, dtype=dtype, device="cuda")
    out = poisoned_out(q, real)
    cu_of = lambda s: torch.tensor([0, *torch.tensor(s).cumsum(0).tolist()], dtype=torch.int32)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (Triton compiles, lazy imports) off the capture
        for _ in range(2):
            backend(q, k, v, cu, max_seqlen, out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend(q, k, v, cu, max_seqlen, out)

    for split in splits[1:] + splits[:1]:
        cu.copy_(cu_of(split))  # rewritten in place, as the runner does between replays
        out.copy_(poisoned_out(q, real))
        graph.replay()
        eager = poisoned_out(q, real)
        backend(q, k, v, cu, max_seqlen, eager)
        torch.cuda.synchronize()
        assert torch.equal(out[:real], eager[:real]), f"graph replay differs from eager for {split}"
        check(out, reference(q, k, v, cu), real, dtype, 1e-2)


def test_fa4_compile_cache_is_on_in_the_user_cache_before_its_import_unless_set(monkeypatch, tmp_path):
    """A restart reuses FA4's compiled kernels (its first start compiles ~3 s per configuration): the cache
    variables are set before flash_attn.cute is imported, in $XDG_CACHE_HOME; a value the user set is kept."""
    import importlib

    from encoder.attention import flash

    seen, real = {}, importlib.import_module

    def fake_import(name, *args, **kwargs):
        if name.startswith("flash_attn"):
            seen[name] = (os.environ.get(flash.FA4_CACHE_ENABLED), os.environ.get(flash.FA4_CACHE_DIR))
            raise ImportError("no flash-attn-4 here")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(flash.importlib, "import_module", fake_import)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    for name in (flash.FA4_CACHE_ENABLED, flash.FA4_CACHE_DIR):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(flash.FlashAttn4, "_loaded", None)
    assert "not importable" in flash.FlashAttn4.unavailable_reason()
    assert seen["flash_attn.cute.interface"] == ("1", str(tmp_path / "vision-encoder" / "fa4"))

    monkeypatch.setenv(flash.FA4_CACHE_ENABLED, "0")  # the user's choice wins
    monkeypatch.setattr(flash.FlashAttn4, "_loaded", None)
    flash.FlashAttn4.unavailable_reason()
    assert seen["flash_attn.cute.interface"][0] == "0"
