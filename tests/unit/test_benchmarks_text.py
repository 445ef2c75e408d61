"""`benchmarks/text.py`'s CPU smoke run (tiny CLIP text preset, no graphs): it runs end to end, prints its table,
and our outputs equal HF's `CLIPTextModelWithProjection` holding the same weights, so a GPU session's run of it
measures the right thing."""

from __future__ import annotations

import json
import re

from benchmarks import text


def test_text_benchmark_cpu_smoke(capsys, tmp_path):
    out = tmp_path / "text.json"
    assert (
        text.main(["--device", "cpu", "--texts", "1,3", "--lengths", "4,16", "--iters", "1", "--json", str(out)]) == 0
    )
    printed = capsys.readouterr().out
    table = [line for line in printed.splitlines() if line.startswith("| ") and not line.startswith("| ---")]
    assert len(table) == 1 + 2 * 2 * 3  # header; 2 lengths x 2 sizes x (graph path, eager, HF)
    rows = json.loads(out.read_text())["rows"]
    assert {r["impl"] for r in rows} == {
        "ours, buckets run eagerly (no CUDA)", "ours, eager tower (77 columns)", "HF transformers eager (sdpa)"
    }  # fmt: skip
    errs = [r["rel_err_vs_ours"] for r in rows if "rel_err_vs_ours" in r]
    assert len(errs) == 4 and max(errs) <= 1e-5, errs
    assert re.search(r"relative error up to \d", printed)
