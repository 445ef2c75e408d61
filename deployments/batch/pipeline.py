"""`embed_dataset`: images in an Arrow column -> embeddings, with Ray Data (or, with `text_column`, texts:
`deployments.batch.texts`).

Two stages: decode (`deployments.batch.decode`, Ray tasks on CPUs) and encode (`deployments.batch.actor`,
an actor pool, one GPU per actor where GPUs exist). Ray Data batches by rows, so rows per encoder batch are
chosen from the typical patch count (about two of the actor's batches of patches: `rows_per_batch`);
inside a batch the actor re-orders images by the bucket table. Rows out = rows in, in any order; every
non-image column is passed through.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pyarrow as pa

from deployments.batch.decode import check_input_schema, decode_batch, image_column_kind, typical_patches_of
from deployments.batch.model_facts import (
    config_for,
    gpus_in_cluster,
    plan_for_actors,
    preprocess_config_for,
    resolve_pooling,
    resolved,
    rows_per_batch,
    typical_video_patches,
    video_config_for,
)
from deployments.batch.options import EmbedOptions
from deployments.vllm_handoff import check_vllm_model
from encoder.errors import InvalidArgumentError, RandomWeightsWarning


def arrow_schema(schema) -> pa.Schema | None:
    """A dataset's schema (`ray.data.Schema`, or a pyarrow one) as a pyarrow schema; None for pandas blocks."""
    if isinstance(schema, pa.Schema):
        return schema
    names, types = list(schema.names), list(schema.types)
    if all(isinstance(t, pa.DataType) for t in types):
        return pa.schema(list(zip(names, types, strict=True)))
    return None


def embed_dataset(ds, options: EmbedOptions | None = None, **kwargs):
    """Embed the images of `ds[image_column]` (or, with `text_column`, the texts of that string column, in the
    images' embedding space: `deployments.batch.texts`; with `video_column`, the videos of that column: Qwen
    towers, `decode.decode_video_batch`); returns a lazy `ray.data.Dataset`.

    The parameters are `EmbedOptions`' fields, given as keywords (`model="tiny", pooling="mean"`) or as one
    `EmbedOptions` (a batch job passes its `JobConfig`).

    Output rows: every input column except the image column, then `embedding` and `error`:
      * pooling="mean" (or "model", "mean-l2", "model-l2"; None = the model's default: "model" for
        CLIP / SigLIP, "mean" otherwise; see `encoder.api`): `embedding` is
        `fixed_size_list<float32>[dim]` (null for error rows);
      * pooling="none": `embedding` is `list<fixed_size_list<float32>[out_dim]>`, one vector per
        output token in the merger's order (row-major over the merged `grid_h` x `grid_w` grid), plus
        `num_tokens` and the patch grid `grid_t`, `grid_h`, `grid_w` = HF's `image_grid_thw` (int32, 0 for
        error rows), the same grid as one `grid_thw` value, for a `video_column` the video's `timestamps`
        (Qwen3-VL) and `second_per_grid_ts` (Qwen2/2.5-VL), null where the tower has none, and, for DeepStack
        models, `deepstack` (see `deployments.batch.columns`);
      * `error`: null, or why the row's image could not be embedded (`ImageDecodeError: ...`).
    Rows out = rows in; row order is not kept (carry an id column).

    The image column holds encoded bytes (binary), local file paths (string; relative ones are
    resolved against `path_root`, default the caller's working directory) or Hugging Face
    `datasets` image structs (`struct<bytes, path>`).

    Resources: `num_gpus` encoder actors with one GPU each (default: every GPU in the cluster); with
    no GPUs, `num_actors` CPU actors (default 1). `batch_size` is rows per encoder batch; by default
    it is about two of the actor's batches of patches at `typical_patches` per image (sampled
    from the first rows when not given, which runs the head of `ds` once). Decoding runs as tasks of
    `decode_batch_size` rows, `decode_cpus` each, at most `decode_concurrency` at once.
    """
    import ray.data

    from deployments.batch.actor import EncoderActor  # torch: after the model and arguments are checked

    if options is None:
        options = EmbedOptions.of(**kwargs)
    elif kwargs:
        options = EmbedOptions.of(**(options.model_dump() | kwargs))
    o, model, image_column = options, options.model, options.image_column
    if o.text_column is not None:
        return _embed_text_column(ds, o)
    if o.vllm:  # Qwen towers only; the per-token outputs
        check_vllm_model(config_for(model).family, model, "layout")
    pooling = resolve_pooling("none" if o.vllm else o.pooling, model)
    pp = preprocess_config_for(model)  # also validates the model name / directory up front
    if resolved(model).random_weights:  # here, once, at the caller's line; the actors keep quiet about it
        RandomWeightsWarning.warn(model, stacklevel=2)
    schema = ds.schema(fetch_if_missing=False)
    if schema is not None:  # known without reading (Parquet footers): the CLI's checks, before any work
        arrow = arrow_schema(schema)
        if arrow is not None:
            check_input_schema(arrow, image_column, video=o.video_column is not None)
        elif image_column not in schema.names:  # pandas blocks: their types are checked as they are decoded
            raise InvalidArgumentError(f"no column {image_column!r} in the input; columns: {', '.join(schema.names)}")
    gpus = gpus_in_cluster() if o.num_gpus is None else o.num_gpus
    if o.quantization and gpus == 0:  # the CPU actors' encoder.load would refuse it, one by one, inside Ray Data
        raise InvalidArgumentError(f"quantization {o.quantization!r} needs GPU encoder actors; the cluster has no GPU")
    plan = plan_for_actors(model, gpus, o.buckets, o.dtype, o.attention)
    root = str(Path.cwd()) if o.path_root is None else str(o.path_root)
    batch_size, typical_patches = o.batch_size, o.typical_patches
    video_cfg = video_config_for(model) if o.video_column is not None else None  # refused for a tower without
    if video_cfg is not None and typical_patches is None:
        typical_patches = typical_video_patches(video_cfg)
    if batch_size is None:
        if typical_patches is None:
            sample = ds.select_columns([image_column]).limit(32).take_batch(32, batch_format="pyarrow")
            kind = image_column_kind(sample.schema.field(image_column).type)
            typical_patches = typical_patches_of(sample.column(image_column).to_pylist(), kind, pp, root)
        batch_size = rows_per_batch(plan, typical_patches)

    decode_compute = ray.data.TaskPoolStrategy(size=o.decode_concurrency) if o.decode_concurrency else None
    # Small blocks so decoding spreads over many tasks; then blocks of exactly one encoder batch. The
    # strict repartition is its own stage, which also keeps Ray Data from fusing the decode tasks into
    # the encoder actors (it would when both ask for the same resources, e.g. on a CPU-only cluster).
    ds = ds.repartition(target_num_rows_per_block=o.decode_batch_size, strict=True)
    ds = ds.map_batches(
        decode_batch,
        batch_format="pyarrow",
        batch_size=None,
        fn_kwargs={
            "image_column": image_column,
            "pp": pp,
            "path_root": root,
            "max_image_bytes": o.max_image_bytes,
            **({"video_cfg": video_cfg} if video_cfg is not None else {}),
        },  # fmt: skip
        num_cpus=o.decode_cpus,
        compute=decode_compute,
        udf_modifying_row_count=False,
    )
    ds = ds.repartition(target_num_rows_per_block=batch_size, strict=True)
    actors = max(1, gpus) if gpus > 0 else max(1, int(o.num_actors or 1))
    with warnings.catch_warnings():
        # max_restarts goes through **ray_remote_args, which Ray 2.60 deprecates for named parameters it does
        # not have yet (ray is pinned below 2.61)
        warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated")
        return ds.map_batches(
            EncoderActor,
            batch_format="pyarrow",
            batch_size=batch_size,
            fn_constructor_kwargs={
                "model": model,
                "pooling": pooling,
                "buckets": o.buckets,
                "dtype": o.dtype,
                "attention": o.attention,
                "quantization": o.quantization,
                "preprocess_config": pp,
                "expected_table": plan.table,
                "layout": o.layout,
                "ec_cache_dir": o.ec_cache_dir,
                "uuid_column": o.uuid_column,
            },
            compute=ray.data.ActorPoolStrategy(size=actors, max_tasks_in_flight_per_actor=2),
            num_gpus=1 if gpus > 0 else 0,
            # Ray Data reserves 1 CPU per actor, GPU or not, unless told otherwise; naming num_cpus beside
            # num_gpus would also have it log on every GPU run that the combination is "experimental"
            **({} if o.actor_cpus is None else {"num_cpus": o.actor_cpus}),
            udf_modifying_row_count=False,
            # Ray Data restarts dead actors by default, but keeps their constructor arguments (its map transformer)
            # in the object store, and Ray logs an E-level line on every run that such a restart may fail. A dead
            # encoder actor (a GPU fault, a lost node) ends the job instead; a re-run keeps its finished parts.
            max_restarts=0,
        )


def _embed_text_column(ds, o: EmbedOptions):
    """`embed_dataset` of a text column (`deployments.batch.texts`): model, pooling and schema checked first."""
    from deployments.batch.texts import check_text_model, check_text_schema, embed_texts, text_pooling

    pooling = text_pooling(o.pooling)
    check_text_model(o.model)
    if resolved(o.model).random_weights:
        RandomWeightsWarning.warn(o.model, stacklevel=3)
    schema = ds.schema(fetch_if_missing=False)
    if schema is not None:
        arrow = arrow_schema(schema)
        if arrow is not None:
            check_text_schema(arrow, o.text_column)
        elif o.text_column not in schema.names:
            raise InvalidArgumentError(f"no column {o.text_column!r} in the input; columns: {', '.join(schema.names)}")
    gpus = gpus_in_cluster() if o.num_gpus is None else o.num_gpus
    if o.quantization and gpus == 0:
        raise InvalidArgumentError(f"quantization {o.quantization!r} needs GPU encoder actors; the cluster has no GPU")
    return embed_texts(ds, o, pooling, gpus)
