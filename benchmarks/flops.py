"""Matmul FLOPs of a whole vision-tower forward, counted from its config and the images' grids (no torch, no GPU).

Linear layers: 2 · rows · in · out each (bias and activations not counted): the patch embedding, every block's qkv,
proj and MLP, the merger and Qwen3-VL's DeepStack mergers (on rows / merge_unit merged rows). Attention: per layer
and per segment of S tokens, 4 · S² · width (QKᵀ and PV, 2 · S² · head_dim each, over all heads), over the
segments the tower attends in: every frame whole in full layers; in Qwen2.5-VL's window layers, each frame's
windows of window_units² merge units (smaller at the right and bottom edges), as `encoder.models.geometry` cuts them.
Useful work only: the graphs' MLP padding and bucket padding rows are not credited.
"""

from __future__ import annotations


def _frames(grid_thw) -> list[tuple[int, int]]:
    """(h, w) in patches of every frame: an image of t frames is t frames of one grid."""
    return [(int(h), int(w)) for t, h, w in grid_thw for _ in range(int(t))]


def window_segments(cfg, grid_thw) -> list[int]:
    """Token counts of the window segments of a Qwen2.5-VL batch (empty for towers without window layers)."""
    n = getattr(cfg, "window_units", 0) if cfg.family == "qwen2_5_vl" else 0
    if not n:
        return []
    m, mu, out = cfg.spatial_merge_size, cfg.merge_unit, []
    for h, w in _frames(grid_thw):
        gh, gw = h // m, w // m
        for wh in range(0, gh, n):
            for wi in range(0, gw, n):
                out.append(min(n, gh - wh) * min(n, gw - wi) * mu)
    return out


def full_segments(grid_thw) -> list[int]:
    """Token counts of the full-attention segments: one per frame."""
    return [h * w for h, w in _frames(grid_thw)]


def window_layers(cfg) -> int:
    """How many blocks attend in windows (Qwen2.5-VL: those not in `fullatt_block_indexes`)."""
    return cfg.depth - len(set(cfg.fullatt_block_indexes)) if cfg.family == "qwen2_5_vl" else 0


def mlp_matrices(cfg) -> int:
    """Weight matrices of a block's MLP: 3 for SwiGLU (gate, up, down), else 2 (fc1, fc2)."""
    return 3 if cfg.family == "qwen2_5_vl" else 2


def linear_layers(cfg, rows: int) -> list[tuple[str, int, int, int]]:
    """(name, rows, in, out) of every linear layer a Qwen tower's forward over `rows` patches runs, in order."""
    d, f, mu = cfg.width, cfg.mlp_dim, cfg.merge_unit
    merged = rows // mu
    mergers = 1 + len(getattr(cfg, "deepstack_visual_indexes", ()))
    layers = [("patch_embed", rows, cfg.patch_dim, d)]
    for _ in range(cfg.depth):
        layers += [("qkv", rows, d, 3 * d), ("proj", rows, d, d)]
        if mlp_matrices(cfg) == 3:
            layers += [("gate", rows, d, f), ("up", rows, d, f), ("down", rows, f, d)]
        else:
            layers += [("fc1", rows, d, f), ("fc2", rows, f, d)]
    for _ in range(mergers):
        layers += [("merger_fc1", merged, d * mu, d * mu), ("merger_fc2", merged, d * mu, cfg.out_dim)]
    return layers


def linear_flops(cfg, rows: int) -> float:
    return float(sum(2 * r * i * o for _, r, i, o in linear_layers(cfg, rows)))


def attention_flops(cfg, grid_thw) -> float:
    """4 · S² · width per segment per layer, full and window layers as the tower runs them."""
    full = sum(4 * s * s * cfg.width for s in full_segments(grid_thw))
    windowed = window_layers(cfg)
    window = sum(4 * s * s * cfg.width for s in window_segments(cfg, grid_thw)) if windowed else 0
    return float((cfg.depth - windowed) * full + windowed * window)


def forward_flops(cfg, grid_thw) -> dict:
    """Matmul FLOPs of one Qwen tower forward over the images `grid_thw` ([[t, h, w], ...] in patches):
    {"linear", "attention", "total", "patches"}."""
    rows = sum(int(t) * int(h) * int(w) for t, h, w in grid_thw)
    lin, att = linear_flops(cfg, rows), attention_flops(cfg, grid_thw)
    return {"linear": lin, "attention": att, "total": lin + att, "patches": rows}


def largest_gemm(cfg, rows: int, pad_mlp: int = 128) -> tuple[int, int, int]:
    """(rows, in, out) of the tower's largest GEMM over `rows` patches as its CUDA graphs run it: the MLP width
    padded to a multiple of `pad_mlp` and SwiGLU's gate and up as one GEMM (`tower.fuse`), or the merger's first
    layer, whichever does more work."""
    d, mu = cfg.width, cfg.merge_unit
    f = -(-cfg.mlp_dim // pad_mlp) * pad_mlp if pad_mlp else cfg.mlp_dim
    candidates = [(rows, d, 3 * d), (rows, d, 2 * f if mlp_matrices(cfg) == 3 else f), (rows, f, d),
                  (rows // mu, d * mu, d * mu), (rows // mu, d * mu, cfg.out_dim)]  # fmt: skip
    return max(candidates, key=lambda s: s[0] * s[1] * s[2])


def vit_flops_per_image(cfg) -> float:
    """Matmul work of one CLIP / SigLIP image: the blocks' GEMMs and attention, the patch embedding, the pooling
    (CLIP: the projection of the class token; SigLIP: the attention-pooling head)."""
    d, f, t = cfg.width, cfg.mlp_dim, cfg.seq_len
    blocks = cfg.depth * (2 * t * (4 * d * d + 2 * d * f) + 4 * t * t * d)
    embed = 2 * cfg.num_patches * cfg.patch_dim * d
    pool = 2 * d * cfg.out_dim if cfg.family == "clip" else 2 * t * 2 * d * d + 2 * (2 * d * d + 2 * d * f)
    return blocks + embed + pool
