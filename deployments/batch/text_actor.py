"""The encode stage of a text job: `TextEncoderActor`, a Ray Data callable class (one per GPU, or CPU worker).

It loads the model with its text side (`encoder.load`: a checkpoint with a text tower and its tokenizer) into a
text-only `workspace.GraphEncoder` (`images=False`: the text graphs alone are captured, none of the image
buckets it never replays), tokenizes each batch's texts with the model's tokenizer (cut to the tower's length as
the tokenizer does) and adds the `embedding` column; null and empty texts are error rows
(`text_row_error`). Layout: as an image job's vectors (`deployments.batch.columns`).
"""

from __future__ import annotations

import sys
import time
import warnings

import numpy as np
import pyarrow as pa

import encoder
from deployments.batch.columns import EMBEDDING, ERROR, fixed_size_list
from encoder.errors import InvalidArgumentError
from workspace.graph_encoder import GraphEncoder


def text_row_error(value) -> str | None:
    """Why a text cell cannot be embedded (its row's `error`), or None."""
    if value is None:
        return "InvalidArgumentError: text is null"
    if not value:
        return "InvalidArgumentError: text is an empty string"
    return None


class TextEncoderActor:
    """Ray Data callable class: a string column -> `embedding` (float32 [out_dim]) and `error` columns."""

    def __init__(
        self,
        model: str,
        text_column: str,
        pooling: str = "model",
        dtype: str | None = None,
        attention: str | None = None,
        quantization: str | None = None,
        expected_text_batch: int | None = None,
    ):
        start = time.perf_counter()
        warnings.filterwarnings("ignore", category=encoder.RandomWeightsWarning)  # as the image actors
        self.vision = encoder.load(model, dtype=dtype, attention=attention, quantization=quantization)
        if not self.vision.supports_text:
            raise InvalidArgumentError(f"model {model!r} takes no text (no text tower with its tokenizer files)")
        self.engine = GraphEncoder(self.vision, images=False)  # the text graphs only
        if expected_text_batch is not None and self.engine.max_text_batch != expected_text_batch:
            raise InvalidArgumentError(
                f"the driver sized text batches for {expected_text_batch} texts a graph, but this actor's engine holds "
                f"{self.engine.max_text_batch} (driver/actor drift)"
            )
        self.text_column, self.pooling = text_column, pooling
        self.dim = self.vision.text.config.out_dim
        stats = self.engine.stats()["text"]
        print(
            f"[deployments.batch] text encoder {self.vision.name} on {self.vision.device} ({self.vision.dtype}): "
            f"{self.vision.text.config.seq_len} tokens per text, up to {self.engine.max_text_batch} texts a graph, "
            f"{stats['captures']} text graphs captured in {stats['capture_seconds']:.1f} s, "
            f"ready in {time.perf_counter() - start:.1f} s",
            file=sys.stderr,
            flush=True,
        )

    def __call__(self, table: pa.Table) -> pa.Table:
        n = table.num_rows
        values = table.column(self.text_column).to_pylist()
        errors = [text_row_error(v) for v in values]
        ok = [i for i in range(n) if errors[i] is None]
        values_out = np.zeros((n, self.dim), dtype=np.float32)
        if ok:
            for i, vec in zip(ok, self.engine.encode_text([values[i] for i in ok], self.pooling), strict=True):
                values_out[i] = vec.numpy()
        valid = np.array([e is None for e in errors], dtype=bool)
        out = table.drop_columns([self.text_column])
        out = out.append_column(EMBEDDING, fixed_size_list(values_out, self.dim, ~valid))
        return out.append_column(ERROR, pa.array(errors, type=pa.string()))
