"""`VisionEncoder` (preprocess -> packed forward -> per-image outputs) and `load()`."""

from __future__ import annotations

from pathlib import Path

import torch

from .attention import default_backend_name, get_backend
from .checkpoint import load_config, load_weights, read_json
from .config import VisionConfig, preset
from .errors import ConfigError, InvalidArgumentError
from .geometry import compute_meta, count_windows, frames_of
from .patch_batch import PatchBatch
from .preprocess import PreprocessConfig, preprocess
from .qwen import QwenVisionTower

POOLINGS = ("none", "mean")


def init_random_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Deterministic random weights (same seed -> same model in every process and replica)."""
    gen = torch.Generator().manual_seed(seed)
    depth = len(getattr(model, "blocks", [])) or 1
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                std = p.shape[-1] ** -0.5
                if name.endswith(("attn.proj.weight", "mlp.down_proj.weight", "mlp.fc2.weight")):
                    # residual-branch outputs scaled by 1/sqrt(2 * depth) (GPT-2 style), so a random
                    # tower keeps its branches small against the stream as trained towers do;
                    # with unit-scale branches bf16 rounding compounds over 32 blocks
                    std /= (2 * depth) ** 0.5
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
            else:  # norm scales: near one, not exactly, so a swapped norm would show
                p.copy_(1.0 + torch.randn(p.shape, generator=gen) * 0.05)


def pool_outputs(tokens: torch.Tensor, counts: list[int], pooling: str) -> list[torch.Tensor]:
    """Split packed output tokens per image; mean in float32 for `"mean"`."""
    parts = list(torch.split(tokens, counts))
    if pooling == "mean":
        return [p.float().mean(0) for p in parts]
    return [p.float() for p in parts]


def check_pooling(pooling: str) -> None:
    if pooling not in POOLINGS:
        raise InvalidArgumentError(f"unknown pooling {pooling!r}; expected one of {', '.join(POOLINGS)}")


class VisionEncoder:
    """A vision tower with its preprocessing; `encode` runs the packed eager path."""

    def __init__(
        self,
        config: VisionConfig,
        model: QwenVisionTower,
        preprocess_config: PreprocessConfig,
        name: str = "custom",
    ):
        self.config = config
        self.model = model
        self.preprocess_config = preprocess_config
        self.name = name

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def out_dim(self) -> int:
        return self.config.out_dim

    def preprocess(self, images) -> PatchBatch:
        return preprocess(images, self.preprocess_config)

    def output_counts(self, grid_thw: torch.Tensor) -> list[int]:
        """Output tokens per image: t*h*w / merge_unit."""
        return [int(t * h * w) // self.config.merge_unit for t, h, w in grid_thw.tolist()]

    def check_batch(self, batch: PatchBatch) -> None:
        m = self.config.spatial_merge_size
        if batch.pixel_values.shape[1] != self.config.patch_dim:
            raise InvalidArgumentError(
                f"pixel_values have {batch.pixel_values.shape[1]} values per patch, the model expects "
                f"{self.config.patch_dim}"
            )
        grid = batch.grid_thw.tolist()
        if any(t < 1 or h < m or w < m or h % m or w % m for t, h, w in grid):
            raise InvalidArgumentError(f"grid_thw rows must be positive with h, w multiples of {m}: {grid}")
        if sum(t * h * w for t, h, w in grid) != batch.pixel_values.shape[0]:
            raise InvalidArgumentError("grid_thw does not match the number of patches in pixel_values")

    @torch.inference_mode()
    def forward_packed(self, batch: PatchBatch) -> torch.Tensor:
        """Eager forward of a whole batch: [sum tokens, out_dim] in the model dtype, on device."""
        self.check_batch(batch)
        dev = self.device
        grid = batch.grid_thw.tolist()
        frames = frames_of(batch.grid_thw).to(dev)
        meta = compute_meta(
            frames,
            total=batch.pixel_values.shape[0],
            cfg=self.config,
            max_seqlen=max(h * w for _, h, w in grid),
            window_slots=count_windows(grid, self.config),
        )
        return self.model(batch.pixel_values.to(dev, non_blocking=True), meta)

    def encode(self, images, pooling: str = "none") -> list[torch.Tensor]:
        """Per image: merger tokens [tokens, out_dim] ("none") or their mean [out_dim] ("mean").

        Returns float32 CPU tensors. `images` is a list of inputs `preprocess` accepts, or a
        `PatchBatch`.
        """
        check_pooling(pooling)
        batch = images if isinstance(images, PatchBatch) else self.preprocess(images)
        if batch.num_images == 0:
            return []
        tokens = self.forward_packed(batch)
        return pool_outputs(tokens.cpu(), self.output_counts(batch.grid_thw), pooling)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}  # fmt: skip
    if dtype not in names:
        raise ConfigError(f"unknown dtype {dtype!r}; expected one of {', '.join(names)}")
    return names[dtype]


def load(
    model: str = "tiny",
    *,
    device=None,
    dtype=None,
    attention: str | None = None,
    seed: int = 0,
) -> VisionEncoder:
    """A `VisionEncoder` from a preset name (random weights) or a local checkpoint directory."""
    device = torch.device(device) if device is not None else default_device()
    dtype = _resolve_dtype(dtype, device)
    path = Path(model)
    is_dir = path.is_dir()
    config = load_config(path) if is_dir else preset(model)
    backend = get_backend(attention or default_backend_name(device.type))
    why = backend.supports(device, dtype, config.head_dim)
    if why:
        raise ConfigError(f"attention backend {backend.name!r} cannot run this model: {why}")
    # built on the meta device: PyTorch's default init of ~680M parameters would cost seconds
    # only to be overwritten by the checkpoint or our seeded init
    with torch.device("meta"):
        tower = QwenVisionTower(config, backend)
    tower = tower.to_empty(device="cpu")
    pp = PreprocessConfig(patch_size=config.patch_size, temporal_patch_size=config.temporal_patch_size,
                          merge_size=config.spatial_merge_size)  # fmt: skip
    if is_dir:
        load_weights(tower, path)
        if (path / "preprocessor_config.json").exists():
            pp = PreprocessConfig.from_hf_dict(read_json(path / "preprocessor_config.json"))
    else:
        init_random_weights(tower, seed)
    tower = tower.to(device=device, dtype=dtype).eval()
    return VisionEncoder(config, tower, pp, name=str(path) if is_dir else model)
