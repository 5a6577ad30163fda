"""`heal`: how much of what a removal costs can be won back, and by which method.

The public face: `Method` and `HealContext` (the contract a recovery method meets: one class in
one file, `heal/methods/` for the built-in ones), `find_method`, `build_method`, `method_names`
(the registry, outside methods included), `HealConfig` (what a run is), `heal` (one run: layers
removed, the removal won back by a method, the model measured unpruned, pruned and healed, the
healed checkpoint saved), `heal_methods` (several methods side by side), `heal_curve` and
`order_sets` (the first k layers of an earlier result's order, healed for each k), `read_heal`,
and the report (`heal_table`, `methods_table`, `curve_table`, `plot_heal_curve`). The pieces:
`method`, `methods/`, `config`, `adapters` (peft), `linear` (ReplaceMe's maps), `replacement`
(new layers), `objective` (next-token objectives `train.loop.train_step` trains), `streams`,
`healed` (one model in memory as the unpruned, pruned or healed one; saving from a copy), `loop`,
`compare`, `curve`, `report`.
"""

from depthcurse.heal.method import HealContext, Method, build_method, find_method, method_names
from depthcurse.heal.objective import HealObjective
from depthcurse.heal import methods as _builtin  # noqa: F401 (defines the built-in methods, which registers them)
from depthcurse.heal.compare import Models, check_settings, heal_methods, parse_methods
from depthcurse.heal.config import HealConfig, method_args
from depthcurse.heal.curve import heal_curve, heal_within, order_sets, parse_ks, parse_share
from depthcurse.heal.loop import HEAL_JSON, heal, kept_summary, read_heal
from depthcurse.heal.report import curve_table, heal_rows, heal_table, heal_verdicts, methods_of, methods_table, plot_heal_curve

__all__ = ["Method", "HealContext", "HealObjective", "find_method", "build_method", "method_names", "HealConfig", "method_args", "heal", "kept_summary", "heal_methods", "Models",
           "check_settings", "methods_of", "parse_methods", "heal_curve", "heal_within", "order_sets", "parse_ks", "parse_share", "read_heal",
           "HEAL_JSON", "heal_rows", "heal_table", "heal_verdicts", "methods_table", "curve_table", "plot_heal_curve"]
