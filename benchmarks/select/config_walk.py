"""How often following `select`'s config through the code enters `select/grid.py` (issue 72: a grid
that is one room, not a hub). A pytest plugin: every call in depthcurse that is handed a
`SelectConfig` is recorded in order, by file; an entry is a call in grid.py whose caller-side
predecessor in that walk was in another file. Counted per `run_select`.

    PYTHONPATH=benchmarks python -m pytest -p config_walk -q tests/test_select.py::test_select_on_the_command_line_and_its_bad_input

prints, after the test, the entries of each `run_select` call and the walk itself (one line per
change of file).
"""

from __future__ import annotations

import sys

import pytest

_walk: list[str] = []


def _profile(frame, event, arg):
    if event != "call" or "/depthcurse/" not in frame.f_code.co_filename:
        return
    from depthcurse.select.config import SelectConfig

    if any(isinstance(v, SelectConfig) for v in frame.f_locals.values()):
        _walk.append(frame.f_code.co_filename.split("/depthcurse/")[1] + ":" + frame.f_code.co_name)


def entries_per_run(walk: list[str]) -> list[int]:
    """The entries into grid.py of each run_select call in `walk` (its own call counted)."""
    runs: list[int] = []
    previous = None
    for step in walk:
        file = step.split(":")[0]
        if step == "select/grid.py:run_select":
            runs.append(0)
        if runs and file == "select/grid.py" and previous != "select/grid.py":
            runs[-1] += 1
        previous = file
    return runs


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    sys.setprofile(_profile)
    try:
        yield
    finally:
        sys.setprofile(None)
    changes = [s for i, s in enumerate(_walk) if i == 0 or s.split(":")[0] != _walk[i - 1].split(":")[0]]
    print(f"\n{item.nodeid}: grid.py entered {entries_per_run(_walk)} times per run_select\n  " + "\n  ".join(changes))
    _walk.clear()
