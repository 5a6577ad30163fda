"""depthcurse's C++ kernels for the CPU, compiled on first use for the CPU they run on.

A kernel is a C++ source beside its Python module (`few_row_linear.cpp`, `vocab_scores.cpp`). It is
compiled (`-O3 -march=native`; OpenMP, whose runtime is torch's own, loaded before it) into the
cache (`$DEPTHCURSE_CACHE/kernels`) under a name made of its source, the compile command and the
CPU, so a cache shared by machines never hands one another's build; ranks compiling at once each
compile into a folder of their own beside the target and swap the file in whole. A kernel is used
only after it equals torch on a test of its own (`prepare`); where no compiler works, the build
will not load or the test fails, the caller's torch path is used, and the words `prepare` gives say
why, for the records. Each kernel has a switch in the environment that keeps torch's path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from depthcurse.assets.cache import cache_dir
from depthcurse.io import cpu_fields, cpu_model

FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
COMPILE_SECONDS = 300
# Below this much work (weights or logits read) a kernel runs on the calling thread, as torch's own
# parallel loops do (ATen's GRAIN_SIZE): OpenMP's threads cost more than they save there.
GRAIN = 32768
_forked = False  # this process was forked from one that may have run OpenMP's threads


def _after_fork_in_child() -> None:
    global _forked
    _forked = True


# GNU OpenMP is not fork-safe: a child forked after its parent's threads ran hangs in its next
# parallel region of more than one thread, so a forked child runs the kernels on its one thread.
# (torch's own parallel operators in such a child may still hang: a log-softmax did here.)
os.register_at_fork(after_in_child=_after_fork_in_child)


class Kernel(NamedTuple):
    """The loaded library, or None, and what is used, in words (the records say it)."""

    library: ctypes.CDLL | None
    words: str


def threads_for(work: int) -> int:
    """The threads a kernel call of `work` (see `GRAIN`) runs on: torch's, or 1 below the grain and
    in a forked child."""
    return 1 if work < GRAIN or _forked else torch.get_num_threads()


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def build_name(source: Path, text: str, command: list[str]) -> str:
    """The library's file name, after its source file's: another source text, compile command or CPU
    (its model and its instruction sets: x86's flags, ARM's features) is another file."""
    fields = cpu_fields()
    flags = fields.get("flags") or fields.get("Features") or platform.processor()
    key = "\n".join([text, " ".join(command), platform.machine(), cpu_model(), flags])
    return f"{source.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"


def build(source: Path, folder: Path | None = None) -> Path:
    """The compiled library of `source` for this CPU, compiled now unless the cache has it;
    RuntimeError with the compiler's first line of complaint where it cannot be."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (c++, g++ or clang++ on PATH, or CXX)")
    folder = folder or cache_dir() / "kernels"
    target = folder / build_name(source, source.read_text(), [cxx, *FLAGS])
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:  # beside the target: a rank compiling at once never reads half a file
        built = Path(tmp) / target.name
        try:
            done = subprocess.run([cxx, *FLAGS, "-o", str(built), str(source)], capture_output=True, text=True, timeout=COMPILE_SECONDS)
        except OSError as e:  # CXX names no program, or one that cannot run
            raise RuntimeError(f"{cxx} cannot be run ({e.strerror or e})") from e
        if done.returncode != 0:
            said = (done.stderr.strip() or done.stdout.strip() or f"exit {done.returncode}").splitlines()[0]
            raise RuntimeError(f"{Path(cxx).name} failed: {said}")
        os.replace(built, target)
    return target


def prepare(source: Path, switch: str, name: str, torchs: str, used: str,
            bind: Callable[[ctypes.CDLL], None], self_test: Callable[[ctypes.CDLL], str | None]) -> Kernel:
    """The kernel of `source`, built or found, loaded (`bind` sets its functions' argument types) and
    tested (`self_test`: why it cannot be used, or None), with the words for what is used: `used`, or
    `torchs` (torch's path) and why, where the environment's `switch` is 0 or the kernel (`name`)
    could not be built, loaded or trusted."""
    if os.environ.get(switch) == "0":
        return Kernel(None, f"{torchs}: {switch}=0")
    try:
        library = ctypes.CDLL(str(build(source)))
        bind(library)
    except (RuntimeError, OSError, subprocess.TimeoutExpired, AttributeError) as e:  # OSError: it would not load; AttributeError: a function missing
        return Kernel(None, f"{torchs}: the {name} could not be built or loaded ({e})")
    why = self_test(library)
    if why is not None:
        return Kernel(None, f"{torchs}: the {name} was built but {why}")
    return Kernel(library, used)
