"""`prune`: remove each layer in turn (no fine-tuning) and measure what the model loses.

The public face: `run_sweep` (the resumable sweep, through the reuse engine or lm-eval), the
results it gives (`Sweep`, `read_sweep`, `kept_for_rerun` after an interruption), `block_choices` (`--block N`), `run_greedy` (`--greedy K`:
depth curves, `DepthCurves`; `replay_orders`, `--orders DIR`) and the report
(`prune_table`, `block_table`, `plot_prune`, `plot_prune_overlay`). The reuse engine's own
entry points are in `engine`.
"""

from depthcurse.prune.block import block_choices, block_pass
from depthcurse.prune.greedy import DepthCurves, read_curves, replay_orders, run_greedy
from depthcurse.prune.report import UNIT_NAMES, block_table, greedy_table, load_prune, plot_greedy, plot_prune, plot_prune_overlay, prune_table
from depthcurse.prune.results import PARTIAL_DIR, RESULTS_CSV, RESULTS_JSON, Sweep, VariantResult, read_sweep
from depthcurse.prune.layout import parse_memory
from depthcurse.prune.sweep import ENGINES, kept_for_rerun, run_sweep

__all__ = [
    "DepthCurves", "read_curves", "replay_orders", "run_greedy", "greedy_table", "plot_greedy",
    "UNIT_NAMES", "block_choices", "block_pass", "block_table", "load_prune", "plot_prune", "plot_prune_overlay", "prune_table",
    "PARTIAL_DIR", "RESULTS_CSV", "RESULTS_JSON", "Sweep", "VariantResult", "read_sweep", "parse_memory", "ENGINES", "kept_for_rerun", "run_sweep",
]
