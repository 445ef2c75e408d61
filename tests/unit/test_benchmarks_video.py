"""`benchmarks/video.py`'s CPU smoke run (tiny Qwen3-VL and Qwen2.5-VL presets, float32, buckets run eagerly): it
runs end to end, and every row's tokens equal those of HF's vision tower holding the same weights, called as
`get_video_features` calls it — so a GPU session's run measures the right thing."""

from __future__ import annotations

import json

from benchmarks import video


def test_video_benchmark_cpu_smoke(capsys, tmp_path):
    out = tmp_path / "video.json"
    assert video.main(["--device", "cpu", "--frames", "8", "--side", "112", "--iters", "1", "--json", str(out)]) == 0
    assert "| model | implementation | grid (t×h×w) |" in capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert {r["model"] for r in rows} == {"tiny-qwen3-vl", "tiny"}
    assert len(rows) == 2 * 4
    for r in rows:
        assert r["grid"][0] == 4 and r["patches"] == r["grid"][0] * r["grid"][1] * r["grid"][2]  # 8 frames: t = 4
        assert r["rel_to_hf"] is not None and r["rel_to_hf"] <= 1e-5, r
