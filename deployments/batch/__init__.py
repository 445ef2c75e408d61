"""Batch jobs: embed the images of Arrow / Parquet datasets with Ray Data.

* `embed_dataset(ds, ...)`: a lazy `ray.data.Dataset` with `embedding` and `error` columns.
* `run_job(JobConfig(...))` / `python -m deployments.batch --input ... --output ...`: a resumable job
  over Parquet or Arrow IPC files, written as Parquet parts with a manifest.

Modules: `options` (the parameters), `model_facts` (what the driver knows without weights), `decode` and
`actor` (the two stages), `columns` (their columns), `pipeline` (`embed_dataset`), `files` (inputs and
parts), `manifest` (the output directory), `job` (`run_job`).
"""

from encoder.lazy import lazy_exports

__all__ = [
    "EmbedOptions",
    "EncoderActor",
    "JobConfig",
    "JobError",
    "JobSummary",
    "decode_batch",
    "embed_dataset",
    "output_schema",
    "run_job",
]


# name -> module. Loaded on first use (PEP 562): the decode tasks' worker processes import this package for
# `decode.decode_batch` and must not pay for the encoder stage (torch) or the job driver.
_EXPORTS = {
    "EmbedOptions": "options",
    "EncoderActor": "actor",
    "JobConfig": "options",
    "JobError": "files",
    "JobSummary": "job",
    "decode_batch": "decode",
    "embed_dataset": "pipeline",
    "output_schema": "columns",
    "run_job": "job",
}


__getattr__ = lazy_exports(__name__, _EXPORTS)
