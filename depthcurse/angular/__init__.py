"""`angular-distance`: how much each run of blocks changes the residual stream, from one pass.

The public face: `measure_loaded` / `measure_text` / `measure` (the measurement), `AngularResult`,
`write_angular` and `load_angular` (what it gives, saved and read back), and the report
(`plot_angular`, `plot_layers`, `angular_table`, `massive_summary`).
"""

from depthcurse.angular.measurement import check_max_n, check_options, measure, measure_loaded, measure_text
from depthcurse.angular.report import angular_table, massive_summary, plot_angular, plot_layers
from depthcurse.angular.result import AngularResult, BlockChoice, load_angular, write_angular

__all__ = [
    "check_max_n", "check_options", "measure", "measure_loaded", "measure_text",
    "angular_table", "massive_summary", "plot_angular", "plot_layers", "write_angular", "AngularResult", "BlockChoice", "load_angular",
]
