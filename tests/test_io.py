"""The one atomic writer, results folders and the run-identity check that every job shares."""

from __future__ import annotations

import errno
import os

import pytest

from depthcurse.errors import DepthcurseError, one_line
from depthcurse.io import atomic_write, ensure_out_dir, previous_folder, refuse_other_run


def test_a_file_is_written_whole_or_not_at_all(tmp_path):
    path = tmp_path / "result.json"
    atomic_write(path, "first\n")
    with pytest.raises(RuntimeError):
        atomic_write(path, lambda tmp: (tmp.write_text("half"), (_ for _ in ()).throw(RuntimeError("killed"))))
    assert path.read_text() == "first\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.json"]  # no temporary file left
    atomic_write(path, b"\x00bytes")
    assert path.read_bytes() == b"\x00bytes"


def test_a_folder_is_swapped_in_whole(tmp_path):
    dest = tmp_path / "state"

    def fill(text):
        return lambda folder: (folder / "a.txt").write_text(text)

    atomic_write(dest, fill("one"), folder=True)
    atomic_write(dest, fill("two"), folder=True)
    assert (dest / "a.txt").read_text() == "two"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state"]
    assert previous_folder(dest) is None


def test_a_refused_write_is_one_clear_line_naming_the_file(tmp_path, monkeypatch):
    path = tmp_path / "prune.png"

    def read_only(src, dst):
        raise OSError(errno.EROFS, "Read-only file system", str(src))

    monkeypatch.setattr(os, "replace", read_only)
    with pytest.raises(DepthcurseError, match=rf"^cannot write {path}: Read-only file system$"):
        atomic_write(path, b"png")
    assert list(tmp_path.iterdir()) == []


def test_results_folders(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(DepthcurseError, match="--out .*file is a file, not a folder"):
        ensure_out_dir(tmp_path / "file")
    with pytest.raises(DepthcurseError, match="--out .*file/sub is not writable"):
        ensure_out_dir(tmp_path / "file" / "sub")
    assert ensure_out_dir(tmp_path / "new" / "deeper").is_dir()


def test_a_read_only_folder_is_one_clear_line_about_what_it_is_for(tmp_path, monkeypatch):
    import tempfile

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", read_only)
    with pytest.raises(DepthcurseError, match=r"^the offline cache \(DEPTHCURSE_CACHE\) .* is not writable: Read-only file system$"):
        ensure_out_dir(tmp_path, what="the offline cache (DEPTHCURSE_CACHE)")


def test_a_folder_of_another_run_is_refused_with_what_differs(tmp_path):
    refuse_other_run(tmp_path, {"lr": 0.1, "every": 5}, {"lr": 0.1, "every": 10}, ignore={"every"})
    with pytest.raises(DepthcurseError, match=r"holds a different run \(differs in: lr: 0.1 -> 0.2\)"):
        refuse_other_run(tmp_path, {"lr": 0.1}, {"lr": 0.2})
    long = {"tasks": [f"mmlu_subject_{i}" for i in range(57)]}
    with pytest.raises(DepthcurseError) as caught:
        refuse_other_run(tmp_path, long, {"tasks": []})
    assert len(str(caught.value)) < 200  # a long value is shortened, the line stays readable


def test_an_unexpected_error_reads_as_one_line():
    import struct

    with pytest.raises(struct.error) as caught:
        struct.unpack_from("<I", b"")
    assert one_line(caught.value).startswith("struct.error: ")
    assert one_line(ValueError("first\nsecond")) == "ValueError: first"


def _held_by_another(folder):
    """The lock another run of depthcurse would hold on `folder`: a second open file description,
    which the kernel's flock tells apart from this process's own claims."""
    import fcntl

    folder.mkdir(parents=True, exist_ok=True)
    handle = open(folder / ".depthcurse-lock", "a+")
    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    handle.write("pid 4242, since 2026-11-27 10:00:00: depthcurse prune m --out x")
    handle.flush()
    return handle


def test_a_results_folder_is_one_runs_at_a_time(tmp_path):
    from depthcurse.io import LOCK_FILE, claim_out_dir, release_claims

    held = _held_by_another(tmp_path / "busy")
    with pytest.raises(DepthcurseError, match=r"--out .*busy is being written by another run \(pid 4242, since .*: depthcurse prune m --out x\)"):
        claim_out_dir(tmp_path / "busy")
    held.close()  # that run ended (or crashed: the kernel lets go of its lock either way)
    mine = claim_out_dir(tmp_path / "busy")
    assert f"pid {os.getpid()}" in (mine / LOCK_FILE).read_text() and claim_out_dir(tmp_path / "busy") == mine  # a second claim of one's own: fine
    release_claims()
    assert not (mine / LOCK_FILE).exists()


def test_only_rank_0_makes_the_results_folder_so_a_failed_run_removes_it(tmp_path, monkeypatch):
    """Under torchrun the other ranks wait for rank 0's folder: had one of them made it, rank 0's
    lock file would keep it from being removed when the run fails at once (CI saw that race)."""
    from depthcurse import io as dio

    monkeypatch.setenv("RANK", "1")
    now, naps = [0.0], []

    def sleep(seconds):  # rank 0 makes the folder while this rank sleeps its third nap
        naps.append(seconds)
        now[0] += seconds
        if len(naps) == 3:
            (tmp_path / "run").mkdir()

    got = dio._sibling_folder(tmp_path / "run", "--out", clock=lambda: now[0], sleep=sleep)
    assert got == tmp_path / "run" and len(naps) == 3 and not list(got.iterdir())  # no write probe, no lock
    monkeypatch.setattr(dio, "_created", [])
    late = dio._sibling_folder(tmp_path / "late", "--out", clock=lambda: now[0], sleep=sleep)  # rank 0 never came
    assert late.is_dir() and now[0] >= dio.SIBLING_WAIT_S and dio._created == [tmp_path / "late"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(DepthcurseError, match="is a file, not a folder"):
        dio.claim_out_dir(tmp_path / "file")
    racing = tmp_path / "racing"

    class MadeBetween(type(racing)):  # rank 0 makes the folder between this rank's two looks at it
        looks = 0

        def is_dir(self):
            MadeBetween.looks += 1
            if MadeBetween.looks == 2:
                racing.mkdir()
            return super().is_dir() and MadeBetween.looks > 2

    assert dio._sibling_folder(MadeBetween(racing), "--out", clock=lambda: now[0], sleep=sleep) == racing  # not "is a file" (a busy CI saw it)
    monkeypatch.setenv("RANK", "0")
    dio.claim_out_dir(tmp_path / "run")
    assert (tmp_path / "run" / dio.LOCK_FILE).exists()
    dio.release_claims()


@pytest.mark.parametrize("command", [
    ["prune", "{model}", "--task", "ppl"], ["heal", "{model}", "--layers", "1"], ["select", "{model}", "--k", "1"],
    ["angular-distance", "{model}"], ["lns-train", "--steps", "2"], ["speed", "{model}", "--layers", "1"]])
def test_every_command_that_writes_a_results_folder_refuses_one_in_use(run_cli, tiny_model_dir, tmp_path, command):
    from helpers import assert_one_line_error

    held = _held_by_another(tmp_path / "busy")
    try:
        args = [str(tiny_model_dir) if a == "{model}" else a for a in command]
        assert_one_line_error(*run_cli(*args, "--out", tmp_path / "busy"), "is being written by another run (pid 4242")
    finally:
        held.close()
    assert (tmp_path / "busy" / ".depthcurse-lock").read_text().startswith("pid 4242")  # the holder's lock left as it was


def test_what_a_reviewer_needs_to_rerun_a_result_is_in_every_environment(tmp_path, monkeypatch):
    """The command as typed (quoted as a shell reads it), the checkout's commit and whether its tracked
    files changed (none outside a checkout), the CPU's model with its numbers, and peft's version too
    (issue 90)."""
    import subprocess
    import sys

    from depthcurse.io import code_version, command_line, cpu_model, environment

    assert command_line(["/x/.venv/bin/depthcurse", "prune", "m", "--data", "my text.txt"]) == "depthcurse prune m --data 'my text.txt'"
    assert command_line(["/x/depthcurse/__main__.py", "select", "m"]) == "depthcurse select m"
    assert command_line(["script.py", "--k", "4"]) == "script.py --k 4"
    monkeypatch.setattr(sys, "argv", ["depthcurse", "speed", "m"])
    env = environment()
    assert env["command"] == "depthcurse speed m" and "peft" in env["packages"] and env["cpu"] and {"commit", "dirty"} <= set(env)
    assert code_version(tmp_path) == {"commit": None, "dirty": None}  # not a checkout (a wheel's install)
    git = lambda *a: subprocess.run(["git", "-C", str(tmp_path), *a], check=True, capture_output=True)  # noqa: E731
    git("init", "-q")
    (tmp_path / "f").write_text("a")
    git("add", "f")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert code_version(tmp_path) == {"commit": head, "dirty": False}
    (tmp_path / "f").write_text("b")
    assert code_version(tmp_path) == {"commit": head, "dirty": True}
    info = "processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 207\nmodel name\t: Intel(R) Xeon(R) Processor\n\nprocessor\t: 1\nmodel name\t: other\n"
    assert cpu_model(info) == "Intel(R) Xeon(R) Processor (cpu family 6, model 207)"
    assert cpu_model("Processor\t: ARMv8 rev 1 (v8l)\n") == "ARMv8 rev 1 (v8l)" and cpu_model("") != ""
