"""The parameters of a batch job, listed once: `EmbedOptions` (what `embed_dataset` takes) and `JobConfig`
(those plus the job's files, parts and cluster). The CLI builds a `JobConfig`, `run_job` passes it whole to
the parts runner and to `embed_dataset`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from encoder.errors import InvalidArgumentError


def invalid(error: ValidationError, what: str) -> InvalidArgumentError:
    """A pydantic error as the encoder's, naming every bad field (`decode_batch_size: Input should be ...`)."""
    problems = "; ".join(f"{'.'.join(str(x) for x in e['loc']) or what}: {e['msg']}" for e in error.errors())
    return InvalidArgumentError(f"invalid {what}: {problems}")


class EmbedOptions(BaseModel):
    """How `embed_dataset` embeds a dataset's image column."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True, protected_namespaces=())

    model: str = Field("tiny", description="Preset name or local Hugging Face checkpoint directory.")
    image_column: str = "image"
    text_column: str | None = Field(
        None,
        description="Embed this string column with the model's text tower instead of the image column (CLIP, "
        "SigLIP2 checkpoints with their tokenizer files); pooling 'model' (default) or 'model-l2'.",
    )
    video_column: str | None = Field(
        None,
        description="Embed this column's videos (Qwen towers) instead of images: encoded bytes (binary) or local "
        "file paths (string), sampled and resized as the checkpoint's video processor within its video limits; a "
        "bad video is an error row. Sets image_column to it (the stages read that column).",
    )
    # None, as the CLI and the HTTP API default: the model's own embedding ('model' for CLIP / SigLIP, else 'mean')
    pooling: str | None = Field(None, description="None: the model's default embedding ('model' for CLIP / SigLIP).")
    batch_size: int | None = Field(
        None,
        ge=1,
        description="Rows per encoder batch; None: from the typical patches (a text job: the texts one "
        "text graph of the actors holds, `texts.text_rows_per_batch`).",
    )
    typical_patches: int | None = Field(None, ge=1, description="Patches of a typical image; None: sampled.")
    num_gpus: int | None = Field(None, ge=0, description="GPU encoder actors, one GPU each; None: every GPU.")
    num_actors: int | None = Field(None, ge=1, description="CPU encoder actors when there are no GPUs (1).")
    actor_cpus: float | None = Field(None, ge=0, description="CPUs reserved per encoder actor; None: Ray Data's (1).")
    buckets: Any = Field(None, description="A bucket spec, table or [(budget, max_images)]; None: the device's.")
    dtype: str | None = None
    attention: str | None = None
    quantization: Literal["fp8"] | None = Field(
        None,
        description="'fp8': the blocks' linear layers in float8 e4m3 (encoder.load); GPUs of compute capability "
        "8.9 or newer, bfloat16.",
    )
    decode_batch_size: int = Field(32, ge=1, description="Rows per CPU decode task.")
    decode_concurrency: int | None = Field(None, ge=1, description="Decode tasks at once; None: Ray Data's.")
    decode_cpus: float = Field(1.0, ge=0)
    path_root: str | None = Field(None, description="Relative image paths resolve here; None: the working dir.")
    max_image_bytes: int = Field(
        20 * 2**20, ge=1, description="Encoded bytes of one image (a longer file or value is an error row)."
    )
    layout: Literal["parts", "vllm"] = Field(
        "parts",
        description="pooling 'none' (Qwen towers): 'parts' writes `embedding` (tokens) and `deepstack` apart; "
        "'vllm' writes `embedding` as vLLM's one [tokens, out_dim x (1 + DeepStack layers)] tensor per image "
        "(the tokens, then each layer, on the last axis) and no `deepstack` column. 'vllm' implies pooling 'none'.",
    )
    ec_cache_dir: str | None = Field(
        None,
        description="Write each image's vLLM-layout tensor for vLLM's disk encoder-cache connector as "
        "<ec_cache_dir>/<uuid>/encoder_cache.safetensors (key ec_cache, the tower's dtype) instead of an "
        "`embedding` column; the row gets `ec_cache` (the file's path). Needs uuid_column.",
    )
    uuid_column: str | None = Field(
        None, description="With ec_cache_dir: the string column holding each row's uuid (vLLM's mm_hash)."
    )

    @model_validator(mode="before")
    @classmethod
    def _video_column_is_the_column(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("video_column") is not None:
            if data.get("text_column") is not None:
                raise ValueError("video_column and text_column are two jobs; give one")
            data = {**data, "image_column": data["video_column"]}
        return data

    @model_validator(mode="after")
    def _check_quantization(self) -> EmbedOptions:
        # what the options alone rule out, before Ray starts; each actor's encoder.load checks its GPU
        if self.quantization is not None:
            if self.num_gpus == 0:
                raise ValueError(f"quantization {self.quantization!r} needs GPU encoder actors; num_gpus is 0")
            if self.dtype not in (None, "bfloat16", "bf16"):
                raise ValueError(
                    f"quantization {self.quantization!r} runs with dtype bfloat16 only, not {self.dtype!r}"
                )
        return self

    @model_validator(mode="after")
    def _check_layout(self) -> EmbedOptions:
        if (self.ec_cache_dir is None) != (self.uuid_column is None):
            raise ValueError("ec_cache_dir and uuid_column go together (the files are named by the uuid column)")
        if self.layout == "vllm" or self.ec_cache_dir is not None:
            if self.text_column is not None:
                raise ValueError("the vLLM layout and ec_cache_dir are for images, not text_column")
            if self.pooling not in (None, "none"):
                raise ValueError(f"the vLLM layout is of the per-token outputs (pooling 'none'), not {self.pooling!r}")
        if self.ec_cache_dir is not None and self.layout == "parts" and "layout" in self.model_fields_set:
            raise ValueError("ec_cache_dir writes the vLLM layout; layout 'parts' does not apply")
        return self

    @property
    def vllm(self) -> bool:
        """The vLLM layout (asked for, or implied by ec_cache_dir)."""
        return self.layout == "vllm" or self.ec_cache_dir is not None

    @classmethod
    def of(cls, **kwargs) -> EmbedOptions:
        try:
            return cls(**kwargs)
        except ValidationError as e:
            raise invalid(e, "embed_dataset arguments") from None


class JobConfig(EmbedOptions):
    """A resumable batch job (`run_job`, `python -m deployments.batch`)."""

    input: list[str]
    output: str
    id_column: str | None = Field("id", description="Names rows in the summary, if the input has it.")
    part_rows: int | None = Field(
        None, ge=1, description="Rows per output part; None: 10000 per vector, 1000 / (1 + DeepStack layers) per token."
    )
    progress: bool = True
    address: str | None = Field(None, description="Ray cluster address; None: RAY_ADDRESS or a local cluster.")
