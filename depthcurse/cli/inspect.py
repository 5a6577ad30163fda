"""`angular-distance`: the per-layer diagnostics of a model, and the angular pass `prune --block` and `--greedy` make."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from depthcurse.cli.shared import (
    DeviceOpt, DtypeOpt, ModelArg, RevisionOpt, TrustOpt, console, decoders_only, interrupted, load, measure_angular, renamed, slug,
)
from depthcurse.errors import DepthcurseError
from depthcurse.io import claim_out_dir


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
    out_dir = out or Path("runs") / "angular" / slug(model)
    claim_out_dir(out_dir)
    loaded = load(model, head="base", dtype=dtype, device=device, trust_remote_code=trust_remote_code, revision=revision)
    max_n = angular.check_max_n(max_n, num_layers(loaded.model))
    result = measure_angular(loaded, out_dir, data=data, tokens=tokens, seq_len=seq_len, batch_size=batch_size, position=token_position, max_n=max_n,
                              identity_tokens=identity_tokens, probes=probes)
    result.run["normalize"] = normalize
    paths = angular.write_angular(result, out_dir)
    paths.append(angular.plot_angular(result, out_dir / "angular.png", normalize=normalize))
    paths.append(angular.plot_layers(result, out_dir / "layers.png"))
    console.print(angular.angular_table(result))
    console.print(angular.massive_summary(result))
    console.print(f"wrote {', '.join(str(p) for p in paths)}")


def depth_use(
    model: str = ModelArg,
    data: str = typer.Option("wiki", "--data", help="auto (C4, or wiki offline), c4, wiki, code, math, dialogue, or a .txt/.jsonl/.parquet file."),
    windows: int = typer.Option(16, "--windows", help="Windows of the text (the intervals are over them)."),
    seq_len: int = typer.Option(256, "--seq-len", help="Tokens per window."),
    batch_size: int = typer.Option(4, "--batch-size", help="Windows per forward pass."),
    influence: bool = typer.Option(True, "--influence/--no-influence", help="Also skip each layer in turn (about n / 2 passes more) for the influence matrix."),
    tuned_lens: bool = typer.Option(False, "--tuned-lens", help="Also train a tuned lens (one affine translator per layer) on other windows of the text, "
                                    "read beside the logit lens on the measured ones; saved as tuned_lens.safetensors in --out."),
    lens: Optional[Path] = typer.Option(None, "--lens", help="Read a tuned lens saved by an earlier run on this model instead of training one.", show_default="trained here"),
    lens_steps: int = typer.Option(250, "--lens-steps", help="The tuned lens's SGD steps (Belrose et al.'s 250)."),
    calib_windows: Optional[int] = typer.Option(None, "--calib-windows", help="Windows the tuned lens is fitted on (default: as many as --windows)."),
    lens_windows: Optional[int] = typer.Option(None, "--lens-windows", hidden=True, help="Now --calib-windows."),
    seed: int = typer.Option(42, "--seed", help="Seed of the order the tuned lens takes its windows in (Belrose et al.'s --seed)."),
    lens_embedding: bool = typer.Option(True, "--lens-embedding/--no-lens-embedding", help="The tuned lens's translator of the embedding's output, "
                                        "trained and clipped with the others, as Belrose et al.'s code does (--no-lens-embedding: without it)."),
    definitions: str = typer.Option("depthcurse", "--as", help="Whose definitions: depthcurse (ours: the stream after each layer, KL(output || lens), "
                                    "means with intervals) or csordas (Csordás et al.'s code: the stream entering each layer, KL(lens || output), "
                                    "top-5 overlap, the first token never skipped, maxima, the output's probability change). docs/depth-use.md has the table."),
    agree_with: Optional[list[Path]] = typer.Option(None, "--agree-with", help="A select run of this model (repeatable): each measure's rank "
                                                    "correlation with its layers' removal costs and picks.", show_default="off"),
    out: Optional[Path] = typer.Option(None, "--out", help="Results folder (default runs/depth-use/<model>)."),
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
    trust_remote_code: bool = TrustOpt,
    revision: Optional[str] = RevisionOpt,
) -> None:
    """How a model uses its depth, per layer: what each sublayer adds to the residual stream, where the
    logit lens settles, and whose later work a skipped layer changes (Csordás et al. 2025; --as csordas: their code's own quantities).

    Example: depthcurse depth-use smollm2-135m --data wiki --windows 16 --seq-len 256 [--tuned-lens]"""
    from depthcurse import depth  # lazy: start-up
    from depthcurse.cli.shared import join_ranks, model_line, progress_bar, say, showing, verdicts
    from depthcurse.depth.definitions import find_definitions

    chosen = find_definitions(definitions)  # before any work: an unknown name is one line
    lens_windows = renamed("depth-use", "--lens-windows", lens_windows, calib_windows, None)
    selects = depth.read_selects(agree_with or [])  # before any work: a folder that holds no select run is one line
    out_dir = claim_out_dir(out or Path("runs") / "depth-use" / slug(model))
    world = join_ranks(device)  # under torchrun the influence matrix's skips are shared over the ranks; rank 0 talks and writes
    try:
        from depthcurse.depth.tuned_lens import FP32_ON_CPU

        loaded = load(model, dtype=dtype, device=device, trust_remote_code=trust_remote_code, revision=revision,
                      fp32_on_cpu=FP32_ON_CPU if tuned_lens or lens is not None else None, not_encoder=decoders_only("depth-use"))
        progress = progress_bar()
        bar = progress.add_task("starting", total=None)
        kept = out_dir / depth.KEPT_FILE
        try:
            with showing(progress):
                record = depth.run_depth_use(loaded, data, windows, seq_len, batch_size, influence=influence, tuned=tuned_lens, lens=lens,
                                             lens_windows=lens_windows, lens_settings=depth.LensSettings(steps=lens_steps, embedding=lens_embedding, seed=seed),
                                             lens_out=out_dir / depth.LENS_FILE if world.main else None, world=world, definitions=chosen,
                                             on_note=lambda text: say("note", text) if world.main else None, kept=kept,
                                             on_step=lambda text, done, total: progress.update(bar, description=text, completed=done, total=total))
        except KeyboardInterrupt:
            interrupted(depth.kept_summary(out_dir))
            raise typer.Exit(130)
    finally:
        world.close()
    if not world.main:
        return
    if selects:
        record["agreement"] = depth.agreement(record, selects)
    console.print(model_line(loaded))
    console.print(depth.depth_table(record))
    if selects:
        console.print(depth.agreement_table(record))
    verdicts(depth.depth_verdicts(record))
    paths = depth.write_depth(record, out_dir) + [depth.plot_settling(record, out_dir / "settling.png")]
    figure = depth.plot_influence(record, out_dir / "influence.png")
    if figure is not None:
        paths.append(figure)
    console.print(f"wrote {', '.join(str(p) for p in paths)}")


def depth_map(
    shallow: str = typer.Argument(..., help="The shallower model (a hub name, an alias such as smollm2-135m, or a folder)."),
    deep: str = typer.Argument(..., help="The deeper model, of the same tokenizer."),
    data: str = typer.Option("wiki", "--data", help="auto (C4, or wiki offline), c4, wiki, code, math, dialogue, or a .txt/.jsonl/.parquet file."),
    calib_windows: Optional[int] = typer.Option(None, "--calib-windows", help="Windows the maps are fitted on.",
                                                show_default="16, or as many as give twice the shallow stream's width + 1 tokens where it is wider"),
    min_fit_ratio: float = typer.Option(1.0, "--min-fit-ratio", help="The fewest fitting tokens per input of a map (the shallow stream's width + 1) "
                                        "accepted; below 1 a map is under-determined (the minimum-norm one, which cannot recover even the identity), "
                                        "said before any work."),
    eval_windows: Optional[int] = typer.Option(None, "--eval-windows", help="Other windows they are scored on (the intervals are over them).", show_default="8"),
    windows: Optional[int] = typer.Option(None, "--windows", hidden=True, help="Now --calib-windows."),
    held_out: Optional[int] = typer.Option(None, "--held-out", hidden=True, help="Now --eval-windows."),
    seed: int = typer.Option(0, "--seed", help="--as csordas: the seed of the map's initial weights and the order of its windows."),
    seq_len: int = typer.Option(128, "--seq-len", help="Tokens per window."),
    batch_size: int = typer.Option(4, "--batch-size", help="Windows per forward pass."),
    definitions: str = typer.Option("depthcurse", "--as", help="Whose map: depthcurse (ours: ridge least squares per pair of layers, held-out R^2 "
                                    "per dimension and pooled) or csordas (Csordás et al.'s code: one trained linear map from each shallow stream to "
                                    "every deep stream, scored by the relative error)."),
    score: Optional[str] = typer.Option(None, "--score", help="The score that picks each best match: r2_dims (default: every dimension alike) or "
                                        "r2 (pooled: a dimension counts by its variance); csordas: relative_error."),
    map_steps: int = typer.Option(10000, "--map-steps", help="--as csordas: the map's AdamW steps (their stop_after, 10,000; batches of 64 windows, or every fitting window where there are fewer)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Results folder (default runs/depth-map/<shallow>-to-<deep>)."),
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
    trust_remote_code: bool = TrustOpt,
    revision: Optional[str] = RevisionOpt,
    deep_revision: Optional[str] = typer.Option(None, "--deep-revision", help="The deeper model's hub revision (branch, tag or commit).",
                                                show_default="the default branch"),
) -> None:
    """Which layers of a deeper model each layer of a shallower one maps to (Csordás et al. 2025,
    Section 5): a linear map between every pair of layers' streams, scored on held-out windows.

    Example: depthcurse depth-map runs/train/tiny-6/hf runs/train/tiny-12/hf --data wiki"""
    from depthcurse.cli.shared import progress_bar, say, showing, verdicts
    from depthcurse.depth import map_report
    from depthcurse.depth.csordas_map import MapSettings

    windows = renamed("depth-map", "--windows", windows, calib_windows, None)
    held_out = renamed("depth-map", "--held-out", held_out, eval_windows, 8)
    settings = MapSettings(steps=map_steps, seed=seed)
    settings.check()
    out_dir = claim_out_dir(out or Path("runs") / "depth-map" / f"{slug(shallow)}-to-{slug(deep)}")
    small = load(shallow, dtype=dtype, device=device, trust_remote_code=trust_remote_code, revision=revision, not_encoder=decoders_only("depth-map"))
    large = load(deep, dtype=dtype, device=device, trust_remote_code=trust_remote_code, revision=deep_revision, not_encoder=decoders_only("depth-map"))
    progress = progress_bar()
    bar = progress.add_task("starting", total=None)
    try:
        with showing(progress):
            record = map_report.run_depth_map(small, large, data, windows, held_out, seq_len, batch_size, definitions=definitions, score=score,
                                              settings=settings, kept=out_dir / map_report.KEPT_FILE, on_note=lambda text: say("note", text),
                                              min_fit_ratio=min_fit_ratio,
                                              on_step=lambda text, done, total: progress.update(bar, description=text, completed=done, total=total))
    except KeyboardInterrupt:
        interrupted(map_report.kept_summary(out_dir))
        raise typer.Exit(130)
    console.print(map_report.map_table(record))
    verdicts(map_report.map_verdicts(record))
    paths = map_report.write_map(record, out_dir)
    console.print(f"wrote {', '.join(str(p) for p in paths)}")
