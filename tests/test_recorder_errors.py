"""`--record` when the disk fails it: a run that cannot be written is dropped whole (logged,
counted), the file stays a valid trace of whole runs, and serving goes on."""

import errno
import shutil

import httpx

from serve_helpers import start_server, torch_threads  # noqa: F401

from pbkv.serve import recorder as recorder_mod
from pbkv.serve.recorder import TraceRecorder
from pbkv.trace import Call, read_trace


def run(n: int, steps: int = 3) -> list[Call]:
    return [Call(f"w{n}", s, "a", 16 * (s + 1), 2, list(range(n * 100, n * 100 + s + 1))) for s in range(steps)]


def test_a_run_cut_by_a_full_disk_is_dropped_and_the_file_stays_whole(tmp_path, monkeypatch):
    rec = TraceRecorder(tmp_path, "s", 16, "tiny")
    assert rec.record(run(0))
    real = recorder_mod._write_all

    def half_then_full(fh, data):   # the disk fills in the middle of the run's lines
        real(fh, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(recorder_mod, "_write_all", half_then_full)
    assert not rec.record(run(1))
    monkeypatch.undo()
    assert rec.record(run(2))                        # space again: appended after run 0, not after half of run 1
    rec.close()
    trace = read_trace(rec.files[0])
    assert [c.workflow_id for c in trace.calls] == ["w0"] * 3 + ["w2"] * 3 and len(rec.files) == 1


def test_a_removed_record_folder_is_made_again_and_an_unwritable_one_only_drops_runs(tmp_path):
    folder = tmp_path / "rec"
    rec = TraceRecorder(folder, "s", 16, "tiny", rotate_calls=3)
    assert rec.record(run(0))
    shutil.rmtree(folder)
    assert rec.record(run(1))                        # rotation opens a new file: the folder is made again
    shutil.rmtree(folder)
    folder.write_text("not a folder")                # now it cannot be
    assert not rec.record(run(2))
    folder.unlink()
    assert rec.record(run(3))
    rec.close()
    assert [c.workflow_id for c in read_trace(rec.files[-1]).calls] == ["w3"] * 3


def test_the_server_serves_on_when_its_record_folder_cannot_be_written(torch_threads, tmp_path):  # noqa: F811
    folder = tmp_path / "rec"
    server = start_server(record=str(folder), record_rotate=1)   # every run opens a new file
    try:
        def ask(i):
            return httpx.post(server.url + "/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": f"call {i}", "max_tokens": 2, "workflow_id": f"w{i}", "agent": "a",
                "workflow_done": True})
        assert ask(0).status_code == 200
        shutil.rmtree(folder)
        folder.write_text("in the way")
        assert [ask(i).status_code for i in (1, 2)] == [200, 200]
        assert "pbkv_record_errors_total 2.0" in httpx.get(server.url + "/metrics").text
        folder.unlink()
        assert ask(3).status_code == 200
        assert "pbkv_record_errors_total 2.0" in httpx.get(server.url + "/metrics").text
    finally:
        server.stop()
    assert [len(read_trace(f).calls) for f in folder.glob("*.jsonl")] == [1]   # run 3's, a valid trace
