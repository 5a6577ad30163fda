"""`depthcurse select`: which layers a calibration text, an objective and a search choose, judged on
the same held-out measurements (`grid`), their overlap and decomposition (`statistics`), and how the
results are shown (`report`)."""

from depthcurse.select.grid import OBJECTIVES, SEARCHES, SELECT_JSON, SelectConfig, run_select
from depthcurse.select.report import plot_select, select_table, select_verdicts, write_csv

__all__ = ["OBJECTIVES", "SEARCHES", "SELECT_JSON", "SelectConfig", "run_select", "plot_select", "select_table", "select_verdicts", "write_csv"]
