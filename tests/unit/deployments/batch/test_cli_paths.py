"""Batch CLI inputs that used to hang or crash (issue 17, item 8): FIFOs, devices, oversize files, output
directories that cannot be made. No Ray: the decode stage is a plain function and the CLI fails before Ray."""

from __future__ import annotations

import os
import threading

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from deployments.batch.__main__ import main
from deployments.batch.decode import decode_batch
from deployments.batch.image_files import read_image_file
from deployments.batch.model_facts import preprocess_config_for
from encoder.errors import ImageDecodeError, ImageTooLargeError
from tests.images_util import encode, random_image

PP = preprocess_config_for("tiny")


def decode_paths(paths: list[str], max_image_bytes: int = 20 * 2**20) -> list[str | None]:
    """The `error` column of decoding `paths`, run in a thread so a hang fails the test instead of the run."""
    table = pa.table({"id": list(range(len(paths))), "image": paths})
    out: list = []
    worker = threading.Thread(
        target=lambda: out.append(
            decode_batch(table, image_column="image", pp=PP, path_root=None, max_image_bytes=max_image_bytes)
        ),
        daemon=True,
    )
    worker.start()
    worker.join(timeout=60)  # generous: the point is "returns", not "fast"
    assert out, "decoding the paths did not return (a read blocked)"
    return out[0].column("error").to_pylist()


def test_a_fifo_is_an_error_row_not_a_hang(tmp_path):
    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)
    (error,) = decode_paths([str(fifo)])
    assert "FIFO" in error and str(fifo) in error


def test_dev_zero_is_refused_without_reading(tmp_path):
    (error,) = decode_paths(["/dev/zero"])
    assert "/dev/zero" in error and "character device" in error


def test_files_over_max_image_bytes_and_directories_are_error_rows_naming_them(tmp_path):
    big = tmp_path / "big.png"
    with open(big, "wb") as fh:  # sparse: no disk used
        fh.truncate(3 * 2**20)
    good = tmp_path / "good.png"
    good.write_bytes(encode(random_image("RGB", 40, 50), "PNG"))
    paths = [str(big), str(tmp_path), str(good), str(tmp_path / "missing.png"), f"file://{good}"]
    errors = decode_paths(paths, max_image_bytes=2**20)
    assert "ImageTooLargeError" in errors[0] and str(big) in errors[0] and "max_image_bytes" in errors[0]
    assert "directory" in errors[1] and str(tmp_path) in errors[1]
    assert errors[2] is None
    assert errors[3].startswith("FileNotFoundError") and str(tmp_path / "missing.png") in errors[3]
    assert errors[4] is None  # a file:// URL names the same file


def test_read_image_file_bounds_the_read(tmp_path):
    path = tmp_path / "x.bin"
    path.write_bytes(b"x" * 100)
    assert read_image_file(path, 100) == b"x" * 100
    with pytest.raises(ImageTooLargeError, match="x.bin"):
        read_image_file(path, 99)
    with pytest.raises(ImageDecodeError, match="character device"):
        read_image_file("/dev/zero", 10)


def test_encoded_bytes_over_the_limit_are_an_error_row():
    data = encode(random_image("RGB", 40, 50), "PNG")
    table = pa.table({"image": pa.array([data], type=pa.binary())})
    out = decode_batch(table, image_column="image", pp=PP, path_root=None, max_image_bytes=len(data) - 1)
    assert "over the limit" in out.column("error")[0].as_py()
    out = decode_batch(table, image_column="image", pp=PP, path_root=None, max_image_bytes=len(data))
    assert out.column("error")[0].as_py() is None  # at the limit: read, as a file of that size is


@pytest.fixture
def input_file(tmp_path):
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": [0], "image": pa.array([b"not an image"], type=pa.binary())}), path)
    return path


@pytest.mark.parametrize("kind", ["existing file", "under a file"])
def test_an_output_directory_that_cannot_be_made_exits_2_with_one_line(kind, input_file, tmp_path, capsys):
    blocker = tmp_path / "taken"
    blocker.write_text("a file")
    output = blocker if kind == "existing file" else blocker / "sub"
    code = main(["--input", str(input_file), "--output", str(output), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and "--output" in err and str(output) in err, err


def test_help_states_every_exit_status_and_hub_ids(capsys):
    """Broken: --help named exit statuses 0 and 2 only, and --model as a preset or directory (no Hub ids)."""
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert info.value.code == 0
    for status in ("0 the job is complete", "1 it ended with parts missing", "2 bad arguments", "130 interrupted"):
        assert status in out, out
    assert "Hub id org/name[@rev]" in out and "Hugging Face Hub id" in out


def test_a_refused_bomb_is_an_error_row_and_no_pillow_warning():
    """Broken: a decode task refused a bomb (its row's `error`) and Pillow's DecompressionBombWarning went to
    the job's log too."""
    import warnings

    from PIL import Image

    from tests.images_util import png_bomb_header

    table = pa.table({"id": [0], "image": [png_bomb_header(12_000, 10_000)]})  # 120 MP
    with warnings.catch_warnings(record=True) as caught:  # and restores the filter decode_batch adds
        warnings.simplefilter("always")
        out = decode_batch(table, image_column="image", pp=PP, path_root=None)
    assert "over the limit of 100000000" in out.column("error")[0].as_py()
    assert [str(w.message) for w in caught if issubclass(w.category, Image.DecompressionBombWarning)] == []
