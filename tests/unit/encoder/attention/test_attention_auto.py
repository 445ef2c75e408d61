"""`attention="auto"` and per-kind attention: the rule, the dispatch by a call's static bounds, the CPU
fallback to the reference, and the errors of a bad choice."""

from __future__ import annotations

import pytest
import torch

import encoder
import workspace
from encoder.api import attention_plan
from encoder.attention import AutoAttention, available_backends, graph_token_cap, resolve_attention
from encoder.attention.auto import SHORT_SEGMENT, ranking
from encoder.attention.base import AttentionBackend
from encoder.attention.sdpa import SdpaAttention
from encoder.errors import BackendUnavailableError, ConfigError
from encoder.loading.presets import preset
from tests.graph_cases import random_batch, rel_err


class Recording(AttentionBackend):
    """The reference attention, counting its calls."""

    def __init__(self, name: str):
        self.name, self.calls, self.ref = name, [], SdpaAttention()

    def forward(self, q, k, v, cu_seqlens, max_seqlen, out):
        self.calls.append(max_seqlen)
        return self.ref.forward(q, k, v, cu_seqlens, max_seqlen, out)


def test_rule_short_segments_to_triton_long_and_head_dim_72_to_fa4():
    assert ranking(64, 80)[0] == "triton" and ranking(SHORT_SEGMENT, 64)[0] == "triton"
    assert ranking(SHORT_SEGMENT + 1, 80)[0] == "fa4" and ranking(4096, 80)[0] == "fa4"
    assert ranking(196, 72)[0] == "fa4"  # Qwen3-VL / SigLIP: our kernel pads 72 to 128 lanes
    assert all(r[-1] == "sdpa" for r in (ranking(64, 80), ranking(4096, 72)))


def test_auto_dispatches_on_the_static_bound_and_records_it():
    fast_short, fast_long = Recording("triton"), Recording("fa4")
    auto = AutoAttention("full", {"triton": fast_short, "fa4": fast_long})
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(300, 2, 16, generator=gen) for _ in range(3))
    cu = torch.tensor([0, 100, 300], dtype=torch.int32)
    for bound in (200, 2048):
        out = torch.full_like(q, float("nan"))
        auto(q, k, v, cu, bound, out)
        ref = torch.empty_like(q)
        SdpaAttention()(q, k, v, cu, 200, ref)
        assert rel_err(out, ref) <= 1e-6
    assert fast_short.calls == [200] and fast_long.calls == [2048]
    assert auto.describe() == "triton (segments <= 200), fa4 (segments <= 2048)"
    # a missing first choice falls through the ranking
    only = AutoAttention("window", {"sdpa": Recording("sdpa")})
    only(q, k, v, cu, 64, torch.empty_like(q))
    assert only.describe() == "sdpa (segments <= 64)"


def test_fa4_reports_why_it_is_unavailable_on_cpu():
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine may have flash-attn-4")
    why = available_backends()["fa4"]
    assert why and ("flash_attn" in why or "CUDA" in why)


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen3-vl", "tiny-clip"])
def test_auto_on_cpu_is_the_reference(name):
    auto = encoder.load(name, device="cpu")  # the default is auto
    ref = encoder.load(name, device="cpu", attention="sdpa")
    assert all(isinstance(b, AutoAttention) for b in auto.model.backends.values())
    assert set(auto.model.backends) == set(auto.model.attention_kinds)
    assert all(list(b.candidates) == ["sdpa"] for b in auto.model.backends.values())
    cfg = auto.config
    grids = [[1, 8, 8], [1, 4, 6]] if cfg.family != "clip" else [[1, cfg.grid, cfg.grid]] * 2
    batch = random_batch(grids, cfg.patch_dim, seed=1)
    for a, b in zip(auto.encode(batch), ref.encode(batch), strict=True):
        assert torch.equal(a, b)
    stats = workspace.GraphEncoder(auto).stats()["attention"]
    assert set(stats) == set(auto.model.attention_kinds) and all("sdpa" in v for v in stats.values())


def test_per_kind_choice_and_its_errors():
    enc = encoder.load("tiny", device="cpu", attention={"window": "sdpa"})  # Qwen2.5: full + window
    assert enc.model.attention_kinds == ("full", "window")
    assert isinstance(enc.model.backends["full"], AutoAttention)
    assert enc.model.backends["window"].name == "sdpa"
    windowed = [blk.attn.backend for blk in enc.model.blocks if not blk.full_attention]
    assert windowed and all(b is enc.model.backends["window"] for b in windowed)
    with pytest.raises(ConfigError, match=r"layer kinds \['windows'\]; this model has \['full', 'window'\]"):
        encoder.load("tiny", device="cpu", attention={"windows": "sdpa"})
    with pytest.raises(ConfigError, match="has \\['full'\\]"):
        encoder.load("tiny-qwen3-vl", device="cpu", attention={"window": "sdpa"})
    with pytest.raises(BackendUnavailableError, match="'no_such'"):
        encoder.load("tiny", device="cpu", attention="no_such")
    with pytest.raises(ConfigError, match="mapping kind -> name, not int"):
        resolve_attention(3, ("full",), torch.device("cpu"), torch.float32, 16)
    with pytest.raises(BackendUnavailableError, match="'full' layers"):
        AutoAttention("full", {})


def test_attention_plan_without_weights_gives_the_graph_token_cap():
    """What a batch driver asks before any replica loads: the kinds' backends and the bucket cap."""
    plan = attention_plan(preset("tiny"), "cpu")
    assert set(plan) == {"full", "window"}
    enc = encoder.load("tiny", device="cpu")
    assert graph_token_cap(plan) == graph_token_cap(enc.model.backends) == SdpaAttention.max_graph_tokens
    assert graph_token_cap({"full": Recording("triton")}) is None


def test_per_kind_values_that_are_not_names():
    """A kind mapped to None (or "") is `auto`, as at the top level, never the slow reference forced; any other
    non-string value, or a non-string kind, is a ConfigError naming the kind and the type, never a TypeError
    or an object repr."""
    kinds, cpu = ("full", "window"), torch.device("cpu")
    for empty in (None, ""):
        got = resolve_attention({"full": empty, "window": "sdpa"}, kinds, cpu, torch.float32, 16)
        assert isinstance(got["full"], AutoAttention) and got["window"].name == "sdpa"
    for value, type_name in ((["sdpa"], "list"), (3, "int"), (object(), "object")):
        with pytest.raises(ConfigError) as info:
            resolve_attention({"window": value}, kinds, cpu, torch.float32, 16)
        msg = str(info.value)
        assert "'window' layers" in msg and f"not {type_name}" in msg and " at 0x" not in msg
    with pytest.raises(ConfigError, match=r"layer kinds \['windows', int\]; this model has") as info:
        resolve_attention({1: "sdpa", "windows": "sdpa"}, kinds, cpu, torch.float32, 16)
    with pytest.raises(ConfigError, match=r"layer kinds \[object\]") as info:
        resolve_attention({object(): "sdpa"}, kinds, cpu, torch.float32, 16)
    assert " at 0x" not in str(info.value)


@pytest.mark.parametrize(
    ("capability", "candidates", "hint"),
    [
        ((9, 0), ("triton", "torch_varlen", "sdpa"), "fa4 would be faster here: pip install -e '.[gpu]'"),
        ((10, 0), ("torch_varlen", "sdpa"), "fa4 would be faster here"),
        ((8, 0), ("triton", "torch_varlen", "sdpa"), None),  # an A100: FA4 would not run
        ((9, 0), ("fa4", "triton", "sdpa"), None),  # installed
        ((9, 0), ("fa3", "torch_varlen", "sdpa"), None),  # FA3 ranks beside it: nothing to say
    ],
)
def test_the_start_up_hint_names_a_faster_backend_that_would_run_here(monkeypatch, capability, candidates, hint):
    from encoder.attention import missing_faster_backend

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    backends = {"full": AutoAttention("full", {n: Recording(n) for n in candidates})}
    got = missing_faster_backend(backends, torch.device("cuda", 0))
    assert got == hint if hint is None else got.startswith(hint)
    # a forced backend, or the CPU: no hint
    assert missing_faster_backend({"full": Recording("torch_varlen")}, torch.device("cuda", 0)) is None
    assert missing_faster_backend(backends, torch.device("cpu")) is None
