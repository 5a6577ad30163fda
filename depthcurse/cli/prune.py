"""`prune` (one layer at a time, --block, --greedy, --orders), and the commands that show results: `plot`, `report`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.text import Text

from depthcurse.cli.shared import (
    SUITES_HELP, DeviceOpt, DtypeOpt, ModelArg, RevisionOpt, TrustOpt, console, err_console, join_ranks, load,
    measure_angular, model_line, once, progress_bar, say, showing, slug, verdicts,
)
from depthcurse.errors import DepthcurseError
from depthcurse.granularity import granularity_help
from depthcurse.io import claim_out_dir


def prune(
    model: str = ModelArg,
    task: str = typer.Option("ppl", "--task", "-t", help="ppl, mmlu, any lm-eval task: log-likelihood (arc_easy, hellaswag, piqa, sciq...) or generative (gsm8k, nq_open: each variant generates on its own), squad (extractive QA encoders) or repr (any model, made for encoders: mean-pooled embedding kept); or " + SUITES_HELP + "."),
    layers: Optional[str] = typer.Option(None, "--layers", help="Layers to remove one at a time, e.g. 0,3,5-8 (default: all)."),
    limit: Optional[int] = typer.Option(None, "--limit", help="ppl: number of text windows (default 32); squad: questions (default all); repr: passages (default 256); lm-eval tasks: examples per subtask (default all)."),
    num_fewshot: int = typer.Option(0, "--num-fewshot", help="Few-shot examples in each prompt (lm-eval tasks)."),
    max_gen_toks: Optional[int] = typer.Option(None, "--max-gen-toks", help="Longest generation of a generative lm-eval task (gsm8k, nq_open, ...); default: the task's own (lm-eval: 256)."),
    batch_size: int = typer.Option(8, "--batch-size", help="Sequences per forward pass."),
    data: str = typer.Option("auto", "--data", help="ppl/repr text: auto (C4 validation, or wiki offline), c4, wiki, or a .txt/.jsonl/.parquet file; squad: auto (hub validation, or offline), hub, offline, or a SQuAD .json/.jsonl file."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="ppl window length in tokens (default 512, or the model's maximum if less); repr passage length (default 128)."),
    bos: bool = typer.Option(True, "--bos/--no-bos", help="ppl: begin each window with the token(s) the model's tokenizer puts first (BOS, where it adds one; the default), or cut the text with nothing first (--no-bos: the WikiText protocol of GPTQ, SparseGPT and Wanda)."),
    seed: int = typer.Option(1234, "--seed", help="Seed for few-shot sampling and torch."),
    engine: str = typer.Option("reuse", "--engine", help="reuse (all variants together, reusing the blocks before each removed layer and shared few-shot prefixes) or lm-eval (each variant evaluated on its own). Unsupported models/tasks fall back to lm-eval."),
    max_memory: str = typer.Option("auto", "--max-memory", help="reuse engine: memory for the kept residual streams and prefix keys/values of one batch: auto (2GB on a CPU, 80% of the GPU memory free after loading) or a size, e.g. 24GB."),
    compile: bool = typer.Option(False, "--compile", help="reuse engine: torch.compile each block (inductor fuses norms, rotary, SwiGLU, residual adds). Measured on a CPU: 0.89x the scoring time of a SmolLM2 MMLU sweep, after about a minute of compiling (cached on disk for later runs)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Results folder (default runs/prune/<model>/<task>)."),
    block: Optional[int] = typer.Option(None, "--block", help="Instead of one layer at a time: remove the N contiguous layers angular distance picks, and for comparison the N deepest layers before the final one.", show_default="off: one layer at a time"),
    angular: Optional[Path] = typer.Option(None, "--angular", help="With --block: an angular-distance result (folder or angular.json) to pick the block from, instead of measuring.", show_default="measured here"),
    angular_data: str = typer.Option("auto", "--angular-data", help="With --block: text the angular distance is measured on (auto, c4, wiki or a file)."),
    angular_tokens: int = typer.Option(65536, "--angular-tokens", help="With --block: token budget of the angular-distance pass."),
    granularity: str = typer.Option("layer", "--granularity", help=granularity_help("prune") + " Each is removed in turn."),
    greedy: Optional[int] = typer.Option(None, "--greedy", help="Instead of one at a time: remove K units greedily, each step the one whose removal costs least (measured exactly), and compare with the orders one-shot ranking, Block Influence, angular distance and the last layers give.", show_default="off: one layer at a time"),
    max_drop: Optional[str] = typer.Option(None, "--max-drop", help="With --greedy: stop after the step whose relative drop exceeds this share, e.g. 5% or 0.05 (as heal's --max-drop).", show_default="off: every step"),
    orders: Optional[Path] = typer.Option(None, "--orders", help="Instead of choosing: measure every strategy's order from an earlier --greedy result (its folder) on this task and data, e.g. held-out text.", show_default="off"),
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
    trust_remote_code: bool = TrustOpt,
    revision: Optional[str] = RevisionOpt,
) -> None:
    """Remove each layer in turn (no fine-tuning) and measure the drop against the unpruned model.

    With --block N: remove the N-layer block that angular distance picks and the N deepest layers, and compare.
    With --greedy K: the depth curve, K units removed one greedy step at a time, against cheaper orders.
    With --orders DIR: those orders, chosen on other data, measured on this task and data.
    """
    import torch  # lazy: start-up

    from depthcurse import prune as sweeps
    from depthcurse.runtime import rank_gpus
    from depthcurse.surgery import check_granularity, num_layers, parse_layers
    from depthcurse.tasks import build_task, head_for_task

    torch.manual_seed(seed)
    if batch_size < 1:
        raise DepthcurseError("--batch-size must be at least 1")
    if block is not None and layers is not None:
        raise DepthcurseError("--block and --layers are exclusive: --block picks its own layers")
    if block is None and greedy is None and angular is not None:
        raise DepthcurseError("--angular only applies with --block N or --greedy K")
    if greedy is not None and (block is not None or layers is not None):
        raise DepthcurseError("--greedy searches every layer itself: it takes neither --block nor --layers")
    if max_drop is not None and greedy is None:
        raise DepthcurseError("--max-drop only applies with --greedy K")
    if max_drop is not None:
        from depthcurse.heal.curve import parse_share  # one form of a share for every --max-drop: 5% or 0.05

        max_drop = parse_share(max_drop)
    chosen = None
    if orders is not None:
        if greedy is not None or block is not None or layers is not None:
            raise DepthcurseError("--orders measures the sets of an earlier --greedy result: it takes no --greedy, --block or --layers")
        chosen = sweeps.read_curves(orders)
        if granularity not in ("layer", chosen.granularity):
            raise DepthcurseError(f"the orders in {orders} remove {chosen.granularity} units, not {granularity}")
        granularity = chosen.granularity
    check_granularity(None, granularity)
    if block is not None and granularity != "layer":
        raise DepthcurseError("--block removes whole layers: it takes no --granularity")
    if angular_tokens < 1:
        raise DepthcurseError(f"--angular-tokens must be positive (got {angular_tokens})")
    if engine not in sweeps.ENGINES:
        raise DepthcurseError(f"unknown --engine {engine!r}: use {' or '.join(sweeps.ENGINES)}")
    sweeps.parse_memory(max_memory)
    if compile and engine != "reuse":
        raise DepthcurseError("--compile compiles the reuse engine's blocks: it needs --engine reuse")
    shot_tag = f"-{num_fewshot}shot" if task not in ("ppl", "squad", "repr") else ""
    block_tag = f"-block{block}" if block is not None else (f"-greedy{greedy}" if greedy is not None else ("-orders" if orders is not None else ""))
    unit_tag = f"-{granularity}" if granularity != "layer" else ""
    out_dir = out or Path("runs") / "prune" / slug(model) / f"{task}{shot_tag}{unit_tag}{block_tag}"
    claim_out_dir(out_dir)
    world = join_ranks(device)
    try:
        gpus = rank_gpus() if world.parallel and device != "cpu" and torch.cuda.is_available() else None  # this rank's share
        loaded = load(model, head=head_for_task(task), dtype=dtype, device=device, trust_remote_code=trust_remote_code, revision=revision, gpus=gpus)
        run_extra = {"seed": seed}
        engine_options = dict(engine=engine, max_memory=max_memory, compile=compile)
        choices = None
        if block is not None:
            def pick():
                return sweeps.block_choices(loaded, block, out_dir, angular=angular, data=angular_data, tokens=angular_tokens,
                                            measure=lambda **options: measure_angular(loaded, out_dir, **options))

            # Rank 0 measures the angular distances and keeps them in out_dir, where the other ranks read them.
            choices = pick() if world.main else None
            world.barrier()
            choices = choices or pick()
            variants = [c.layers for c in choices]
            run_extra["block"] = {"n": block, **{c.rule: list(c.layers) for c in choices}}
        elif greedy is None and chosen is None:
            variants = parse_layers(layers, num_layers(loaded.model))
        with console.status(f"building task {task}..."):
            the_task = build_task(task, loaded.tokenizer, data=data, seq_len=seq_len, limit=limit, num_fewshot=num_fewshot, batch_size=batch_size, seed=seed, model=loaded.model, model_source=loaded.source,
                                  max_gen_toks=max_gen_toks, bos=bos)
        # Said when the work starts, after every check of the input: an error is then the one line printed.
        header = once(lambda: console.print(f"{model_line(loaded)} · task [bold]{task}[/] · {sweeps.UNIT_NAMES[granularity]} removed · results in {out_dir}"))

        if chosen is not None:
            _replay_orders(loaded, the_task, chosen, str(orders), out_dir, run_extra, world, header, **engine_options)
            return
        if greedy is not None:
            _prune_greedy(loaded, the_task, out_dir, greedy, granularity, max_drop, run_extra, world, header,
                          angular=lambda: sweeps.block_pass(loaded, out_dir, angular=angular, data=angular_data, tokens=angular_tokens,
                                                            measure=lambda **options: measure_angular(loaded, out_dir, **options)), **engine_options)
            return
        progress = progress_bar()
        bar = progress.add_task("baseline", total=len(variants) + 1)
        unit = {"layer": "layer", "attn": "attention of layer", "mlp": "MLP of layer"}[granularity]

        def on_variant(label: str, done: int, total: int) -> None:
            header()
            if label == "batches":  # the reuse engine: all variants at once, batch by batch
                progress.update(bar, completed=done, total=total, description="all variants, batch by batch")
                return
            desc = "finished" if label == "done" else ("unpruned baseline" if label == "none" else f"without {unit}{'s' if ',' in label else ''} {label}")
            progress.update(bar, completed=done, total=total, description=desc)

        try:
            with showing(progress):
                sweep = sweeps.run_sweep(loaded, the_task, variants, out_dir, run_extra=run_extra, on_variant=on_variant, granularity=granularity, world=world,
                                         on_note=lambda text: say("note", text), **engine_options)
        except KeyboardInterrupt:
            if world.main:
                _finish_interrupted(out_dir)
            raise typer.Exit(130)
        if sweep is None:  # another rank: rank 0 writes and shows the results
            return
        used = sweep.meta.get("engine", {})
        if used.get("fallback"):
            say("note", f"--engine reuse cannot run this ({used['fallback']}); each variant was evaluated on its own")
        if choices is not None:
            console.print(sweeps.block_table(sweep, choices))
            written = [out_dir / name for name in (sweeps.RESULTS_CSV, sweeps.RESULTS_JSON, "angular.json", "angular.csv", "layers.csv") if (out_dir / name).exists()]
            console.print(f"wrote {', '.join(map(str, written))}")
            return
        sweeps.plot_prune(sweep, out_dir / "prune.png")
        console.print(sweeps.prune_table(sweep))
        console.print(f"wrote {out_dir / sweeps.RESULTS_CSV}, {out_dir / sweeps.RESULTS_JSON}, {out_dir / 'prune.png'}")
    finally:
        world.close()


def _prune_greedy(loaded, task, out_dir, steps, granularity, max_drop, run_extra, world, header, angular, **engine_options) -> None:
    from depthcurse import prune as sweeps  # lazy: start-up

    progress = progress_bar()
    outer = progress.add_task("greedy steps", total=steps)
    inner = progress.add_task("", total=None)

    def on_step(label, done, total):
        header()
        progress.update(outer, completed=done, total=total, description=label)

    try:
        with showing(progress):
            result = sweeps.run_greedy(loaded, task, out_dir, steps=steps, granularity=granularity, max_drop=max_drop, angular=angular, run_extra=run_extra, world=world, **engine_options,
                                       on_step=on_step,
                                       on_variant=lambda label, done, total: progress.update(inner, completed=done, total=total, description="  batches" if label == "batches" else f"  {label}"))
    except KeyboardInterrupt:
        if world.main:
            err_console.print(Text(f"interrupted: finished greedy steps are kept in {out_dir}; rerun the same command to continue"), soft_wrap=True)
        raise typer.Exit(130)
    _show_curves(result, out_dir)


def _replay_orders(loaded, task, chosen, source, out_dir, run_extra, world, header, **engine_options) -> None:
    from depthcurse import prune as sweeps  # lazy: start-up

    progress = progress_bar()
    bar = progress.add_task("the chosen orders", total=None)

    def on_variant(label, done, total):
        header()
        progress.update(bar, completed=done, total=total, description="batches" if label == "batches" else label)

    try:
        with showing(progress):
            result = sweeps.replay_orders(loaded, task, chosen, out_dir, source=source, run_extra=run_extra, world=world, **engine_options, on_variant=on_variant)
    except KeyboardInterrupt:
        if world.main:
            err_console.print(Text(f"interrupted: finished work is kept in {out_dir}; rerun the same command to continue"), soft_wrap=True)
        raise typer.Exit(130)
    _show_curves(result, out_dir)


def _show_curves(result, out_dir: Path) -> None:
    from depthcurse import prune as sweeps  # lazy: start-up

    if result is None:  # another rank: rank 0 writes and shows the results
        return
    sweeps.plot_greedy(result, out_dir / "greedy.png")
    console.print(sweeps.greedy_table(result))
    if (out_dir / "select.json").is_file() and "greedy" in result.curves:  # an exact select run of some k beside it: where greedy's pick falls
        import json

        from depthcurse.select.statistics import optimum_lines

        verdicts(optimum_lines(json.loads((out_dir / "select.json").read_text()), {p.k: tuple(p.removed) for p in result.curves["greedy"]},
                               result.run.get("model")))
    console.print(f"wrote {out_dir / 'greedy.json'}, {out_dir / 'greedy.csv'}, {out_dir / 'greedy.png'}")


def _finish_interrupted(out_dir: Path) -> None:
    from depthcurse import prune as sweeps  # lazy: start-up

    sweep = sweeps.read_sweep(out_dir)
    if sweep is not None:
        sweeps.plot_prune(sweep, out_dir / "prune.png")
    variants, batches = sweeps.kept_for_rerun(out_dir)
    if variants:
        err_console.print(Text(f"interrupted: {variants} finished variant(s) kept in {out_dir}; rerun the same command to continue"), soft_wrap=True)
    elif batches:
        err_console.print(Text(f"interrupted: {batches} finished batch(es) of all variants kept in {out_dir / sweeps.PARTIAL_DIR}; rerun the same command to continue"), soft_wrap=True)
    else:
        err_console.print("interrupted before any variant finished")


def report(
    folders: list[Path] = typer.Argument(..., help="Results folders: prune sweeps, greedy curves (prune --greedy), angular-distance results, heal runs and curves, select, speculate, depth-use and depth-map results (several seeds of one model: means over seeds), speed results, checkpoints, lns-train runs."),
    out: Path = typer.Option(Path("report.md"), "--out", help="The Markdown page to write; its figures go to <name>_figures/ beside it."),
) -> None:
    """One Markdown page for several results folders: figures and tables side by side."""
    from depthcurse.report import kind_of, write_report  # lazy: start-up

    page = write_report(folders, out)
    kinds = [kind_of(f) for f in folders]
    console.print(f"wrote {page} ({', '.join(f'{kinds.count(k)} {k}' for k in dict.fromkeys(kinds))}) and its figures in {page.parent / (page.stem + '_figures')}")


def plot(
    folders: list[Path] = typer.Argument(..., help="prune result folders (each with prune.json), e.g. a Pre-LN decoder and a Post-LN encoder."),
    out: Path = typer.Option(Path("prune-overlay.png"), "--out", help="The figure (PNG)."),
) -> None:
    """Overlay prune sweeps on a relative depth axis (removed layer / number of layers) with the relative drop."""
    from depthcurse.prune import plot_prune_overlay  # lazy: start-up

    if out.is_dir():
        raise DepthcurseError(f"--out {out} is a folder: give the figure's file name, e.g. {out / 'overlay.png'}")
    if out.suffix.lower() != ".png":
        raise DepthcurseError(f"--out {out}: the figure is a PNG image, give a .png path")
    path = plot_prune_overlay(folders, out)
    console.print(f"wrote {path}")
