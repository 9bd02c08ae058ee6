"""`pbkv calibrate` failures that are the machine's or the command line's, not bugs: one line,
exit 2, checked before anything is timed (a model with too few positions for --max-len, a
temporary folder that cannot take the disk-read test files), and no temporary folder left."""

from __future__ import annotations

import tempfile

import pytest
from safetensors import SafetensorError

import pbkv.engine.hf.calibrate
from helpers import flat, invoke


@pytest.fixture
def no_timing(monkeypatch):
    def never(*_a, **_k):
        raise AssertionError("measured before the failure was found")
    monkeypatch.setattr(pbkv.engine.hf.calibrate, "forward", never)


def test_max_len_past_the_models_positions_is_refused_before_measuring(tmp_path, no_timing):
    r = invoke("calibrate", "--model", "tiny", "-o", tmp_path / "p.json", "--max-len", 8190, "--repeats", 1)
    assert r.exit_code == 2, r.output
    assert ("--max-len 8190: the model tiny has 8192 positions (max_position_embeddings) and calibrate decodes 4 "
            "tokens past --max-len: give --max-len 8188 or less") in flat(r.output)
    assert "Traceback" not in r.output and not (tmp_path / "p.json").exists()


def test_a_full_temporary_folder_is_one_line_naming_it(tmp_path, monkeypatch, no_timing):
    def full(*_a, **_k):
        raise SafetensorError("Error while serializing: I/O error: File too large (os error 27)")
    monkeypatch.setattr(pbkv.engine.hf.calibrate, "save_file", full)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    r = invoke("calibrate", "--model", "tiny", "-o", tmp_path / "p.json", "--max-len", 32, "--repeats", 1)
    assert r.exit_code == 2, r.output
    out = flat(r.output)
    assert "calibrate: cannot write its disk-read test files" in out and "File too large" in out
    assert f"in the temporary folder {tmp_path / 'tmp'}/pbkv-calibrate-" in out and "Traceback" not in r.output
    assert list((tmp_path / "tmp").iterdir()) == []  # the temporary folder is removed


def test_a_missing_temporary_folder_is_one_line(tmp_path, monkeypatch, no_timing):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "gone"))
    r = invoke("calibrate", "--model", "tiny", "-o", tmp_path / "p.json", "--max-len", 32, "--repeats", 1)
    assert r.exit_code == 2, r.output
    assert "calibrate: cannot make a temporary folder for its disk-read test files (set by $TMPDIR)" in flat(r.output)
    assert str(tmp_path / "gone") in flat(r.output)
