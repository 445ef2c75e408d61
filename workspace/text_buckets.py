"""The text tower's bucket table: one graph per (texts, columns) key (pure Python: no torch).

A text batch is [B, seq_len] token ids. Its graphs are keyed by a batch size (1, 2, 4, ..., 256 texts by default)
and a column count: the tower's full `seq_len` always, and, for a tower whose outputs depend only on the
leading columns of each text (`TextGraphTower.prefix_exact`: CLIP, causal and pooled at its EOS), shorter column
counts (8, 16, 32, ... below `seq_len`), so a batch of short texts runs on [B, 16] instead of [B, 77]. A batch runs
in the smallest key that holds its text count and its longest span; more texts than the largest batch are split
into chunks of the largest batch; a span longer than every column count (only with a table given without the
full length) runs eagerly.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from workspace.buckets import BucketError, _positive_int

#: most texts one replay holds in the default table (on a CPU too, where its keys run eagerly): what replicas and
#: batch jobs size text batches by (`default_text_batches`, `GraphEncoder.max_text_batch`)
MAX_GRAPH_TEXTS = 256
#: fewest columns of the default table's shorter graphs
MIN_TEXT_COLUMNS = 8


@dataclass(frozen=True, order=True)
class TextKey:
    """One captured text graph: `batch` texts of `seq` columns (token ids and mask [batch, seq])."""

    batch: int
    seq: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "batch", _positive_int(self.batch, "TextKey.batch"))
        object.__setattr__(self, "seq", _positive_int(self.seq, "TextKey.seq"))

    def __str__(self) -> str:
        return f"{self.batch}x{self.seq}"


@dataclass(frozen=True)
class TextChunk:
    """Texts `start:stop` of a batch run together in `key` (None: eagerly, at the full length)."""

    key: TextKey | None
    start: int
    stop: int
    span: int  # the longest span among them (columns their outputs depend on)

    @property
    def size(self) -> int:
        return self.stop - self.start


def _ascending(values, name: str) -> tuple[int, ...]:
    if isinstance(values, str | bytes) or not isinstance(values, Iterable) or not (values := tuple(values)):
        raise BucketError(f"a text table needs a sequence of one or more sizes in {name}, got {values!r}")
    return tuple(sorted({_positive_int(v, f"TextTable.{name}") for v in values}))


@dataclass(frozen=True)
class TextTable:
    """Batch sizes x column counts, each ascending and distinct; every pair is one graph."""

    batches: tuple[int, ...]
    seqs: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "batches", _ascending(self.batches, "batches"))
        object.__setattr__(self, "seqs", _ascending(self.seqs, "seqs"))

    @property
    def keys(self) -> list[TextKey]:
        return [TextKey(b, s) for b in self.batches for s in self.seqs]

    def __len__(self) -> int:
        return len(self.batches) * len(self.seqs)

    def key_for(self, texts: int, span: int) -> TextKey | None:
        """The smallest key holding `texts` texts (at most the largest batch) of `span` columns; None when
        the span is longer than every column count."""
        if not 0 < texts <= self.batches[-1]:
            raise BucketError(f"{texts} texts: a chunk holds 1 to {self.batches[-1]}")
        seq = next((s for s in self.seqs if s >= span), None)
        if seq is None:
            return None
        return TextKey(next(b for b in self.batches if b >= texts), seq)

    def chunks(self, spans: list[int]) -> list[TextChunk]:
        """The texts with these spans (in order) as chunks of at most the largest batch, each in its key."""
        most, out = self.batches[-1], []
        for start in range(0, len(spans), most):
            stop = min(start + most, len(spans))
            span = max(spans[start:stop])
            out.append(TextChunk(self.key_for(stop - start, span), start, stop, span))
        return out


def default_text_batches() -> tuple[int, ...]:
    """The default table's batch sizes: 1, 2, 4, ..., `MAX_GRAPH_TEXTS` (any tower, any device)."""
    return tuple(1 << i for i in range(MAX_GRAPH_TEXTS.bit_length()) if 1 << i <= MAX_GRAPH_TEXTS)


def text_table(seq_len: int, prefix_exact: bool, batches=None, seqs=None) -> TextTable:
    """The text graphs of a tower of `seq_len` columns (see the module docstring). `batches`: batch sizes (None:
    1, 2, 4, ..., `MAX_GRAPH_TEXTS`); `seqs`: column counts (None: `seq_len`, and for a `prefix_exact` tower the
    powers of two from `MIN_TEXT_COLUMNS` below it). Shorter column counts for a tower that is not prefix-exact
    are refused: its outputs would change."""
    seq_len = _positive_int(seq_len, "seq_len")
    if batches is None:
        batches = default_text_batches()
    if seqs is None:
        shorter = [1 << i for i in range(seq_len.bit_length()) if MIN_TEXT_COLUMNS <= 1 << i < seq_len]
        seqs = [*shorter, seq_len] if prefix_exact else [seq_len]
    table = TextTable(batches, seqs)
    if table.seqs[-1] > seq_len:
        raise BucketError(f"text graph columns {table.seqs[-1]} exceed the tower's {seq_len} tokens per text")
    if not prefix_exact and table.seqs != (seq_len,):
        raise BucketError(
            f"text graph columns {list(table.seqs)}: this text tower's outputs depend on every one of its {seq_len} "
            "columns (pads included), so its graphs take the full length only"
        )
    return table
