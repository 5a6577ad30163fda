"""The recovery methods that merge a removed run into the layer before it instead of removing it
(`methods/laco`, `methods/swm`): the `Merge` base they share, whose rule is the only thing each
sets. The arithmetic is `depthcurse.merging`'s."""

from __future__ import annotations

from depthcurse.heal.method import HealContext, Method
from depthcurse.merging import check_run, merged_block, projections_text
from depthcurse.surgery import find_blocks, placed_layers, run_text, runs_of


class Merge(Method):
    """A removed run merged into the layer before it (`rule`, the subclasses'). Nothing trains and
    nothing is estimated: the merged layer is a copy, in its base's place while the healed model
    runs and in the checkpoint, so that the model in memory stays the unpruned one."""

    def rule(self):
        raise NotImplementedError

    def rule_text(self) -> str:
        raise NotImplementedError

    def check(self, model, layers):
        for run in runs_of(layers):
            check_run(model, run, f"--method {self.name}")

    def describe(self):
        return f"each removed run merged into the layer before it, {self.rule_text()}"

    def changes(self, layers):
        names = getattr(self, "names", "the attention and MLP parameters")
        return "; ".join(f"layer {run[0] - 1} holds {run_text((run[0] - 1, *run))} merged ({self.rule_text()})" for run in runs_of(layers)) + (
            f": its {names} changed, its norms its own (as the authors' code leaves them)")

    def untouched(self, layers):
        return min(layers) - 1

    def prepare(self, ctx: HealContext):
        self.check(ctx.model, ctx.layers)
        blocks = find_blocks(ctx.model).layers
        biases = getattr(self.settings, "biases", False)
        self.merged = {run[0] - 1: merged_block(blocks, run[0] - 1, list(run), self.rule(), biases) for run in runs_of(ctx.layers)}
        self.names = projections_text(blocks[0], biases)

    def state_dict(self):
        return {}  # nothing estimated: `prepare` makes the same merge again

    def applied(self, model):
        return placed_layers(model, getattr(self, "merged", {}))

    placed = applied

    def modules(self):
        return list(getattr(self, "merged", {}).values())
