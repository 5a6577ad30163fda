"""`select`: calibration text x objective x search, each cell's choice judged on the same held-out measurements."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Optional

import typer
from rich.text import Text

from depthcurse.cli.shared import (SUITES_HELP, DeviceOpt, DtypeOpt, ModelArg, RevisionOpt, TrustOpt, console, decoders_only, err_console, join_ranks, load, model_line, once,
                                   progress_bar, say, showing, slug, verdicts)
from depthcurse.granularity import granularity_help
from depthcurse.io import claim_out_dir


def _names(text: str) -> tuple[str, ...]:
    """A comma-separated list as typed, duplicates kept (`SelectConfig.checked` refuses them)."""
    return tuple(p.strip() for p in text.split(",") if p.strip())


def _seeds(text: str | None) -> tuple[int, ...]:
    from depthcurse.errors import DepthcurseError

    try:
        return tuple(int(p) for p in _names(text or ""))
    except ValueError:
        raise DepthcurseError(f"--seeds {text}: give whole numbers, comma-separated (e.g. 1,2,3)") from None


def select(
    model: str = ModelArg,
    k: int = typer.Option(4, "--k", help="Units each cell removes: k blocks (or, with --granularity sub-block, k attention and k MLP branches)."),
    calibration: str = typer.Option("wiki", "--calibration", help="Texts to choose on, comma-separated: auto (c4 where the hub is reachable, else wiki), wiki (prose), c4 (web prose, from the hub), code (Python), math (MATH problems and solutions), dialogue (CoQA's question and answer turns), continuations (the model's own greedy continuations of speculate's offline prompts, --seq-len tokens each, scored where a draft predicts: what SWIFT and Draft & Verify score on; continuations:FILE for a prompts file) or a .txt/.jsonl/.parquet file; each is also held out and judged on."),
    objective: Optional[str] = typer.Option(None, "--objective", help="What the searches that score removals minimise on the calibration windows (greedy, one-shot, exact, evo, random), comma-separated: ppl (next-token loss; the default with --search), kl (KL from the unpruned model: EvoPress's default), acceptance (1 - top-1 agreement with the unpruned model: the best self-draft for speculate) and/or speedup (the expected time per token of speculative decoding with that draft, from its agreement and this machine's measured costs).", show_default="kl with the recipe (--k alone), ppl with --search"),
    draft_tokens: int = typer.Option(4, "--draft-tokens", help="With --objective speedup: the tokens the draft proposes a round (gamma)."),
    search: Optional[str] = typer.Option(None, "--search", help="Left out: the recipe (by kl: greedy, plus exact where its estimate fits --budget, else evo; docs/select.md). Else how the k units are found, comma-separated: greedy, one-shot (the k cheapest single removals), angular (Gromov et al.'s block), bi (ShortGPT's Block Influence), exact (every removal: the optimum), evo (EvoPress's evolutionary search), random (the best of random draws: the null distribution), last (the k blocks before the final one), laco and swm (the layers LaCo's and Sliding-Window Merging's procedures merge away), swift and draft-verify (the self-speculative decoding papers' skip-set searches, over branches), or module:Class / file.py:Class of your own."),
    search_args: Optional[str] = typer.Option(None, "--search-args", help="The searches' settings, key=value,... (name.key=value for one search): exact.max_sets, evo.offspring, evo.seed, random.sets, laco.interval, ... (`depthcurse settings` lists every one with its default)."),
    resamples: Optional[int] = typer.Option(None, "--resamples", help="Rerun each search on this many bootstrap resamples of the calibration windows and say how often each unit comes back (the pick's stability). Left out: 8 for the recipe's greedy and exact (their reruns reuse the scores measured), none otherwise."),
    seeds: Optional[str] = typer.Option(None, "--seeds", help="Also rerun each seeded search (evo, random, swift) under these seeds, comma-separated, on every calibration window.", show_default="off"),
    budget: float = typer.Option(30.0, "--budget", help="Minutes: the recipe runs exact where its estimate on this machine fits, else evo."),
    granularity: str = typer.Option("layer", "--granularity", help=granularity_help("select") + " sub-block is for exact, evo, random and last; branch for exact, random, swift and draft-verify (which chooses how many itself)."),
    calib_windows: int = typer.Option(8, "--calib-windows", help="Windows of each text the choice is made on."),
    eval_windows: int = typer.Option(16, "--eval-windows", help="Other windows of each text every choice is judged on."),
    held_out: str = typer.Option("windows", "--held-out", help="What the held-out windows are: windows (other windows of the same documents) or documents (windows of documents the calibration never saw: a text with document boundaries)."),
    seq_len: int = typer.Option(128, "--seq-len", help="Tokens per window."),
    batch_size: int = typer.Option(4, "--batch-size", help="Windows per forward pass."),
    task: Optional[str] = typer.Option(None, "--task", help="Also judge every choice on this task, by prune's reuse engine: an lm-eval task, or " + SUITES_HELP + ".", show_default="off"),
    limit: Optional[int] = typer.Option(None, "--limit", help="With --task: examples per task.", show_default="every example"),
    seed: int = typer.Option(1234, "--seed", help="Seed of the split into calibration and held-out windows."),
    out: Optional[Path] = typer.Option(None, "--out", help="Results folder (default runs/select/<model>)."),
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
    trust_remote_code: bool = TrustOpt,
    revision: Optional[str] = RevisionOpt,
) -> None:
    """Which k layers should go, and how sure is that? With --k alone: the recipe's answer first (the
    removal, held out against the unpruned model, and how often it comes back on resampled windows),
    then the commands that take it further. With --search: the grid, each calibration text x objective
    x search choosing k units, every choice judged on the same held-out windows (and --task) and
    against the best removal (the exact optimum with --search exact).

    Example: depthcurse select smollm2-135m --k 4   (the recipe);
    depthcurse select smollm2-135m --k 4 --search greedy,evo --objective kl,ppl --calibration wiki,code --resamples 8   (a grid)"""
    from depthcurse.select import SelectConfig, parse_search_args
    from depthcurse.stats import MIN_ITEMS

    cfg = SelectConfig(k=k, calibration=_names(calibration), objectives=_names(objective) if objective is not None else None,
                       searches=_names(search) if search is not None else None, calib_windows=calib_windows, eval_windows=eval_windows, seq_len=seq_len,
                       batch_size=batch_size, task=task, limit=limit, seed=seed, granularity=granularity, search_args=parse_search_args(search_args),
                       draft_tokens=draft_tokens, resamples=resamples, seeds=_seeds(seeds), budget=budget, held_out=held_out)
    checked = cfg.checked()  # the options alone, before a model loads (k against its layers after)
    if "auto" in cfg.calibration:
        say("note", f"--calibration auto is {checked.calibration[cfg.calibration.index('auto')]} here (c4 where the hub is reachable, else wiki)")
    cfg = replace(cfg, calibration=checked.calibration)
    if checked.eval_windows < MIN_ITEMS and len(checked.calibration) > 1 and len(checked.cells()) > len(checked.calibration):
        say("note", f"--eval-windows {checked.eval_windows}: fewer than {MIN_ITEMS} held-out windows are too few to resample, so the decomposition "
                    "will say it cannot tell which factor decided (the intervals of each score are Student's t, honest at any number)")
    out = claim_out_dir(out or Path("runs/select") / slug(model))
    world = join_ranks(device)
    try:
        _select(model, cfg, out, world, dtype=dtype, device=device, trust_remote_code=trust_remote_code, revision=revision)
    finally:
        world.close()


def _select(model, cfg, out: Path, world, **options) -> None:
    """The grid, shown and written: alone, or as one rank of a torchrun launch (where rank 0 alone talks and writes)."""
    import torch

    from depthcurse.runtime import rank_gpus
    from depthcurse.select import SELECT_JSON, distance_table, plot_distances, plot_select, run_select, select_table, select_verdicts, write_csv
    from depthcurse.select.report import answer_lines, next_commands, plot_stability, stability_verdicts

    gpus = rank_gpus() if world.parallel and options["device"] != "cpu" and torch.cuda.is_available() else None  # this rank's share
    loaded = load(model, **options, gpus=gpus, not_encoder=decoders_only("select"))
    header = once(lambda: console.print(model_line(loaded)))  # said when the work starts, after every check of the input
    progress = progress_bar()
    bar = progress.add_task("starting", total=None)
    where = {"phase": "starting"}

    def on_phase(text: str) -> None:
        header()
        where["phase"] = text
        progress.update(bar, description=text, completed=0, total=None)

    def on_step(label: str, done: int, total: int) -> None:
        where["phase"] = f"{where['phase'].split(': ', 1)[0]}: {label} ({done + 1} of {total})"
        progress.update(bar, description=label, completed=done, total=total)

    try:
        with showing(progress):
            record = run_select(loaded, cfg, out, on_phase=on_phase, on_step=on_step, on_note=lambda text: (header(), say("note", text)), world=world)
    except KeyboardInterrupt:
        kept = f"every finished piece is in {out / SELECT_JSON}; rerun the same command to continue" if (out / SELECT_JSON).exists() else \
            "nothing had finished, so nothing was written"
        err_console.print(Text(f"interrupted while {where['phase']}: {kept}"), soft_wrap=True)
        raise typer.Exit(130)
    if not world.main:  # rank 0 shows and writes the results
        return
    header()  # a run found finished had no phase to say it
    if cfg.recipe:  # the answer, before anything else
        for line in answer_lines(record):
            console.print(Text(line, style="bold"), soft_wrap=True, highlight=False)
    console.print(select_table(record))
    distances = distance_table(record)
    if distances is not None:
        console.print(distances)
    verdicts(select_verdicts(record) + stability_verdicts(record))
    written = [out / SELECT_JSON, write_csv(record, out / "select.csv"), plot_select(record, out / "select.png")]
    for figure in (plot_distances(record, out / "distances.png"), plot_stability(record, out / "stability.png")):
        if figure is not None:
            written.append(figure)
    say("written", ", ".join(map(str, written)), "green")
    for line in next_commands(record, model, out):
        say("next", line, "cyan")
