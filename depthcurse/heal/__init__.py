"""`heal`: how much of what a removal costs can be won back, and by which method.

The public face: `HealConfig` (what a run is), `heal` (one run: layers removed, the removal won
back by LoRA adapters trained with peft, a training-free linear map folded into the weights
(ReplaceMe), a trained replacement layer (LLM-Streamline), or the map then LoRA; the model
measured unpruned, pruned and healed, saved), `heal_methods` (several methods side by side),
`heal_curve` and `order_sets` (the first k layers of an earlier result's order, healed for each
k), `read_heal`, and the report (`heal_table`, `methods_table`, `curve_table`,
`plot_heal_curve`). The pieces: `config`, `adapters` (peft), `linear` (the maps), `replacement`
(the new layers), `objective` (the loss `train.loop.train_step` trains for adapters),
`healed` (one model in memory as the unpruned, pruned or healed one; saving), `loop`,
`compare`, `curve`, `report`.
"""

from depthcurse.heal.compare import Models, heal_methods, parse_methods
from depthcurse.heal.config import METHODS, HealConfig
from depthcurse.heal.curve import heal_curve, heal_within, order_sets, parse_ks, parse_share
from depthcurse.heal.loop import HEAL_JSON, heal, read_heal
from depthcurse.heal.report import curve_table, heal_rows, heal_table, methods_of, methods_table, plot_heal_curve

__all__ = ["HealConfig", "METHODS", "heal", "heal_methods", "Models", "methods_of", "parse_methods", "heal_curve", "heal_within", "order_sets", "parse_ks", "parse_share", "read_heal",
           "HEAL_JSON", "heal_rows", "heal_table", "methods_table", "curve_table", "plot_heal_curve"]
