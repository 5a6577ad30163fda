"""Files on disk: the one atomic writer, results folders, CSV/JSON/PNG, run identity, the environment.

Everything depthcurse writes goes through `atomic_write`, so a reader (or a crash, a Ctrl-C, a
preemption) never sees half a file or half a folder: results tables, sweep batches, training
checkpoints, fine-tuning states and offline-cache entries alike.
"""

from __future__ import annotations

import contextlib
import csv
import functools
import io
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

from depthcurse import heap
from depthcurse.errors import DepthcurseError

PACKAGES = ("depthcurse", "torch", "transformers", "lm_eval", "peft", "datasets", "accelerate", "safetensors")
STALE_AFTER_S = 6 * 3600  # a temporary folder this old was left by a killed writer


def atomic_write(path: Path, content: str | bytes | Callable[[Path], object], *, folder: bool = False) -> Path:
    """Write `path` whole or not at all: into a temporary name beside it, then rename.

    `content` is text, bytes, or a function that writes a file at the path it is given
    (`lambda tmp: torch.save(state, tmp)`); with `folder=True` the function gets an empty
    folder to fill, and an existing folder at `path` is replaced in one swap. If anything
    fails, the temporary copy is removed and `path` keeps its previous content. A file system
    that refuses the write (read-only, full, no permission) is one clear error naming `path`.
    """
    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        if folder:
            _remove_stale(path)
            tmp.mkdir()
        if isinstance(content, str):
            tmp.write_text(content, encoding="utf-8")
        elif isinstance(content, bytes):
            tmp.write_bytes(content)
        else:
            content(tmp)
        if folder and path.exists():
            # A folder cannot be renamed over another: move the old one aside, then drop it.
            old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except OSError as exc:
        _remove(tmp)
        failed = Path(exc.filename).resolve() if exc.filename is not None else None
        if failed is not None and path.parent.resolve() not in (failed, *failed.parents):
            raise  # not the write failing: the writer reading something elsewhere
        raise DepthcurseError(f"cannot write {path}: {exc.strerror or exc}") from exc
    except BaseException:
        _remove(tmp)
        raise
    return path


def previous_folder(path: Path) -> Path | None:
    """The copy `atomic_write(..., folder=True)` moved aside, if a crash came between its two renames."""
    path = Path(path)
    olds = sorted(path.parent.glob(f".{path.name}.old-*"), key=lambda p: p.stat().st_mtime)
    return olds[-1] if olds else None


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _remove_stale(path: Path) -> None:
    """Temporary folders that killed writers of `path` left behind, hours old."""
    now = time.time()
    for pattern in (f".{path.name}.tmp-*", f".{path.name}.old-*"):
        for stale in path.parent.glob(pattern):
            try:
                if now - stale.stat().st_mtime > STALE_AFTER_S:
                    _remove(stale)
            except OSError:
                pass


# Folders `ensure_out_dir` created while a command runs (`removing_empty_on_failure`), else None.
_created: list[Path] | None = None


def ensure_out_dir(path: Path, what: str = "--out") -> Path:
    """A folder that exists and can be written to, or one clear error about `what` it is."""
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise DepthcurseError(f"{what} {path} is a file, not a folder")
    if _created is not None:
        _created.extend(p for p in (path, *path.parents) if not p.exists())
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-", delete=True)
        probe.close()
    except OSError as exc:
        raise DepthcurseError(f"{what} {path} is not writable: {exc.strerror or exc}") from exc
    return path


LOCK_FILE = ".depthcurse-lock"
# The folders this process holds (`claim_out_dir`), each with its open lock file.
_claims: dict[Path, object] = {}


def claim_out_dir(path: Path, what: str = "--out") -> Path:
    """`ensure_out_dir`, and the folder this process's alone until it ends (`release_claims`): a
    second run writing the same results folder at once would overwrite the first's files with its
    own, so it is refused in one line that names the process holding it. The lock is the kernel's
    (flock on `LOCK_FILE`): it goes with the process, so a crashed run leaves none behind. Under
    torchrun only rank 0 takes it (the ranks of one run share their folder)."""
    import fcntl  # lazy: POSIX only, where the lock is taken

    if os.environ.get("RANK", "0") != "0":
        return _sibling_folder(Path(path).expanduser(), what)
    path = ensure_out_dir(path, what)
    key = path.resolve()
    if key in _claims:
        return path
    handle = open(path / LOCK_FILE, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise DepthcurseError(f"{what} {path} is being written by another run ({holder}): wait for it to end, or give another {what}") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(sys.argv)[:200]}")
    handle.flush()
    _claims[key] = handle
    return path


# How long a torchrun rank other than 0 waits for rank 0 to make the results folder.
SIBLING_WAIT_S = 120.0


def _sibling_folder(path: Path, what: str, *, clock=time.monotonic, sleep=time.sleep) -> Path:
    """The folder rank 0 claims, as another rank of its run sees it: rank 0 alone makes it, so that
    a run failing at once removes it again (the rank that made an empty folder is the one that
    removes it, and only rank 0 knows when its lock has gone). Waits for it, then, past
    `SIBLING_WAIT_S` (rank 0 held up or gone: torchrun stops this rank then), makes it itself."""
    deadline = clock() + SIBLING_WAIT_S
    while not path.is_dir() and clock() < deadline:
        # a file only if it is not a folder now: rank 0 may have made the folder since the check above
        if path.exists() and not path.is_dir():
            raise DepthcurseError(f"{what} {path} is a file, not a folder")
        sleep(0.05)
    return path if path.is_dir() else ensure_out_dir(path, what)


def release_claims() -> None:
    """Give up every folder `claim_out_dir` took (the lock files go too)."""
    for path, handle in list(_claims.items()):
        with contextlib.suppress(OSError):
            (path / LOCK_FILE).unlink()
        handle.close()
        del _claims[path]


@contextlib.contextmanager
def removing_empty_on_failure():
    """Run a command so that the folders `ensure_out_dir` creates for it are removed again, deepest
    first and only while empty, when it fails: a mistyped model leaves no empty
    `runs/prune/<typo>/ppl/` behind, and a folder anything was written to stays."""
    global _created
    _created = []
    try:
        yield
    except SystemExit as exc:
        if exc.code not in (0, None):
            release_claims()
            _remove_empty(_created)
        raise
    except BaseException:
        release_claims()
        _remove_empty(_created)
        raise
    finally:
        release_claims()
        _created = None


def _remove_empty(folders: list[Path]) -> None:
    for folder in sorted(set(folders), key=lambda p: len(p.parts), reverse=True):
        try:
            folder.rmdir()
        except OSError:
            pass  # not empty (kept), or gone


def finite(value):
    """JSON has no NaN or infinity: they become null, in nested dicts and lists too."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return value


def json_text(data) -> str:
    return json.dumps(finite(data), indent=2) + "\n"


def record_path(folder: Path, name: str) -> Path:
    """A results file: `folder`'s `name`, or `folder` itself where it is the file."""
    path = Path(folder)
    return path / name if path.is_dir() else path


def read_record(folder: Path, name: str, what: str, needs: tuple[str, ...] = (), shape: Callable[[dict], object] = lambda record: record):
    """A results file read back (`record_path`), with the keys `needs` names, one inside the other,
    made into what the caller keeps by `shape`; one line where it is not there, not JSON, or not of
    that shape: "FOLDER holds no WHAT (NAME): why"."""
    try:
        record = json.loads(record_path(folder, name).read_text())
        inner = record
        for key in needs:
            inner = inner[key]
        return shape(record)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DepthcurseError(f"{folder} holds no {what} ({name}): {exc}") from None


def csv_text(rows: list[dict], *, digits: int | None = 8, empty_header: list[str] | None = None) -> str:
    """Rows of dicts as CSV text: floats to `digits` significant digits (None: as Python prints
    them), None as an empty cell; the header is the first row's keys (or `empty_header`)."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]) if rows else list(empty_header or []), lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: ("" if v is None else (f"{v:.{digits}g}" if digits and isinstance(v, float) else v)) for k, v in row.items()})
    return buf.getvalue()


def save_figure(fig, path: Path) -> Path:
    """Render `fig` as PNG, write it atomically and free it."""
    import matplotlib.pyplot as plt  # lazy: only the figure writers need matplotlib (1 s to import)

    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return atomic_write(Path(path), buf.getvalue())


# What a record says about a run without being what it computed: why its dtype is what it is (the
# dtype itself is compared), so that a run of --dtype fp32 recorded before the reason was resumes.
NOT_SETTINGS = frozenset({"dtype_why"})


def changed_settings(saved: dict, current: dict, *, ignore=frozenset()) -> list[str]:
    """`name: old -> new` for every setting that differs between two runs' records."""
    keys = sorted((set(saved) | set(current)) - set(ignore) - NOT_SETTINGS)
    return [f"{k}: {_short(saved.get(k))} -> {_short(current.get(k))}" for k in keys if saved.get(k) != current.get(k)]


def _short(value, width: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def refuse_other_run(folder: Path, saved: dict, current: dict, *, ignore=frozenset(), what: str = "run") -> None:
    """The one identity check of every resumable job: a folder holding a different run is
    refused, never overwritten or mixed with this one."""
    differ = changed_settings(saved, current, ignore=ignore)
    if differ:
        shown = "; ".join(differ[:4]) + ("; ..." if len(differ) > 4 else "")
        raise DepthcurseError(f"{folder} holds a different {what} (differs in: {shown}); choose another --out or delete it")


def environment() -> dict:
    """What a reviewer needs to rerun a result, saved with every one: the command as typed, the code
    (its version, and its git commit and whether the tree had changes, where it runs from a checkout),
    Python, the platform, the CPU's model and the GPUs, the package versions and torch's threads."""
    import torch  # lazy: the CLI imports this module at start-up, and torch takes seconds

    fixed = _this_process()
    env = {"command": command_line(), **{k: v for k, v in fixed.items() if k != "packages"}, "packages": dict(fixed["packages"]),
           "torch_threads": torch.get_num_threads(), "heap": heap.HEAP}
    if torch.cuda.is_available():
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return env


@functools.lru_cache(maxsize=1)
def _this_process() -> dict:
    """What cannot change while this process runs, read once: a sweep saves its record after every
    batch, and the commit (two git calls), the CPU and the versions are the same each time."""
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {**code_version(), "python": platform.python_version(), "platform": platform.platform(), "cpu": cpu_model(), "packages": versions}


def command_line(argv: list[str] | None = None) -> str:
    """The command as typed, quoted as a shell reads it (`depthcurse ...`, whatever the entry point's path)."""
    import shlex

    argv = sys.argv if argv is None else argv
    head = "depthcurse" if Path(argv[0]).name in ("depthcurse", "__main__.py", "-m") else Path(argv[0]).name
    return shlex.join([head, *argv[1:]])


def code_version(root: Path | None = None) -> dict:
    """The git commit of the checkout the package runs from and whether its tracked files had changes
    (None for both where it is not a checkout, as when installed from a wheel)."""
    import subprocess

    root = Path(__file__).resolve().parent.parent if root is None else root
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    if commit.returncode != 0 or not (root / ".git").exists():
        return {"commit": None, "dirty": None}
    return {"commit": commit.stdout.strip(), "dirty": bool(status.stdout.strip())}


def cpu_fields(cpuinfo: str | None = None) -> dict[str, str]:
    """The first processor's fields as the kernel gives them (/proc/cpuinfo; none where it cannot be read)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    fields = {}
    for line in cpuinfo.split("\n\n")[0].splitlines():  # the first processor's block
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU's model name as the kernel gives it (lscpu's "Model name"), with its family and model
    numbers where given (a virtual machine's name can be as bare as "Intel Xeon Processor"), else
    what the platform says."""
    fields = cpu_fields(cpuinfo)
    name = fields.get("model name") or fields.get("Processor")
    if not name:
        return platform.processor() or platform.machine()
    numbers = ", ".join(f"{k} {fields[k]}" for k in ("cpu family", "model") if fields.get(k))
    return f"{name} ({numbers})" if numbers else name
