"""Batch jobs: embed the images of Arrow / Parquet datasets with Ray Data.

* `embed_dataset(ds, ...)`: a lazy `ray.data.Dataset` with `embedding` and `error` columns.
* `run_job(JobConfig(...))` / `python -m deployments.batch --input ... --output ...`: a resumable job
  over Parquet or Arrow IPC files, written as Parquet parts with a manifest.

Modules: `options` (the parameters), `model_facts` (what the driver knows without weights), `decode` and
`actor` (the two stages), `columns` (their columns), `pipeline` (`embed_dataset`), `files` (inputs and
parts), `manifest` (the output directory), `job` (`run_job`).
"""

from .actor import EncoderActor
from .columns import output_schema
from .decode import decode_batch
from .files import JobError
from .job import JobSummary, run_job
from .options import EmbedOptions, JobConfig
from .pipeline import embed_dataset

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
