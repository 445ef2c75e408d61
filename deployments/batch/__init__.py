"""Batch jobs: embed the images of Arrow / Parquet datasets with Ray Data.

* `embed_dataset(ds, ...)`: a lazy `ray.data.Dataset` with `embedding` and `error` columns.
* `run_job(JobConfig(...))` / `python -m deployments.batch --input ... --output ...`: a resumable job
  over Parquet or Arrow IPC files, written as Parquet parts with a manifest.
"""

from .dataset import EncoderActor, decode_batch, embed_dataset, output_schema
from .job import JobConfig, JobError, JobSummary, run_job

__all__ = [
    "EncoderActor",
    "JobConfig",
    "JobError",
    "JobSummary",
    "decode_batch",
    "embed_dataset",
    "output_schema",
    "run_job",
]
