"""The benchmarks' own bookkeeping: a child run that fails is reported by why it failed."""

from __future__ import annotations

import sys

from helpers import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
from peak_memory import error_line  # noqa: E402


def test_a_failed_child_is_reported_by_its_cause():
    # measured on the H100: a CUDA-graphs step raised, then warnings came at exit; another died of a segfault
    traceback = "Traceback (most recent call last):\n  File \"x.py\", line 1\nRuntimeError: Error: accessing tensor output of CUDAGraphs\n" \
                "/x/graph.py:869: UserWarning: done\n  warnings.warn(\n"
    assert error_line(traceback, 1) == "RuntimeError: Error: accessing tensor output of CUDAGraphs"
    assert error_line("UserWarning: w\n  warnings.warn(\n", -11) == "killed by SIGSEGV"
    assert error_line("torch.OutOfMemoryError: CUDA out of memory.\n", 1) == "torch.OutOfMemoryError: CUDA out of memory."
    assert error_line("no exception here\n", 3) == "no exception here"
    assert error_line("", 2) == "exit status 2"


def test_the_benchmarks_table_names_every_script_and_each_result_it_points_to_exists():
    table = [line.split(" | ") for line in (ROOT / "benchmarks" / "README.md").read_text().splitlines() if line.startswith("| `")]
    named = {cells[0].strip("| `") for cells in table}
    on_disk = {str(p.relative_to(ROOT / "benchmarks")) for p in (ROOT / "benchmarks").rglob("*") if p.suffix in (".py", ".sh")}
    assert named == on_disk, f"benchmarks/README.md lacks {sorted(on_disk - named)} and names missing {sorted(named - on_disk)}"
    for cells in table:
        doc, _, heading = cells[2].strip(" |").partition("#")
        headings = [line.lstrip("#").strip() for line in (ROOT / doc).read_text().splitlines() if line.startswith("#")]
        assert any(h.startswith(heading) for h in headings), f"{cells[0]}: no heading '{heading}' in {doc}"
