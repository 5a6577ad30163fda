"""How much of a grid's spread goes with its rows and how much with its columns.

A two-way layout without replication (one score per row x column cell: a calibration text x a
search) splits its total sum of squares about the grand mean into the rows' part
(C * sum over rows of (row mean - grand)^2, C the number of columns), the columns' part
(R * sum over columns of (column mean - grand)^2) and the rest (their interaction). Each part's
share of the total says which factor the spread goes with; `decided_by` names one only where
the two shares' intervals are apart.
"""

from __future__ import annotations

import numpy as np

ROWS, COLUMNS, REST = "rows", "columns", "rest"


def shares(y: np.ndarray) -> dict[str, np.ndarray]:
    """The shares of the total sum of squares of `y` (rows x columns, or rows x columns x draws:
    one grid per draw) that go with the rows, the columns and the rest; NaN where a grid has no
    spread at all."""
    y = np.asarray(y, dtype=float)
    if y.ndim == 2:
        return {k: float(v[0]) for k, v in shares(y[..., None]).items()}
    r, c = y.shape[:2]
    grand = y.mean(axis=(0, 1))
    total = ((y - grand) ** 2).sum(axis=(0, 1))
    ss_rows = c * ((y.mean(axis=1) - grand) ** 2).sum(axis=0)
    ss_columns = r * ((y.mean(axis=0) - grand) ** 2).sum(axis=0)
    spread = total > 0
    safe = np.where(spread, total, 1.0)  # a grid with no spread has no shares (NaN), and no 0 / 0 on the way
    row_share = np.where(spread, ss_rows / safe, np.nan)
    column_share = np.where(spread, ss_columns / safe, np.nan)
    rest = np.maximum(0.0, 1 - row_share - column_share)  # NaN stays NaN
    return {ROWS: row_share, COLUMNS: column_share, REST: rest}


def decided_by(intervals: dict[str, list[float] | None], why_not: str | None = None) -> str:
    """Which factor the spread goes with, said only where the two shares' intervals are apart."""
    if why_not:
        return f"cannot tell ({why_not})"
    row, column = intervals.get(ROWS), intervals.get(COLUMNS)
    if row is None or column is None:
        return "cannot tell (too few resamples defined the shares)"
    if row[0] > column[1]:
        return ROWS
    if column[0] > row[1]:
        return COLUMNS
    return "cannot tell apart (the 95% intervals of the two shares overlap)"
