"""Batch jobs over a text column (`--text-column`, `embed_dataset(..., text_column=...)`): the driver's side.

A text job embeds a string column with the model's text tower (CLIP, SigLIP2 with their tokenizer files) into
the images' embedding space: the same parts, manifest and resume as an image job, and the same output layout
(every input column but the embedded one, then `embedding` and `error`). There is no decode stage: rows go to
the text encoder actors (`deployments.batch.text_actor.TextEncoderActor`), `text_rows_per_batch()` at a time
(the largest text graph of the actors' engines, which each actor checks against its own); a null or empty text
is an error row (its `error` column), as a bad image is (`text_actor.text_row_error`).
"""

from __future__ import annotations

import warnings

import pyarrow as pa

from deployments.batch.columns import INTERNAL, OUTPUT_COLUMNS
from deployments.batch.model_facts import resolved
from encoder.errors import InvalidArgumentError
from workspace.text_buckets import default_text_batches


def text_rows_per_batch() -> int:
    """Rows per text encoder batch when not given: the most texts one text graph of the actors' engines holds
    (`GraphEncoder.max_text_batch` of the default text table, on every device; the text tower runs [texts,
    seq_len] at the model's fixed length). Known on the driver without loading the model."""
    return default_text_batches()[-1]


def is_text_type(typ: pa.DataType) -> bool:
    return pa.types.is_string(typ) or pa.types.is_large_string(typ) or getattr(pa.types, "is_string_view", bool)(typ)


def check_text_schema(schema: pa.Schema, text_column: str) -> None:
    """Fail early (before any work) on a missing or non-string text column, or a clash with output names."""
    if text_column not in schema.names:
        raise InvalidArgumentError(f"no column {text_column!r} in the input; columns: {', '.join(schema.names)}")
    typ = schema.field(text_column).type
    if not is_text_type(typ):
        raise InvalidArgumentError(f"text column {text_column!r} has type {typ}; expected string")
    clash = sorted(set(schema.names) & (set(OUTPUT_COLUMNS) | set(INTERNAL)))
    if clash:
        raise InvalidArgumentError(
            f"input column(s) {', '.join(clash)} would be overwritten by the output; rename them first"
        )


def text_pooling(pooling: str | None) -> str:
    """A text job's pooling: "model" (None: the model's text embedding) or "model-l2"."""
    from encoder.text_encoder import TEXT_POOLINGS

    if pooling is None:
        return "model"
    if pooling not in TEXT_POOLINGS:
        raise InvalidArgumentError(
            f"pooling {pooling!r} is not a text pooling; a text job takes {' or '.join(TEXT_POOLINGS)}"
        )
    return pooling


def check_text_model(model: str) -> None:
    """The model takes text: its checkpoint has a text tower and `tokenizer.json` (a preset has no tokenizer).
    Checked on the driver from its files; each actor checks again what it loaded."""
    from encoder.text_encoder import SENTENCEPIECE_ONLY, text_config_of
    from encoder.tokenization import has_tokenizer, tokenizer_class

    path = resolved(model).path
    usable = has_tokenizer(path) and tokenizer_class(path) not in SENTENCEPIECE_ONLY
    if not usable or text_config_of(path) is None:
        raise InvalidArgumentError(
            f"model {model!r} takes no text: --text-column needs an image-text checkpoint (CLIP, SigLIP2) with its "
            "tokenizer files (a preset has none)"
        )


def embed_texts(ds, options, pooling: str, gpus: int):
    """The text stage of `embed_dataset`: blocks of `batch_size` rows through an actor pool of text encoders."""
    import ray.data

    from deployments.batch.text_actor import TextEncoderActor

    o = options
    batch_size = o.batch_size or text_rows_per_batch()
    ds = ds.repartition(target_num_rows_per_block=batch_size, strict=True)
    actors = max(1, gpus) if gpus > 0 else max(1, int(o.num_actors or 1))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated")  # as for the image actors
        return ds.map_batches(
            TextEncoderActor,
            batch_format="pyarrow",
            batch_size=batch_size,
            fn_constructor_kwargs={
                "model": o.model,
                "text_column": o.text_column,
                "pooling": pooling,
                "dtype": o.dtype,
                "attention": o.attention,
                "quantization": o.quantization,
                "expected_text_batch": text_rows_per_batch(),
            },
            compute=ray.data.ActorPoolStrategy(size=actors, max_tasks_in_flight_per_actor=2),
            num_gpus=1 if gpus > 0 else 0,
            **({} if o.actor_cpus is None else {"num_cpus": o.actor_cpus}),
            udf_modifying_row_count=False,
            max_restarts=0,
        )
