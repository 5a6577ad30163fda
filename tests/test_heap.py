"""Freed memory kept in the process (`depthcurse.heap`, issue 89): both of glibc's thresholds raised
when a command starts, and told apart from the C library's own wherever it is not done."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from depthcurse import heap

pytestmark = pytest.mark.statistics  # pure: mutmut runs these (Makefile, mutate-statistics)


class FakeLibc:
    """glibc's mallopt as a record of what was asked: 1 (done) or `answer`."""

    def __init__(self, answer: int = 1):
        self.asked, self.answer = [], answer

    def mallopt(self, param: int, value: int) -> int:
        self.asked.append((param, value))
        return self.answer


def test_both_thresholds_are_raised_to_one_gib_and_the_record_says_so(monkeypatch):
    monkeypatch.delenv("DEPTHCURSE_KEEP_FREED", raising=False)
    monkeypatch.setattr(heap, "HEAP", "unset")
    libc = FakeLibc()
    said = heap.keep_freed_memory(libc)
    # mallopt's M_MMAP_THRESHOLD is -3 and M_TRIM_THRESHOLD -1 (malloc.h); 2**30 bytes each
    assert libc.asked == [(-3, 1073741824), (-1, 1073741824)]
    assert said == heap.HEAP == "freed blocks of up to 1 GiB kept for reuse (glibc's mmap and trim thresholds raised)"


def test_told_not_to_or_refused_or_not_glibc_the_c_library_keeps_its_own(monkeypatch):
    monkeypatch.setattr(heap, "HEAP", "unset")
    monkeypatch.setenv("DEPTHCURSE_KEEP_FREED", "0")
    libc = FakeLibc()
    assert heap.keep_freed_memory(libc) == heap.HEAP == "the C library's own (DEPTHCURSE_KEEP_FREED=0)" and libc.asked == []
    monkeypatch.setenv("DEPTHCURSE_KEEP_FREED", "1")  # anything but 0 keeps
    assert heap.keep_freed_memory(FakeLibc()).startswith("freed blocks")
    refusing = FakeLibc(answer=0)
    assert heap.keep_freed_memory(refusing) == "the C library's own (glibc refused the thresholds)"
    assert refusing.asked == [(-3, 1 << 30)]  # the trim threshold alone would change nothing: not asked
    monkeypatch.setattr(heap.platform, "libc_ver", lambda: ("musl", "1.2"))
    assert heap.glibc() is None and heap.keep_freed_memory() == "the C library's own (not glibc)"
    monkeypatch.setattr(heap.platform, "system", lambda: "Darwin")
    monkeypatch.setattr(heap.platform, "libc_ver", lambda: ("glibc", "2.36"))
    assert heap.glibc() is None


def test_glibc_is_found_by_name_and_asked_when_no_library_is_given(monkeypatch):
    """On Linux with glibc: the C library find_library names, or libc.so.6 where it names none; a
    library that will not load is no glibc; `keep_freed_memory()` asks the one found."""
    monkeypatch.delenv("DEPTHCURSE_KEEP_FREED", raising=False)
    monkeypatch.setattr(heap.platform, "system", lambda: "Linux")
    monkeypatch.setattr(heap.platform, "libc_ver", lambda: ("glibc", "2.36"))
    loaded, asked_for = [], []
    fake = FakeLibc()
    monkeypatch.setattr(heap.ctypes, "CDLL", lambda name: loaded.append(name) or fake)
    monkeypatch.setattr(heap.ctypes.util, "find_library", lambda name: asked_for.append(name) or "libc.so.6.named")
    assert heap.glibc() is fake and loaded == ["libc.so.6.named"] and asked_for == ["c"]
    monkeypatch.setattr(heap.ctypes.util, "find_library", lambda name: None)
    assert heap.glibc() is fake and loaded[-1] == "libc.so.6"
    assert heap.keep_freed_memory().startswith("freed blocks") and fake.asked == [(-3, 1 << 30), (-1, 1 << 30)]

    def unloadable(name):
        raise OSError(name)

    monkeypatch.setattr(heap.ctypes, "CDLL", unloadable)
    assert heap.glibc() is None


def test_this_linux_machines_glibc_is_the_one_found():
    """Where the suite runs on Linux with glibc, `glibc()` loads it: its own mallopt."""
    if heap.platform.system() != "Linux" or heap.platform.libc_ver()[0] != "glibc":
        pytest.skip("not Linux with glibc")
    assert hasattr(heap.glibc(), "mallopt")


MAPPED = """
import ctypes, json, sys
import torch
from depthcurse import heap
if sys.argv[1] == "keep":
    heap.keep_freed_memory()

class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Mallinfo2
block = torch.empty(64 << 20, dtype=torch.uint8)  # 64 MiB, above glibc's own threshold (at most 32 MiB)
mapped = libc.mallinfo2().hblkhd
del block
heap_after_free = libc.mallinfo2().arena
print(json.dumps({"mapped": mapped, "heap_after_free": heap_after_free, "said": heap.HEAP}))
"""


@pytest.mark.skipif(heap.glibc() is None or not hasattr(heap.glibc(), "mallinfo2"), reason="glibc 2.33 or later's mallinfo2 reads the heap")
def test_glibc_puts_a_large_tensor_in_the_heap_and_keeps_it_when_freed():
    """Independent of our words: glibc's own count of its mappings and of its heap, in fresh processes
    (the thresholds are the process's)."""
    got = {mode: json.loads(subprocess.run([sys.executable, "-c", MAPPED, mode], capture_output=True, text=True, check=True).stdout)
           for mode in ("own", "keep")}
    assert got["own"]["mapped"] >= 64 << 20  # its own mapping, unmapped when freed
    assert got["keep"]["mapped"] < 64 << 20 and got["keep"]["heap_after_free"] >= 64 << 20  # in the heap, kept after the free
    assert got["keep"]["said"].startswith("freed blocks") and got["own"]["said"].startswith("the C library's own (depthcurse did not set it)")


def test_every_command_keeps_freed_memory_and_its_record_says_so(monkeypatch):
    """The CLI's callback raises the thresholds before any command's work; `environment()` keeps the words."""
    from typer.testing import CliRunner

    from depthcurse.cli import app
    from depthcurse.io import environment

    monkeypatch.delenv("DEPTHCURSE_KEEP_FREED", raising=False)
    monkeypatch.setattr(heap, "HEAP", "unset")
    called = []
    monkeypatch.setattr(heap, "keep_freed_memory", lambda: called.append(True))
    assert CliRunner().invoke(app, ["settings"]).exit_code == 0 and called == [True]
    monkeypatch.setattr(heap, "HEAP", "the words")
    assert environment()["heap"] == "the words"
