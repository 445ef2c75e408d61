"""Text tower benchmark (issue 46's line: "text tower <= 1.5 ms for one text and >= 1.5x HF eager at 256 texts"):
our graph replay vs our eager tower vs HF transformers' `CLIPTextModelWithProjection` holding the same weights.

Default: CLIP ViT-L/14's text tower (`clip-vit-l-14`'s published text config, random weights: no checkpoint and
no network needed) in bf16, 1 and 256 texts. Inputs are token ids already made, as the tokenizer writes them
(77 columns: BOS, words, EOS, then pads equal to the EOS as in OpenAI's vocabulary), for texts of `--lengths`
real tokens (10: a short prompt such as "a photo of a cat"; 77: every column a token); no tokenizer time for
anyone. HF runs on the full 77 columns (SDPA attention), as its processor's `padding="max_length"` gives them;
our graphs run the columns that matter (`workspace.text_buckets`). Float32 matmuls stay full precision (TF32
off). Prints a markdown table; `--json` writes the rows. `--device cpu` is a smoke run (tiny preset, no graphs:
the same bucket path eagerly, timed with the host clock) that checks the script before a GPU session.

    python -m benchmarks.text [--preset clip-vit-l-14] [--texts 1,256] [--lengths 10,77] [--no-hf]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from benchmarks.common import require_cuda, timed, wall_timed, write_results
from encoder.api import init_random_weights
from encoder.loading.presets import TEXT_PRESETS
from encoder.models.text import build_text_tower
from workspace.text_buckets import text_table
from workspace.text_runner import TextGraphRunner


def hf_text_model(tower, cfg, device, dtype: torch.dtype):
    """HF's CLIPTextModelWithProjection with our tower's weights, SDPA attention."""
    import transformers as tf

    fields = cfg.model_dump(exclude={"family"})
    # BOS and pad ids as `token_batch` writes them (HF checks them against the vocabulary; only the EOS rule is used)
    hf_cfg = tf.CLIPTextConfig(**fields, bos_token_id=cfg.vocab_size - 2, pad_token_id=cfg.vocab_size - 1)
    hf_cfg._attn_implementation = "sdpa"
    with torch.device(device):
        model = tf.CLIPTextModelWithProjection(hf_cfg).to(dtype).eval()
    state = {k if k.startswith("text_projection") else f"text_model.{k}": v for k, v in tower.state_dict().items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("position_ids" in k for k in missing), (missing, unexpected)
    return model


def token_batch(n: int, length: int, cfg, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, seq_len] int64 ids and mask of `n` texts of `length` real tokens (BOS, words, EOS), EOS-padded."""
    s, vocab = cfg.seq_len, cfg.vocab_size
    length = max(2, min(length, s))
    # OpenAI's vocabulary ends with BOS, EOS: the EOS is the highest id (the legacy pooling rule finds it)
    bos, eos = vocab - 2, vocab - 1
    ids = torch.full((n, s), eos, dtype=torch.int64)
    ids[:, 0] = bos
    ids[:, 1 : length - 1] = torch.randint(0, vocab - 2, (n, length - 2), generator=gen)
    mask = (torch.arange(s) < length).long().expand(n, s).contiguous()
    return ids, mask


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default=None, help="a CLIP text preset (default: clip-vit-l-14; cpu: tiny-clip)")
    parser.add_argument("--texts", default="1,256", help="comma list of batch sizes (texts per call)")
    parser.add_argument("--lengths", default="10,77", help="comma list of real tokens per text (BOS and EOS included)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not require_cuda("benchmarks.text"):
        return 2
    preset = args.preset or ("clip-vit-l-14" if cuda else "tiny-clip")
    cfg = TEXT_PRESETS.get(preset)
    if cfg is None or cfg.family != "clip":
        names = ", ".join(k for k, v in TEXT_PRESETS.items() if v.family == "clip")
        print(f"--preset must be a CLIP text preset ({names}), got {preset!r}", file=sys.stderr)
        return 2
    device, dtype = torch.device(args.device), torch.bfloat16 if cuda else torch.float32
    with torch.device("meta"):
        tower = build_text_tower(cfg)
    tower = tower._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device="cpu"))
    init_random_weights(tower, seed=0)
    tower = tower.to(device=device, dtype=dtype).eval()
    sizes = [int(x) for x in args.texts.split(",")]
    lengths = [int(x) for x in args.lengths.split(",")]
    clock = (lambda fn: timed(fn, args.iters)) if cuda else (lambda fn: wall_timed(fn, args.iters))

    t0 = time.perf_counter()
    runner = TextGraphRunner(tower, text_table(tower.seq_len, tower.prefix_exact))  # graphs on CUDA only
    setup_s = time.perf_counter() - t0
    hf = None if args.no_hf else hf_text_model(tower, cfg, device, dtype)
    gen = torch.Generator().manual_seed(0)
    rows = []

    def record(impl: str, n: int, length: int, ms: float, **extra) -> None:
        rows.append(dict(impl=impl, texts=n, tokens=length, ms=ms, texts_s=n / ms * 1e3, **extra))
        print(json.dumps(rows[-1]), flush=True)

    graph_name = "ours, graph replay" if runner.use_graphs else "ours, buckets run eagerly (no CUDA)"
    with torch.inference_mode():
        for length in lengths:
            for n in sizes:
                ids, mask = token_batch(n, length, cfg, gen)
                on_dev = ids.to(device), mask.to(device)
                ours = runner.run(ids, mask).float()  # from host ids, as GraphEncoder.encode_text_ids gets them
                record(graph_name, n, length, clock(lambda i=ids, m=mask: runner.run(i, m)))
                eager = f"ours, eager tower ({cfg.seq_len} columns)"
                record(eager, n, length, clock(lambda d=on_dev: tower(*d)))
                if hf is not None:
                    hf_out = hf(input_ids=on_dev[0]).text_embeds.float()
                    err = ((ours.double() - hf_out.double()).norm() / hf_out.double().norm()).item()
                    record("HF transformers eager (sdpa)", n, length,
                           clock(lambda d=on_dev: hf(input_ids=d[0]).text_embeds), rel_err_vs_ours=err)  # fmt: skip
    stats = runner.stats.as_dict()
    name = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"\n{preset} text tower, {str(dtype).removeprefix('torch.')}, {name}; {stats['captures']} graphs captured "
          f"in {stats['capture_seconds']:.2f} s ({stats['capture_bytes'] / 2**20:.0f} MiB of pool), runner set up "
          f"in {setup_s:.2f} s\n")  # fmt: skip
    print("| implementation | texts | real tokens per text | ms | texts/s | vs HF |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    hf_ms = {(r["texts"], r["tokens"]): r["ms"] for r in rows if r["impl"].startswith("HF")}
    for r in rows:
        ref = hf_ms.get((r["texts"], r["tokens"]))
        speedup = f"{ref / r['ms']:.2f}x" if ref else "-"
        print(f"| {r['impl']} | {r['texts']} | {r['tokens']} | {r['ms']:.3f} | {r['texts_s']:.0f} | {speedup} |")
    errs = [r["rel_err_vs_ours"] for r in rows if "rel_err_vs_ours" in r]
    if errs:
        print(f"\ntext embeddings, ours (graph) vs HF, same weights and dtype: relative error up to {max(errs):.2e}")
    write_results(args.json, {"preset": preset, "dtype": str(dtype), "stats": stats, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
