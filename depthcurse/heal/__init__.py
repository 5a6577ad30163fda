"""`heal`: how much of what a removal costs can a little training win back (Gromov et al.'s healing).

The public face: `HealConfig` (what a run is), `heal` (one run: layers removed, LoRA adapters
trained with peft, the model measured unpruned, pruned and healed, saved merged), `heal_curve`
and `order_sets` (the first k layers of an earlier result's order, healed for each k),
`read_heal`, and the report (`heal_table`, `curve_table`, `plot_heal_curve`). The pieces:
`config`, `adapters` (peft), `objective` (the loss `train.loop.train_step` trains), `loop`,
`curve`, `report`.
"""

from depthcurse.heal.config import HealConfig
from depthcurse.heal.curve import heal_curve, order_sets, parse_ks
from depthcurse.heal.loop import HEAL_JSON, heal, read_heal
from depthcurse.heal.report import curve_table, heal_table, plot_heal_curve

__all__ = ["HealConfig", "heal", "heal_curve", "order_sets", "parse_ks", "read_heal", "HEAL_JSON", "heal_table", "curve_table", "plot_heal_curve"]
