"""`select`: calibration text x objective x search, each cell's choice judged on the same held-out measurements."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from depthcurse.cli.shared import DeviceOpt, DtypeOpt, ModelArg, RevisionOpt, TrustOpt, console, load, model_line, progress_bar, say, showing, slug


def _names(text: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))


def select(
    model: str = ModelArg,
    k: int = typer.Option(4, "--k", help="Layers each cell removes."),
    calibration: str = typer.Option("wiki", "--calibration", help="Texts to choose on, comma-separated: wiki, c4 or a .txt/.jsonl/.parquet file; each is also held out and judged on."),
    objective: str = typer.Option("ppl", "--objective", help="What greedy and one-shot minimise on the calibration windows, comma-separated: ppl (next-token loss) and/or kl (KL from the unpruned model)."),
    search: str = typer.Option("greedy,angular", "--search", help="How the k layers are found, comma-separated: greedy, one-shot (the k cheapest single removals), angular (Gromov et al.'s block), bi (ShortGPT's Block Influence)."),
    calib_windows: int = typer.Option(8, "--calib-windows", help="Windows of each text the choice is made on."),
    eval_windows: int = typer.Option(16, "--eval-windows", help="Other windows of each text every choice is judged on."),
    seq_len: int = typer.Option(128, "--seq-len", help="Tokens per window."),
    batch_size: int = typer.Option(4, "--batch-size", help="Windows per forward pass."),
    task: Optional[str] = typer.Option(None, "--task", help="Also judge every choice on this task (probes, commonsense, an lm-eval task), by prune's reuse engine."),
    limit: Optional[int] = typer.Option(None, "--limit", help="With --task: examples per task."),
    seed: int = typer.Option(1234, "--seed", help="Seed of the split into calibration and held-out windows."),
    out: Optional[Path] = typer.Option(None, "--out", help="Results folder (default runs/select/<model>)."),
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
    trust_remote_code: bool = TrustOpt,
    revision: Optional[str] = RevisionOpt,
) -> None:
    """Does the calibration or the search decide which layers go? Each calibration text x objective x
    search chooses k layers; every choice is judged on the same held-out windows (and --task); the
    overlap of the choices and a two-way decomposition of the held-out scores say which decided."""
    from depthcurse.select import SELECT_JSON, SelectConfig, plot_select, run_select, select_table, write_csv

    cfg = SelectConfig(k=k, calibration=_names(calibration), objectives=_names(objective), searches=_names(search), calib_windows=calib_windows,
                       eval_windows=eval_windows, seq_len=seq_len, batch_size=batch_size, task=task, limit=limit, seed=seed)
    cfg.checked()  # the options alone, before a model loads (k against its layers after)
    loaded = load(model, dtype=dtype, device=device, trust_remote_code=trust_remote_code, revision=revision)
    console.print(model_line(loaded))
    out = out or Path("runs/select") / slug(model)
    progress = progress_bar()
    bar = progress.add_task("starting", total=None)
    with showing(progress):
        record = run_select(loaded, cfg, out, on_phase=lambda text: progress.update(bar, description=text, completed=0, total=None),
                            on_step=lambda label, done, total: progress.update(bar, description=label, completed=done, total=total))
    console.print(select_table(record))
    written = [out / SELECT_JSON, write_csv(record, out / "select.csv"), plot_select(record, out / "select.png")]
    say("written", ", ".join(map(str, written)), "green")
