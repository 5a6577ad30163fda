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
    # every other name more than one command takes: one idea, one form of value, wherever it is taken
    "--as": ("whose definitions a measurement follows: depthcurse (ours) or an anchor paper's own", ("depth-use", "depth-map")),
    "--batch-size": ("how many windows, sequences or examples go through the model at once", ("prune", "heal", "angular-distance", "depth-use", "depth-map",
                                                                                             "lns-train", "finetune-qa", "select")),
    "--compile": ("torch.compile the model's blocks (the figures are the same)", ("prune", "lns-train")),
    "--device": ("where the model runs: auto, cpu, cuda or cuda:N", ("prune", "heal", "drop", "speed", "angular-distance", "depth-use", "depth-map",
                                                                    "lns-train", "finetune-qa", "select", "speculate")),
    "--draft-tokens": ("tokens a draft proposes a round (gamma)", ("select", "speculate")),
    "--dtype": ("what the model computes in: auto, bf16, fp16 or fp32", ("prune", "heal", "drop", "speed", "angular-distance", "depth-use", "depth-map",
                                                                        "select", "speculate")),
    "--granularity": ("what one removal takes out: layer, attn, mlp, sub-block or branch, one meaning each (the table below); "
                      "each command takes the ones its removals can be", ("prune", "heal", "select")),
    "--layers": ("which layers: a list such as 3,7 or 20-23 (lns-train's count of blocks is --num-layers)", ("prune", "heal", "drop", "speed")),
    "--lr": ("the peak learning rate of a training", ("heal", "lns-train", "finetune-qa")),
    "--max-drop": ("the largest share of the unpruned model's score a removal may lose: 5% or 0.05", ("prune", "heal")),
    "--micro-batch": ("how many sequences one forward and backward pass takes (a step accumulates --batch-size)", ("heal", "lns-train")),
    "--num-fewshot": ("lm-eval's examples before each question", ("prune", "heal")),
    "--out": ("the results folder (or the page, for report; the figure, for plot)", ("prune", "heal", "drop", "speed", "angular-distance", "depth-use",
                                                                                     "depth-map", "report", "plot", "lns-train", "lns-report",
                                                                                     "finetune-qa", "select", "speculate")),
    "--private": ("a hub repository made private", ("heal", "drop")),
    "--push-to-hub": ("the hub repository a checkpoint is uploaded to", ("heal", "drop")),
    "--report-to": ("the live trackers of a training: none, tensorboard or wandb", ("heal", "lns-train")),
    "--revision": ("the model's hub revision (branch, tag or commit)", ("prune", "heal", "drop", "speed", "angular-distance", "depth-use", "depth-map",
                                                                       "select", "speculate")),
    "--save-every": ("how many training steps between checkpoints", ("heal", "lns-train", "finetune-qa")),
    "--speed": ("what the removal buys, timed against the source model after the checkpoint is written", ("heal", "drop")),
    "--steps": ("how many optimizer steps a training takes", ("heal", "lns-train")),
    "--task": ("what a model is scored on: ppl, an lm-eval task or a suite (prune's help lists them)", ("prune", "heal", "select")),
    "--tokens": ("how many tokens the run reads (angular-distance: measured; lns-train: trained on, in place of --steps)",
                 ("angular-distance", "lns-train")),
    "--trust-remote-code": ("run a model's own code from the hub (only when asked)", ("prune", "heal", "drop", "speed", "angular-distance", "depth-use",
                                                                                     "depth-map", "select", "speculate")),
    "--warmup": ("how many steps the learning rate warms up over", ("heal", "lns-train")),
}

# (command, old name): new name
RENAMED = {
    ("depth-map", "--windows"): "--calib-windows",
    ("depth-map", "--held-out"): "--eval-windows",
    ("depth-use", "--lens-windows"): "--calib-windows",
    ("heal", "--data"): "--calibration",
    ("lns-train", "--layers"): "--num-layers",
}


def renamed_note(old: str, new: str) -> str:
    return f"{old} is now {new}, the name every command gives it (docs/commands.md); {old} still works for now"
