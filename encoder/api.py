"""`VisionEncoder` (preprocess -> packed forward -> per-image outputs) and `load()`.

Poolings (`encode(images, pooling=...)`; the same names in `workspace.GraphEncoder` and the service):
  * "none": every output token, [tokens, dim] per image. Qwen: the merger's tokens; CLIP / SigLIP:
    the patch tokens of HF's `last_hidden_state` (CLIP without its class token).
  * "mean": the mean of those tokens, [dim].
  * "model": the model's own image embedding, [out_dim]: CLIP `image_embeds` (projected class
    token), SigLIP `pooler_output` (attention-pooling head), DINOv2 / DINOv3 `pooler_output` (the normed class
    token; "none" / "mean" are its patch tokens, class and register tokens excluded). Fixed-resolution
    towers only.
  * "mean-l2", "model-l2": the same vector divided by its L2 norm (cosine-ready).
The default (`pooling=None`) is `VisionEncoder.default_pooling`: "model" for CLIP / SigLIP, "none"
for the Qwen towers (unchanged). `vector_pooling(config)` is the default one-vector-per-image
pooling ("model", or "mean" for Qwen), which the batch jobs use.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from encoder.attention import resolve_attention
from encoder.config import (
    DTYPE_NAMES,
    ClipVisionConfig,
    Dinov2VisionConfig,
    Dinov3VisionConfig,
    Qwen3VLVisionConfig,
    Siglip2VisionConfig,
    SiglipVisionConfig,
    VisionConfig,
)
from encoder.errors import ConfigError, InvalidArgumentError, RandomWeightsWarning, named
from encoder.image_paths import preprocess_paths
from encoder.loading.checkpoint import load_weights, read_image_processor, read_video_processor
from encoder.loading.hub import ResolvedModel, resolve_model
from encoder.models.dinov2 import Dinov2VisionTower
from encoder.models.dinov3 import Dinov3VisionTower
from encoder.models.fp8 import quantize_blocks
from encoder.models.geometry import frames_of
from encoder.models.qwen2 import QwenVisionTower
from encoder.models.qwen3 import Qwen3VisionTower
from encoder.models.tower import TowerOutput
from encoder.models.vit import VitTower, build_vit_tower
from encoder.outputs import LLMOutput
from encoder.patch_batch import PatchBatch
from encoder.patchify import preprocess, preprocess_videos
from encoder.poolings import check_pooling
from encoder.preprocessing.naflex import NaflexPreprocessConfig
from encoder.preprocessing.qwen import PreprocessConfig
from encoder.preprocessing.video import VideoPreprocessConfig
from encoder.preprocessing.vit import VitPreprocessConfig, check_matches_model
from encoder.text_encoder import TextEncoder, load_text_side


def is_fixed_resolution(config: VisionConfig) -> bool:
    """CLIP / SigLIP / DINOv2 / DINOv3: one image size, a fixed number of patches per image."""
    return isinstance(config, ClipVisionConfig | SiglipVisionConfig | Dinov2VisionConfig | Dinov3VisionConfig)


def has_model_embedding(config: VisionConfig) -> bool:
    """CLIP / SigLIP / SigLIP2: the model has its own image embedding (pooling "model")."""
    return is_fixed_resolution(config) or isinstance(config, Siglip2VisionConfig)


def vector_pooling(config: VisionConfig) -> str:
    """The default one-vector-per-image pooling: the model's own embedding where it has one, else the mean."""
    return "model" if has_model_embedding(config) else "mean"


def split_pooling(pooling: str) -> tuple[str, bool]:
    """("mean" | "model" | "none", L2-normalise?) of a checked pooling name."""
    base, _, suffix = pooling.partition("-")
    return base, suffix == "l2"


def init_random_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Deterministic random weights (same seed -> same model in every process and replica)."""
    gen = torch.Generator().manual_seed(seed)
    depth = len(getattr(model, "blocks", [])) or 1
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                std = p.shape[-1] ** -0.5
                residual_out = ("attn.proj.weight", "mlp.down_proj.weight", "mlp.fc2.weight", "attn.out_proj.weight",
                                "mlp.linear_fc2.weight", "attention.output.dense.weight",
                                "mlp.weights_out.weight")  # fmt: skip
                if name.endswith(residual_out):
                    # residual-branch outputs scaled by 1/sqrt(2 * depth) (GPT-2 style), so a random
                    # tower keeps its branches small against the stream as trained towers do;
                    # with unit-scale branches bf16 rounding compounds over 32 blocks
                    std /= (2 * depth) ** 0.5
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
            elif name.endswith("class_embedding"):  # CLIP's class token: an embedding, not a norm scale
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
            else:  # norm scales: near one, not exactly, so a swapped norm would show
                p.copy_(1.0 + torch.randn(p.shape, generator=gen) * 0.05)


def pool_outputs(tokens: torch.Tensor, counts: list[int], pooling: str) -> list[torch.Tensor]:
    """Split packed output tokens per image; mean in float32 for `"mean"`."""
    parts = list(torch.split(tokens, counts))
    if pooling == "mean":
        return [p.float().mean(0) for p in parts]
    return [p.float() for p in parts]


def l2_normalize(vectors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.nn.functional.normalize(v, dim=-1) for v in vectors]


def resolve_pooling(pooling: str | None, config: VisionConfig) -> str:
    """`pooling`, or the model's default when None; raises InvalidArgumentError if the model lacks it."""
    if pooling is None:
        return "model" if has_model_embedding(config) else "none"
    check_pooling(pooling)
    if split_pooling(pooling)[0] == "model" and not has_model_embedding(config):
        raise InvalidArgumentError(
            f"pooling {pooling!r} needs a model with its own image embedding (CLIP, SigLIP, SigLIP2); "
            f"{config.family} towers support none, mean, mean-l2"
        )
    return pooling


class VisionEncoder:
    """A vision tower with its preprocessing; `encode` runs the packed eager path."""

    def __init__(
        self,
        config: VisionConfig,
        model: QwenVisionTower | VitTower,
        preprocess_config: PreprocessConfig | VitPreprocessConfig,
        name: str = "custom",
        source: ResolvedModel | None = None,
        quantization: str | None = None,
        text: TextEncoder | None = None,
        video_config: VideoPreprocessConfig | None = None,
    ):
        self.config = config
        self.model = model
        self.preprocess_config = preprocess_config
        self.name = name
        self.source = source  # where config and weights came from (None: built by hand)
        # None (every GEMM in the model dtype) or "fp8": the blocks' linear layers in float8 (`load`)
        self.quantization = quantization
        # the text tower and tokenizer (CLIP / SigLIP checkpoints with tokenizer files), else None
        self.text = text
        # the video processor's settings (Qwen towers: the checkpoint's, else transformers' defaults), else None
        self.video_config = video_config if video_config is not None else default_video_config(config)

    @property
    def supports_text(self) -> bool:
        """True when `encode_text` works: an image-text checkpoint with its tokenizer (`tokenizer.json`)."""
        return self.text is not None

    def encode_text(self, texts: list[str], pooling: str | None = None) -> list[torch.Tensor]:
        """Per text, one float32 CPU vector [out_dim]: pooling "model" (the default: CLIP `text_embeds`, SigLIP
        `pooler_output`) or "model-l2" (L2-normalised). InvalidArgumentError for a model without text, an empty
        string or a non-string (naming its index), an unknown pooling."""
        return self.text_side().encode(texts, pooling)

    def encode_text_ids(self, ids: torch.Tensor, mask: torch.Tensor, pooling: str | None = None) -> list[torch.Tensor]:
        """`encode_text` of pre-tokenized texts: `ids` and `mask` [B, seq_len] int64 (the tokenizer's, e.g.
        `text.tokenize`); InvalidArgumentError naming `ids` or `mask` (and the row) for a bad input."""
        return self.text_side().encode_ids(ids, mask, pooling)

    def text_tokens(self, texts: list[str]) -> list[int]:
        """Per text, its real (non-pad) tokens after truncation, special tokens included (`usage.prompt_tokens`)."""
        return self.text_side().token_counts(texts)

    def text_side(self) -> TextEncoder:
        """The text encoder; InvalidArgumentError for a model without one (images only)."""
        if self.text is None:
            raise InvalidArgumentError(
                f"model {self.name!r} takes no text: text needs a CLIP / SigLIP checkpoint with its tokenizer "
                "files (tokenizer.json)"
            )
        return self.text

    @property
    def random_weights(self) -> bool:
        """True for presets: seeded random weights, not a trained model's."""
        return self.source is not None and self.source.random_weights

    def model_info(self) -> dict:
        """JSON-ready: name, kind (preset | dir | hub | custom), random_weights, path, revision, commit."""
        if self.source is None:
            return {"name": self.name, "kind": "custom", "random_weights": False}
        return self.source.info()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def out_dim(self) -> int:
        """Width of the default embedding: the merger's tokens (Qwen), the model embedding (CLIP / SigLIP)."""
        return self.config.out_dim

    @property
    def fixed_resolution(self) -> bool:
        return is_fixed_resolution(self.config)

    @property
    def default_pooling(self) -> str:
        return resolve_pooling(None, self.config)

    def resolve_pooling(self, pooling: str | None) -> str:
        return resolve_pooling(pooling, self.config)

    def output_dim(self, pooling: str | None = None) -> int:
        """Width of the vectors `encode` returns for this pooling (CLIP's tokens and its embedding differ)."""
        pooling = self.resolve_pooling(pooling)
        if split_pooling(pooling)[0] == "model" or not self.fixed_resolution:
            return self.config.out_dim
        return self.config.token_dim

    def preprocess(self, images) -> PatchBatch:
        """One input or a list: encoded bytes, PIL images, uint8 arrays, or paths to image files (str or
        os.PathLike, read by `encoder.image_paths.preprocess_paths`)."""
        return preprocess_paths(images, self._preprocess)

    def _preprocess(self, images) -> PatchBatch:
        return preprocess(images, self.preprocess_config)

    @property
    def supports_video(self) -> bool:
        """True for the Qwen towers (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5): `preprocess_video` works."""
        return self.video_config is not None

    def preprocess_video(self, videos, fps: float | None = None) -> PatchBatch:
        """One video or a list: encoded bytes (MP4 / MOV, WebM / Matroska, AVI), paths to video files, or uint8
        arrays [frames, H, W, 3] holding every frame (`fps`: their frame rate, for sampling and timestamps; None:
        unknown, taken as 24 by Qwen3-VL as transformers does). Sampled and resized as the checkpoint's
        transformers video processor (`encoder.preprocessing.video`); a `PatchBatch` whose grid_thw rows have t
        = temporal patches and, for Qwen3-VL, the timestamps. `encode` / `encode_llm` take it as they take
        images; an image batch and a video batch combine with `PatchBatch.concat`."""
        if self.video_config is None:
            raise InvalidArgumentError(
                f"model {self.name!r} takes no video: video needs a Qwen2-VL, Qwen2.5-VL, Qwen3-VL or Qwen3.5 tower"
            )
        return preprocess_paths(videos, lambda v: preprocess_videos(v, self.video_config, fps), kind="video")

    def num_patches(self, height: int, width: int) -> int:
        """Patches of an image of `height` x `width` pixels once preprocessed (resized, cropped) for this model."""
        return self.preprocess_config.num_patches(height, width)

    def output_counts(self, grid_thw: torch.Tensor) -> list[int]:
        """Output tokens per image: t*h*w / merge_unit."""
        return [int(t * h * w) // self.config.merge_unit for t, h, w in grid_thw.tolist()]

    def check_batch(self, batch: PatchBatch) -> None:
        if self.fixed_resolution:
            return self._check_fixed_batch(batch)
        m = self.config.spatial_merge_size
        if batch.pixel_values.shape[1] != self.config.patch_dim:
            raise InvalidArgumentError(
                f"pixel_values have {batch.pixel_values.shape[1]} values per patch, the model expects "
                f"{self.config.patch_dim}"
            )
        grid = batch.grid_thw.tolist()
        if isinstance(self.config, Siglip2VisionConfig) and any(t != 1 for t, _, _ in grid):
            raise InvalidArgumentError(
                f"this model takes still images only: every grid_thw row must be [1, h, w], got {grid}"
            )
        if any(t < 1 or h < m or w < m or h % m or w % m for t, h, w in grid):
            raise InvalidArgumentError(f"grid_thw rows must be positive with h, w multiples of {m}: {grid}")
        if sum(t * h * w for t, h, w in grid) != batch.pixel_values.shape[0]:
            raise InvalidArgumentError("grid_thw does not match the number of patches in pixel_values")

    def _check_fixed_batch(self, batch: PatchBatch) -> None:
        cfg = self.config
        if batch.pixel_values.shape[1] != cfg.patch_dim:
            raise InvalidArgumentError(
                f"pixel_values have {batch.pixel_values.shape[1]} values per patch, the model expects {cfg.patch_dim}"
            )
        grid = batch.grid_thw.tolist()
        if any(row != [1, cfg.grid, cfg.grid] for row in grid):
            raise InvalidArgumentError(
                f"this model takes {cfg.image_size}x{cfg.image_size}-pixel images only: every grid_thw row must be "
                f"[1, {cfg.grid}, {cfg.grid}], got {grid}"
            )
        if len(grid) * cfg.num_patches != batch.pixel_values.shape[0]:
            raise InvalidArgumentError("grid_thw does not match the number of patches in pixel_values")

    @torch.inference_mode()
    def run_packed(self, batch: PatchBatch) -> TowerOutput:
        """Eager forward of a whole batch through the tower's body (`encoder.models.tower`), on device:
        tokens [sum tokens, token_dim] in the model dtype, per-frame means, the model's pooled
        embedding (CLIP / SigLIP), DeepStack features (Qwen3-VL)."""
        self.check_batch(batch)
        grid = batch.grid_thw.tolist()
        frames = frames_of(batch.grid_thw).to(self.device)
        pv = batch.pixel_values.to(self.device, non_blocking=True)
        return self.model.forward_packed(pv, frames, self.model.batch_bounds(grid))

    def forward_packed(self, batch: PatchBatch) -> torch.Tensor:
        """The output tokens of `run_packed`: [sum tokens, token_dim] in the model dtype, on device."""
        return self.run_packed(batch).tokens

    def encode(self, images, pooling: str | None = None) -> list[torch.Tensor]:
        """Per image, float32 CPU tensors: tokens [tokens, dim] ("none"), their mean [dim] ("mean"), the
        model's embedding [out_dim] ("model"), optionally L2-normalised ("-l2"); see the module docstring.

        `images` is a list of inputs `preprocess` accepts (paths to image files among them), or a `PatchBatch`.
        `pooling=None` is the model's default (`default_pooling`).
        """
        pooling = self.resolve_pooling(pooling)
        base, l2 = split_pooling(pooling)
        batch = images if isinstance(images, PatchBatch) else self.preprocess(images)
        if batch.num_images == 0:
            return []
        out = self.run_packed(batch)
        if base == "model":  # towers with their own embedding: one frame per image
            outs = list(out.pooled.cpu().unbind(0))
        else:
            outs = pool_outputs(out.tokens.cpu(), self.output_counts(batch.grid_thw), base)
        return l2_normalize(outs) if l2 else outs

    def encode_llm(self, images) -> list[LLMOutput]:
        """Per image, what an LLM server needs in place of its vision tower (`encoder.outputs.LLMOutput`):
        the merger tokens, the DeepStack features (model order; [] for towers without) and the patch grid."""
        batch = images if isinstance(images, PatchBatch) else self.preprocess(images)
        if batch.num_images == 0:
            return []
        out = self.run_packed(batch)
        counts = self.output_counts(batch.grid_thw)
        tokens = pool_outputs(out.tokens.cpu(), counts, "none")
        deep = [pool_outputs(d.cpu(), counts, "none") for d in out.deepstack]
        return [
            LLMOutput(
                tokens[i],
                tuple(batch.grid_thw[i].tolist()),
                [d[i] for d in deep],
                batch.timestamps_of(i),
                batch.second_per_grid_ts_of(i),
            )
            for i in range(batch.num_images)
        ]


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _resolve_device(device) -> torch.device:
    if device is None:
        return default_device()
    shown = named(device)
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"unknown device {shown}; expected cpu, cuda or cuda:N") from None
    if resolved.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {shown} is not supported; expected cpu, cuda or cuda:N")
    if resolved.type == "cuda":  # here, not at the first tensor moved there (torch's AssertionError)
        if not torch.cuda.is_available():
            why = "this torch is a CPU build" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise ConfigError(f"device {shown} asked for, but {why}; use device='cpu'")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ConfigError(f"device {shown}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    return resolved


DTYPES = dict(zip(DTYPE_NAMES, (torch.float32, torch.float32, torch.bfloat16, torch.bfloat16, torch.float16,
                                torch.float16), strict=True))  # fmt: skip


def _resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):  # the towers run in these three only (an int or float8 one failed in torch)
        if dtype not in DTYPES.values():
            raise ConfigError(f"dtype {dtype} is not supported; expected one of {', '.join(DTYPES)}")
        return dtype
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {named(dtype)}; expected one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


QUANTIZATIONS = ("fp8",)
# float8 tensor-core GEMMs (torch._scaled_mm with row-wise scales): Ada (8.9), Hopper (9.0) and newer
FP8_MIN_CAPABILITY = (8, 9)


def check_quantization(quantization, device: torch.device, dtype: torch.dtype) -> str | None:
    """`quantization` checked against the device and dtype `load` resolved: None, or "fp8" on a CUDA GPU of
    compute capability 8.9 or newer with bfloat16 (the row-wise FP8 GEMM writes bfloat16). ConfigError else."""
    if quantization is None:
        return None
    if not isinstance(quantization, str) or quantization not in QUANTIZATIONS:
        raise ConfigError(f"unknown quantization {named(quantization)}; expected None or {', '.join(QUANTIZATIONS)}")
    if device.type != "cuda":
        raise ConfigError(
            f"quantization {quantization!r} needs a CUDA GPU of compute capability 8.9 or newer (Hopper/Ada); "
            f"this device is {device}"
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        raise ConfigError(
            f"quantization {quantization!r} needs a CUDA GPU of compute capability 8.9 or newer (Hopper/Ada); "
            f"{device} ({torch.cuda.get_device_name(device)}) is {capability[0]}.{capability[1]}"
        )
    if dtype != torch.bfloat16:
        raise ConfigError(
            f"quantization {quantization!r} runs with dtype bfloat16 only (the default on CUDA), not {dtype}"
        )
    return quantization


def quantize_tower(tower: torch.nn.Module, quantization: str | None) -> list[str]:
    """The load-time conversion: for "fp8", the exact layout changes first (`tower.fuse()`: padded widths are
    multiples of 16 as the FP8 GEMM needs, and `GraphEncoder`'s own `fuse()` then changes nothing), then every
    linear layer of the transformer blocks as an `encoder.models.fp8.Fp8Linear`. Returns the converted
    layers' names. The patch embedding, the mergers, the heads and attention itself stay in the model dtype.
    Runs on any device (the CPU tests call it); `load` checks the device first (`check_quantization`)."""
    if quantization is None:
        return []
    tower.fuse()
    return quantize_blocks(tower.transformer_blocks())


def preprocess_config_for(config: VisionConfig, directory: Path | None = None):
    """The preprocessing of a model: the image processor's settings in `directory` (found as transformers
    finds them: `checkpoint.read_image_processor`) when it has them, else the family's defaults for this
    config (no weights needed). Raises ConfigError naming the file for settings this encoder cannot honour
    or that do not fit the model."""
    found = read_image_processor(directory) if directory is not None else None
    if found is None:
        return default_preprocess_config(config)
    raw, source = found
    try:
        if isinstance(config, Siglip2VisionConfig):
            return NaflexPreprocessConfig.from_hf_dict(raw, config)
        if is_fixed_resolution(config):
            return VitPreprocessConfig.from_hf_dict(raw, config)
        pp = PreprocessConfig.from_hf_dict(raw)
        check_patches_match(pp, config)
        return pp
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def default_preprocess_config(config: VisionConfig):
    """The family's preprocessing for `config` when its checkpoint says nothing."""
    if isinstance(config, Siglip2VisionConfig):
        return NaflexPreprocessConfig.for_model(config)
    if is_fixed_resolution(config):
        pp = VitPreprocessConfig.for_model(config)
        check_matches_model(pp, config)
        return pp
    if isinstance(config, Qwen3VLVisionConfig):
        # transformers has no Qwen3-VL defaults (its Qwen2VLImageProcessor defaults are Qwen2-VL's:
        # patch 14, CLIP mean/std); these are the published Qwen3-VL / Qwen3.5 preprocessor_config.json
        return PreprocessConfig(
            min_pixels=65536, max_pixels=16777216, patch_size=config.patch_size,
            temporal_patch_size=config.temporal_patch_size, merge_size=config.spatial_merge_size,
            image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5),
        )  # fmt: skip
    return PreprocessConfig(patch_size=config.patch_size, temporal_patch_size=config.temporal_patch_size,
                            merge_size=config.spatial_merge_size)  # fmt: skip


def video_kind(config: VisionConfig) -> str | None:
    """The video processor rule set of a tower: "qwen3" (Qwen3-VL, Qwen3.5), "qwen2" (Qwen2-VL, Qwen2.5-VL) or None."""
    if isinstance(config, Qwen3VLVisionConfig):
        return "qwen3"
    if isinstance(config, Siglip2VisionConfig) or is_fixed_resolution(config):
        return None
    return "qwen2"


def default_video_config(config: VisionConfig) -> VideoPreprocessConfig | None:
    """transformers' video processor defaults for this tower, its patch sizes the model's; None: no video."""
    kind = video_kind(config)
    if kind is None:
        return None
    return VideoPreprocessConfig.defaults(
        kind, patch_size=config.patch_size, temporal_patch_size=config.temporal_patch_size,
        merge_size=config.spatial_merge_size,
    )  # fmt: skip


def video_config_for(config: VisionConfig, directory: Path | None = None) -> VideoPreprocessConfig | None:
    """The video processor's settings of a model: its checkpoint's (`checkpoint.read_video_processor`) over
    transformers' class defaults, or the defaults; None for towers without video. ConfigError naming the file
    for settings this encoder cannot honour or that do not fit the model."""
    kind = video_kind(config)
    found = read_video_processor(directory) if kind is not None and directory is not None else None
    if found is None:
        return default_video_config(config)
    raw, source = found
    try:
        vc = VideoPreprocessConfig.from_hf_dict(raw, kind)
        check_patches_match(vc, config, "video")
        return vc
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def check_patches_match(pp, config: VisionConfig, what: str = "image") -> None:
    """A Qwen image (or video: `what`) processor cuts the patches the model embeds and merges: its sizes must be
    the model's (a file that leaves one out gets transformers' Qwen2-VL default, 14, which a patch-16 model cannot
    take; transformers' own model would fail at its first image)."""
    pairs = [("patch_size", pp.patch_size, config.patch_size),
             ("temporal_patch_size", pp.temporal_patch_size, config.temporal_patch_size),
             ("merge_size", pp.merge_size, config.spatial_merge_size)]  # fmt: skip
    wrong = [f"{name} {ours} (the model's is {theirs})" for name, ours, theirs in pairs if ours != theirs]
    if wrong:
        raise ConfigError(f"the {what} processor does not fit the model: {', '.join(wrong)}")


def attention_plan(config: VisionConfig, device, dtype=None, attention=None) -> dict:
    """Layer kind -> the attention backend `load` gives this model on `device`, without weights (a
    driver sizing buckets: `encoder.attention.graph_token_cap` of it)."""
    device = torch.device(device)
    with torch.device("meta"):
        kinds = build_tower(config, None).attention_kinds
    return resolve_attention(attention, kinds, device, _resolve_dtype(dtype, device), config.head_dim)


def build_tower(config: VisionConfig, backend) -> torch.nn.Module:
    if isinstance(config, Qwen3VLVisionConfig):
        return Qwen3VisionTower(config, backend)
    if isinstance(config, Dinov2VisionConfig):
        return Dinov2VisionTower(config, backend)
    if isinstance(config, Dinov3VisionConfig):
        return Dinov3VisionTower(config, backend)
    if is_fixed_resolution(config) or isinstance(config, Siglip2VisionConfig):
        return build_vit_tower(config, backend)
    return QwenVisionTower(config, backend)


def load(
    model: str | Path | ResolvedModel = "tiny",
    *,
    device=None,
    dtype=None,
    attention: str | Mapping[str, str] | None = None,
    seed: int = 0,
    quantization: str | None = None,
    text: bool = True,
) -> VisionEncoder:
    """A `VisionEncoder` from a preset name (random weights; warns), a local checkpoint directory or a
    Hugging Face Hub id `org/name[@revision]` (`encoder.loading.hub.resolve_model`, which runs first: a bad
    model fails before anything is built). `quantization="fp8"`: the blocks' linear layers in float8 e4m3
    (`quantize_tower`; CUDA, compute capability 8.9 or newer, bfloat16). `text=False`: the text tower is not
    loaded even where the checkpoint has one (`supports_text` is then False)."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"seed must be an int, got {type(seed).__name__}")
    if quantization is not None:  # before the model is resolved: a Hub id's weights are not downloaded in vain
        resolved = _resolve_device(device)
        check_quantization(quantization, resolved, _resolve_dtype(dtype, resolved))
    source = model if isinstance(model, ResolvedModel) else resolve_model(model)
    if not source.weights_on_disk:  # checked earlier without its weights (a service's driver): fetch them now
        source = resolve_model(source.given)
    device = _resolve_device(device)
    dtype = _resolve_dtype(dtype, device)
    config, path = source.config, source.path
    pp = preprocess_config_for(config, path)  # before the weights: a bad image processor fails at once
    video = video_config_for(config, path)
    # built on the meta device: PyTorch's default init of ~680M parameters would cost seconds
    # only to be overwritten by the checkpoint or our seeded init
    with torch.device("meta"):
        tower = build_tower(config, None)
    # per layer kind; "auto" (the default) picks per kind and graph shape (`encoder.attention.auto`)
    tower.set_backend(resolve_attention(attention, tower.attention_kinds, device, dtype, config.head_dim))
    # materialized with torch.empty of each shape, as `to_empty` does but without its `empty_like` of meta
    # tensors, which imports sympy (0.9 s of CPU per process: every encoder replica start). A checkpoint's
    # tensors are copied straight into the device's tensors in the final dtype (no float32 copy of the tower
    # on the host first: seconds of a cold start); the random init is seeded on the CPU (the same weights
    # on every device), then moved
    if path is not None:
        tower = tower._apply(
            lambda t: torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device)
        )
        load_weights(tower, path)
    else:
        tower = tower._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device="cpu"))
        init_random_weights(tower, seed)
    tower = tower.to(device=device, dtype=dtype).eval()
    quantize_tower(tower, quantization)  # after the weights and the cast: scales from the final bf16 weights
    # the text tower with its tokenizer, where the checkpoint has both (`text=False`: images only, e.g. a service
    # replica or a batch job that serves no text: no text weights on the GPU)
    text = load_text_side(path, device, dtype) if path is not None and text else None
    if source.random_weights:
        RandomWeightsWarning.warn(source.name, stacklevel=2)  # at the line that called load
    return VisionEncoder(
        config, tower, pp, name=source.name, source=source, quantization=quantization, text=text, video_config=video
    )
