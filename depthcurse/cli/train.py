"""`lns-train` (its options are `TrainConfig`'s fields) and `lns-report` (the paper's Table 1)."""

from __future__ import annotations

import inspect
import os
import typing
from pathlib import Path
from typing import Optional

import typer

from rich.progress import TaskProgressColumn, TextColumn
from rich.text import Text

from depthcurse.cli.shared import console, err_console, fail, progress_bar, renamed, say, showing, slug
from depthcurse.errors import DepthcurseError
from depthcurse.io import claim_out_dir
from depthcurse.train import incomparable, read_run, seed_groups, seeds_table, table1, write_compare
from depthcurse.train.config import TrainConfig
from depthcurse.train.config import options as train_options


def _train_options(command):
    """Give `command` one option per `TrainConfig` field that has a flag (see train/config.py),
    before its own parameters: the options and the config are one list of fields."""
    hints = typing.get_type_hints(TrainConfig)
    params = [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=typer.Option(f.default, flag, help=help, show_default="the preset's" if f.default is None else True),
                          annotation=Optional[_bare(hints[f.name])] if f.default is None else hints[f.name])
        for f, flag, help in train_options()
    ]
    own = list(inspect.signature(command).parameters.values())
    command.__signature__ = inspect.Signature(params + [p for p in own if p.kind is inspect.Parameter.KEYWORD_ONLY])
    command.__annotations__ = {p.name: p.annotation for p in command.__signature__.parameters.values()}
    return command


def _bare(hint):
    """int | None -> int."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


@_train_options
def lns_train(
    *,
    resume: bool = typer.Option(False, "--resume", help="Continue the run in --out exactly where its checkpoint left it."),
    out: Optional[Path] = typer.Option(None, "--out", help="Run folder (default runs/train/<preset>-<norm>-s<seed>)."),
    layers: Optional[int] = typer.Option(None, "--layers", hidden=True, help="Now --num-layers."),
    **settings,
) -> None:
    """Pre-train a LLaMA-style model with the chosen normalisation; exports a checkpoint `prune` and `angular-distance` load."""
    from depthcurse.train.loop import run  # lazy: start-up

    settings["num_layers"] = renamed("lns-train", "--layers", layers, settings["num_layers"], None)  # --layers names which layers everywhere else
    cfg = TrainConfig(**settings)
    preset, norm, seed = cfg.preset, cfg.norm, cfg.seed
    # Under torchrun only rank 0 talks; another rank says only an error of its own (_fail).
    main_rank = int(os.environ.get("RANK", "0")) == 0
    out_dir = out or Path("runs") / "train" / f"{preset}-{slug(norm)}-s{seed}"
    claim_out_dir(out_dir)
    progress = progress_bar(TaskProgressColumn(), TextColumn("{task.fields[stats]}"), disable=not main_rank)
    bar = progress.add_task("training", total=None, stats="")

    def on_start(info: dict) -> None:
        if resume and not info["resumed"]:
            say("note", f"--resume: {out_dir} holds no checkpoint yet, so the run starts from scratch")
        progress.update(bar, total=info["steps"], completed=info["start_step"])
        ranks = f" · {info['world_size']} ranks, {info['parallel']}" if info["parallel"] else ""
        console.print(f"[bold]{preset}[/] · norm [bold]{norm}[/] ({cfg.init} init) · {info['params'] / 1e6:.2f}M parameters · {info['device']} {info['precision']} · "
                      f"kernels {info['kernels']}{ranks} · "
                      f"{info['data']} ({info['val_tokens']} held-out tokens) · {'resuming at step ' + str(info['start_step']) if info['start_step'] else 'from scratch'} · {out_dir}")

    def on_progress(p) -> None:
        progress.update(bar, completed=p.step, stats=f"loss {p.loss:.3f} · lr {p.lr:.2e} · {p.tokens_per_s:,.0f} tok/s")

    def on_eval(step: int, result: dict) -> None:
        progress.console.print(f"step {step}: validation loss {result['val_loss']:.4f}, perplexity {result['val_ppl']:.2f}")

    try:
        with showing(progress):
            summary = run(cfg, out_dir, resume=resume, on_start=on_start, on_progress=on_progress, on_eval=on_eval, on_note=lambda text: say("note", text))
    except KeyboardInterrupt:
        if main_rank:
            err_console.print(Text(f"interrupted: the last checkpoint in {out_dir} is kept; rerun with --resume to continue"), soft_wrap=True)
        raise typer.Exit(130)
    except DepthcurseError as exc:
        if main_rank:
            raise
        fail(str(exc))
    if not main_rank:
        return
    console.print(f"validation loss {summary['val_loss']:.4f} · perplexity {summary['val_ppl']:.2f} · {summary['step']} steps, {summary['tokens']:,} tokens · "
                  f"{summary['step_tokens_per_s']:,.0f} tokens/s, {summary['step_tflops']:.3g} TFLOP/s in the steps, micro-batch {summary['micro_batch']}")
    figures = [out_dir / name for name in ("loss.png", "layers.png") if (out_dir / name).is_file()]  # layers.png: with --layer-metrics-tokens
    console.print(f"wrote {out_dir / 'metrics.jsonl'}, {out_dir / 'summary.json'}, {', '.join(map(str, figures))}, {', '.join(summary['exports'].values())}")


def lns_report(
    runs: list[Path] = typer.Argument(..., help="lns-train run folders to compare."),
    out: Path = typer.Option(Path("runs") / "train" / "compare", "--out", help="Folder for compare.csv/json/png."),
) -> None:
    """Overlay the loss curves of training runs and print their perplexities in the layout of the paper's Table 1."""
    read = [read_run(r) for r in runs]
    claim_out_dir(out)
    paths = write_compare(read, out)
    console.print(table1(read))
    groups = seed_groups(read)
    if groups:
        console.print(seeds_table(groups))
    for line in incomparable(read):
        say("warning", line)
    console.print(f"wrote {', '.join(str(p) for p in paths)}")
