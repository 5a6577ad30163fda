"""`depthcurse select`: which units a calibration text, an objective and a search remove, judged on
the same held-out measurements (`grid`), the searches behind their contract and registry
(`search`, `searches/`), the calibration scores they share (`scoring`), the overlap, decomposition
and distances from the best (`statistics`), and how the results are shown (`report`)."""

from depthcurse.select.grid import OBJECTIVES, SELECT_JSON, SelectConfig, run_select
from depthcurse.select.report import plot_distances, plot_select, select_table, select_verdicts, distance_table, write_csv
from depthcurse.select.search import GRANULARITIES, Search, SearchContext, Space, find_search, parse_search_args, search_names

__all__ = ["OBJECTIVES", "SELECT_JSON", "SelectConfig", "run_select", "plot_select", "plot_distances", "select_table", "select_verdicts",
           "distance_table", "write_csv", "GRANULARITIES", "Search", "SearchContext", "Space", "find_search", "parse_search_args", "search_names"]
