"""`python -m encoder`: several images, full embeddings in .npy / .parquet / JSON Lines, errors that
name the file: a bad image is reported and left out (exit 1), bad arguments exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

import encoder
from encoder.__main__ import main
from tests.hf_models import write_checkpoint
from tests.hub_cache import populate

ROOT = Path(__file__).resolve().parents[3]  # the repository root


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> list[Path]:
    """Two PNGs of different sizes (different token counts) and a JPEG."""
    folder = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    paths = []
    for name, (h, w) in (("a.png", (56, 84)), ("b.png", (112, 56)), ("c.jpg", (64, 64))):
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(folder / name)
        paths.append(folder / name)
    return paths


@pytest.fixture(scope="module")
def tiny():
    return encoder.load("tiny", device="cpu")


def expected(enc, paths, pooling):
    return enc.encode([p.read_bytes() for p in paths], pooling=pooling)


def run(*args) -> int:
    return main([str(a) for a in args] + ["--device", "cpu"])


def test_default_print_is_short(images, capsys):
    assert run(*images) == 0
    out, err = capsys.readouterr()
    lines = [json.loads(line) for line in out.splitlines()]
    assert [line["image"] for line in lines] == [str(p) for p in images]
    assert all(len(line["embedding"]) == 8 and line["shape"] == [128] for line in lines)
    assert "3 images, tiny on cpu" in err and "RANDOM weights" in err


def test_npy_holds_every_pooled_vector(images, tiny, tmp_path):
    out = tmp_path / "emb.npy"
    assert run(*images, "--output", out) == 0
    array = np.load(out)
    assert array.shape == (3, tiny.out_dim) and array.dtype == np.float32
    np.testing.assert_allclose(array, torch.stack(expected(tiny, images, "mean")).numpy(), rtol=1e-5, atol=1e-6)
    assert [p.name for p in tmp_path.iterdir()] == ["emb.npy"]  # no temporary left behind


def test_parquet_pooled(images, tiny, tmp_path):
    out = tmp_path / "emb.parquet"
    assert run(*images, "--output", out, "--pooling", "mean-l2") == 0
    table = pq.read_table(out)
    assert table.column_names == ["image", "embedding"]
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), tiny.out_dim)
    assert table.column("image").to_pylist() == [str(p) for p in images]
    got = np.array(table.column("embedding").to_pylist(), dtype=np.float32)
    np.testing.assert_allclose(got, torch.stack(expected(tiny, images, "mean-l2")).numpy(), rtol=1e-5, atol=1e-6)


def test_parquet_per_token(images, tiny, tmp_path):
    out = tmp_path / "tokens.parquet"
    assert run(*images, "--output", out, "--pooling", "none") == 0
    table = pq.read_table(out)
    assert table.column_names == ["image", "embedding", "num_tokens", "grid_thw"]
    assert table.schema.field("embedding").type == pa.list_(pa.list_(pa.float32(), tiny.out_dim))
    want = expected(tiny, images, "none")
    batch = tiny.preprocess([p.read_bytes() for p in images])
    assert table.column("num_tokens").to_pylist() == [w.shape[0] for w in want]
    assert table.column("grid_thw").to_pylist() == batch.grid_thw.tolist()
    assert len(set(table.column("num_tokens").to_pylist())) > 1  # images of different sizes
    for row, w in zip(table.column("embedding").to_pylist(), want, strict=True):
        np.testing.assert_allclose(np.array(row, dtype=np.float32), w.numpy(), rtol=1e-5, atol=1e-6)


def test_json_lines_on_stdout(images, tiny, capsysbinary):
    assert run(*images, "--output", "-", "--pooling", "none") == 0
    out, _ = capsysbinary.readouterr()
    lines = [orjson.loads(line) for line in out.splitlines()]
    want = expected(tiny, images, "none")
    for line, path, w in zip(lines, images, want, strict=True):
        assert line["image"] == str(path) and line["shape"] == list(w.shape)
        np.testing.assert_allclose(np.array(line["embedding"], dtype=np.float32), w.numpy(), rtol=1e-6, atol=1e-7)


def test_clip_defaults_to_its_own_embedding(images, tmp_path):
    out = tmp_path / "clip.npy"
    assert run(*images, "--model", "tiny-clip", "--output", out) == 0
    clip = encoder.load("tiny-clip", device="cpu")
    np.testing.assert_allclose(np.load(out), torch.stack(expected(clip, images, "model")).numpy(), rtol=1e-5, atol=1e-6)


def error_of(capsys, *args) -> str:
    assert run(*args) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "object at 0x" not in lines[0], err
    return lines[0]


def failures_of(capsys, *args) -> tuple[str, list[str]]:
    """stdout and the `error:` lines of a run with bad images: exit 1."""
    assert run(*args) == 1
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert all("object at 0x" not in line for line in lines), err
    return out, lines


def test_bad_images_are_reported_the_good_ones_written_and_exit_1(images, tiny, tmp_path, capsys):
    """Broken: one bad image made the run write nothing for the good ones (exit 2)."""
    missing = tmp_path / "missing.png"
    corrupt = tmp_path / "corrupt.png"
    corrupt.write_bytes(b"not an image")
    truncated = tmp_path / "truncated.jpg"
    truncated.write_bytes(images[2].read_bytes()[:200])
    out = tmp_path / "out.npy"
    _, lines = failures_of(capsys, images[0], missing, corrupt, images[1], truncated, "--output", out)
    assert len(lines) == 3, lines  # one line per bad file, naming it
    assert lines[0] == f"error: {missing}: cannot read (No such file or directory)"
    assert lines[1].startswith(f"error: {corrupt}: cannot identify image data")
    assert lines[2].startswith(f"error: {truncated}: ")
    good = [images[0], images[1]]
    np.testing.assert_allclose(np.load(out), torch.stack(expected(tiny, good, "mean")).numpy(), rtol=1e-5, atol=1e-6)
    printed, lines = failures_of(capsys, missing, images[2])  # the default print: the good image only
    assert [json.loads(line)["image"] for line in printed.splitlines()] == [str(images[2])]
    assert lines == [f"error: {missing}: cannot read (No such file or directory)"]


def test_no_good_image_writes_nothing_and_exits_1(images, tmp_path, capsys):
    missing = tmp_path / "missing.png"
    corrupt = tmp_path / "corrupt.png"
    corrupt.write_bytes(b"not an image")
    out = tmp_path / "out.npy"
    printed, lines = failures_of(capsys, missing, "--output", out)  # before the model loads
    assert printed == "" and lines == [f"error: {missing}: cannot read (No such file or directory)"]
    printed, lines = failures_of(capsys, corrupt, missing, "--output", out)
    assert printed == "" and len(lines) == 2 and not out.exists()


def test_output_errors_exit_2_before_the_model_loads(images, tmp_path, capsys):
    assert "unknown format" in error_of(capsys, *images, "--output", tmp_path / "emb.txt")
    assert "pooling 'none'" in error_of(capsys, *images, "--pooling", "none", "--output", tmp_path / "t.npy")
    nowhere = tmp_path / "no" / "such" / "dir" / "emb.parquet"
    assert f"the folder {nowhere.parent} does not exist" in error_of(capsys, *images, "--output", nowhere)
    (tmp_path / "dir.npy").mkdir()
    assert "is a directory" in error_of(capsys, *images, "--output", tmp_path / "dir.npy")
    assert list(tmp_path.iterdir()) == [tmp_path / "dir.npy"]  # nothing written


def test_bad_model_exits_2_with_one_line(images, capsys):
    line = error_of(capsys, images[0], "--model", "/nonexistent/dir")
    assert "'/nonexistent/dir': no such directory" in line and "org/name" in line


def test_write_failure_names_the_output(images, tmp_path, capsys, monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np, "save", refuse)
    out = tmp_path / "full.npy"
    assert error_of(capsys, images[0], "--output", out) == f"error: {out}: cannot write (No space left on device)"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_hub_id_from_the_cache_named_by_the_environment(images, tmp_path):
    """A real process: HF_HOME and HF_HUB_OFFLINE are read from its environment by huggingface_hub."""
    checkpoint = tmp_path / "ckpt"
    write_checkpoint(checkpoint, "qwen2_5_vl", "full")
    populate(tmp_path / "hf_home" / "hub", "tiny-org/tiny-vl", checkpoint)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "encoder", str(images[0]), "--device", "cpu", "--output", "-", "--model"]
    ok = subprocess.run([*cmd, "tiny-org/tiny-vl"], env=env, capture_output=True, timeout=300)
    assert ok.returncode == 0, ok.stderr.decode()
    line = orjson.loads(ok.stdout.splitlines()[0])
    want = encoder.load(str(checkpoint), device="cpu").encode([images[0].read_bytes()], pooling="mean")[0]
    np.testing.assert_allclose(np.array(line["embedding"], dtype=np.float32), want.numpy(), rtol=1e-5, atol=1e-6)
    assert b"RANDOM" not in ok.stderr
    bad = subprocess.run([*cmd, "tiny-org/absent"], env=env, capture_output=True, timeout=300)
    assert bad.returncode == 2 and bad.stdout == b""
    assert b"'tiny-org/absent': not in the Hub cache" in bad.stderr and b"HF_HUB_OFFLINE" in bad.stderr


def test_a_file_name_that_is_not_utf8_is_written_escaped(images, tmp_path, capsysbinary):
    """Before the fix: `--output -` and `.parquet` ended in a traceback (orjson's and pyarrow's refusal of the
    surrogates Python decodes a Latin-1 file name to), after the image was encoded."""
    try:
        latin1 = os.fsdecode(os.fsencode(tmp_path) + b"/caf\xe9.png")
        Path(latin1).write_bytes(images[0].read_bytes())
    except (OSError, UnicodeError):
        pytest.skip("this file system takes UTF-8 names only")
    shown = f"{tmp_path}/caf\\xe9.png"
    assert run(latin1, "--output", tmp_path / "e.parquet") == 0
    assert pq.read_table(tmp_path / "e.parquet").column("image").to_pylist() == [shown]
    assert run(latin1, "--output", "-") == 0
    assert orjson.loads(capsysbinary.readouterr().out)["image"] == shown


def test_help_names_the_formats_and_hub_ids(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0 and ".parquet" in out and "org/name" in out
    assert "1 some images failed (the others written)" in out


@pytest.mark.parametrize("output", [[], ["--output", "-"]], ids=["short", "json-lines"])
def test_a_reader_that_went_away_is_one_line_not_a_traceback(images, output):
    """`python -m encoder ... | head`: stdout's reader is gone before the answer is written. Before the fix the
    short print (no `--output`) ended in a BrokenPipeError traceback and exit 1; `--output -` already gave
    its one line, and still must."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write to stdout now fails with EPIPE
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "encoder", str(images[0]), "--model", "tiny", "--device", "cpu", *output]
    try:
        done = subprocess.run(cmd, env=env, stdout=write_end, stderr=subprocess.PIPE, timeout=300)
    finally:
        os.close(write_end)
    lines = done.stderr.decode().strip().splitlines()
    assert done.returncode == 2, lines
    assert lines[-1] == "error: " + ("-" if output else "stdout") + ": cannot write (Broken pipe)", lines
    assert not any("Traceback" in line or "Exception ignored" in line for line in lines), lines


def test_a_refused_bomb_is_one_error_line_and_no_pillow_warning(images, tmp_path, capsys):
    """Broken: an image over the 100 MP limit was refused and Pillow's DecompressionBombWarning (its own
    limit is ~89 MP) was printed too."""
    import warnings

    from tests.images_util import png_bomb_header

    bomb = tmp_path / "bomb.png"
    bomb.write_bytes(png_bomb_header(12_000, 10_000))  # 120 MP: over both limits, under Pillow's error (~179 MP)
    with warnings.catch_warnings(record=True) as caught:  # and restores the filter main() adds
        warnings.simplefilter("always")
        printed, lines = failures_of(capsys, bomb, images[0])
    assert lines == [f"error: {bomb}: image is 12000x10000 = 120000000 pixels, over the limit of 100000000"]
    assert [str(w.message) for w in caught if issubclass(w.category, Image.DecompressionBombWarning)] == []
