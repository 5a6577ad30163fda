"""One name for each idea, in every command (docs/commands.md, "One vocabulary").

`VOCABULARY` names each idea the options share, the commands that take it, and what it means there;
`RENAMED` the older names that still work, each with a one-line note naming the new one.
`tests/test_cli.py` walks every command's options against both: a name the table gives one idea is
taken by no command for another, and an idea has no second name outside `RENAMED`.
"""

from __future__ import annotations

# name: (the idea, the commands that take it)
VOCABULARY = {
    "--data": ("the text measured on (lns-train, finetune-qa: the text trained on)",
               ("prune", "angular-distance", "depth-use", "depth-map", "lns-train", "finetune-qa")),
    "--calibration": ("the text a choice or a repair is fitted on, whose other windows are held out", ("select", "heal")),
    "--windows": ("how many windows are measured", ("depth-use",)),
    "--calib-windows": ("how many windows a choice, a map or a lens is fitted on", ("select", "depth-use", "depth-map")),
    "--eval-windows": ("how many held-out windows every result is scored on", ("select", "heal", "depth-map")),
    "--seq-len": ("how many tokens a window holds", ("prune", "heal", "angular-distance", "depth-use", "depth-map", "lns-train", "select")),
    "--held-out": ("what the held-out windows are: other windows, or other documents", ("select",)),
    "--limit": ("how many examples of each task (prune's ppl: windows, as lm-eval's --limit)", ("prune", "heal", "select")),
    "--seed": ("the seed of everything random in the run (each command's help says what that is)",
               ("prune", "heal", "depth-use", "depth-map", "lns-train", "finetune-qa", "select", "speculate")),
    "--prompts": ("the prompts generated from (not windows: whole prompts)", ("speculate",)),
    "--eval-data": ("another text measured on, beside the calibration's held-out windows", ("heal",)),
    "--calib-tokens": ("how many tokens the closed-form methods estimate on (a method's budget, in tokens)", ("heal",)),
    "--min-fit-ratio": ("the fewest fitting tokens per input of a linear map accepted (below 1 the map is under-determined; heal's linear maps: "
                        "--method-args min_fit_ratio=R)", ("depth-map",)),
}

# (command, old name): new name
RENAMED = {
    ("depth-map", "--windows"): "--calib-windows",
    ("depth-map", "--held-out"): "--eval-windows",
    ("depth-use", "--lens-windows"): "--calib-windows",
    ("heal", "--data"): "--calibration",
}


def renamed_note(old: str, new: str) -> str:
    return f"{old} is now {new}, the name every command gives it (docs/commands.md); {old} still works for now"
