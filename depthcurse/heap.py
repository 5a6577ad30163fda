"""Freed memory kept for the next tensor of its size, where the C library would hand it back.

glibc gives a block above its mmap threshold (128 KiB, rising by itself to at most 32 MiB) a mapping
of its own and unmaps it when it is freed, and trims the heap's top back to the kernel beyond 128 KiB.
So on a CPU every large tensor a loop makes again, of the same size each time, is fresh pages: the
kernel faults in and zeroes each 4 KiB page before the first write. The vocabulary's tensors are
such blocks (SmolLM2-135M's log-probs over 252 positions in fp32: 49.5 MB), and those faults were
most of their elementwise work: the KL's product with p took 17.4 ms where the same product into
kept memory takes 7.8, an exp 15.5 ms against 2.5 (docs/benchmarks.md, "Freed memory kept").

`keep_freed_memory` raises both thresholds once, when a command starts, so freed blocks stay in the
process and the next tensor of their size reuses them: select's, depth-use's and the sweep's CPU
work took 0.81-0.88x the time. The price is the free blocks no later tensor fits in: the resident
peak was 11-38% higher on those jobs; what is kept is given back when the process exits.
`DEPTHCURSE_KEEP_FREED=0` leaves the C library's own thresholds. Elsewhere than glibc (macOS, musl,
Windows) nothing is changed: their allocators keep freed blocks by their own rules."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

# mallopt's parameters (malloc.h) and the value both get: above any one tensor these jobs make
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
KEPT_BYTES = 1 << 30

# What this process's heap does with freed blocks, in words: every record's environment says it
HEAP = "the C library's own (depthcurse did not set it)"


def glibc():
    """This process's glibc, or None where the C library is another (its mallopt is not glibc's)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def keep_freed_memory(libc=None) -> str:
    """Keep freed blocks of up to `KEPT_BYTES` in this process (both thresholds: raised alone, the
    mmap threshold moves the blocks into the heap, whose top is then trimmed back to the kernel as
    before); what was done, in words, kept in `HEAP` for the record."""
    global HEAP
    HEAP = _keep(libc)
    return HEAP


def _keep(libc) -> str:
    if os.environ.get("DEPTHCURSE_KEEP_FREED") == "0":
        return "the C library's own (DEPTHCURSE_KEEP_FREED=0)"
    libc = glibc() if libc is None else libc
    if libc is None:
        return "the C library's own (not glibc)"
    if not (libc.mallopt(M_MMAP_THRESHOLD, KEPT_BYTES) and libc.mallopt(M_TRIM_THRESHOLD, KEPT_BYTES)):
        return "the C library's own (glibc refused the thresholds)"
    return f"freed blocks of up to {KEPT_BYTES >> 30} GiB kept for reuse (glibc's mmap and trim thresholds raised)"
