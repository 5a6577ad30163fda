"""`speculate`: the model drafts for itself with blocks skipped; the output stays the whole model's."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.text import Text

from depthcurse.cli.shared import (DeviceOpt, DtypeOpt, ModelArg, RevisionOpt, TrustOpt, console, decoders_only, err_console, join_ranks, load, model_line, once,
                                   progress_bar, say, showing, slug, verdicts)
from depthcurse.errors import DepthcurseError
from depthcurse.io import claim_out_dir


def _names(text: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in text.split(",") if p.strip() and p.strip() != "none")


def speculate(
    model: str = ModelArg,
    skip: Optional[str] = typer.Option(None, "--skip", help="Required, or --skip-from. What the draft skips: blocks, e.g. 12-15 or 3,7,20-25 (the draft is the model without them), or attention and MLP branches, e.g. a3,m7,a10-12 (Draft & Verify's and SWIFT's drafts).", show_default="none"),
    skip_from: Optional[Path] = typer.Option(None, "--skip-from", help="Required, or --skip. A select run's folder, whose pick the draft skips (the best by acceptance, else speedup, KL, loss).", show_default="none"),
    also_skip: Optional[list[str]] = typer.Option(None, "--also-skip", help="Another self-draft on the same prompts (repeatable), its acceptance set against the first's, paired over the prompts.", show_default="off"),
    also_skip_from: Optional[list[Path]] = typer.Option(None, "--also-skip-from", help="Another self-draft from a select run's pick (repeatable), as --also-skip.", show_default="off"),
    draft_tokens: Optional[int] = typer.Option(None, "--draft-tokens", help="Tokens the draft proposes a round (gamma): every round with --draft-length fixed, at most with confidence, the first round with heuristic; at most --max-new-tokens - 1 (a larger one is capped, and said).", show_default="4"),
    draft_length: str = typer.Option("fixed", "--draft-length", help="fixed; confidence (Draft & Verify's: stop after a token the draft is less sure of than a threshold that adapts); heuristic (transformers': 2 more after a fully accepted round, 1 fewer otherwise)."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", help="Tokens generated per prompt at most (an end-of-sequence token stops it sooner)."),
    prompts: str = typer.Option("suite", "--prompts", help="suite (offline prompts of four kinds: dialogue, code, math, summary), a text source (wiki, c4, code, math, dialogue: each document a prompt, whole) or a file: .jsonl ('text', each prompt exactly as written) or .txt (prompts between blank lines, each trimmed of its leading and trailing newlines: give .jsonl to keep a chat prompt's closing newline)."),
    per_kind: int = typer.Option(4, "--per-kind", help="Prompts of each kind of the suite."),
    kinds: str = typer.Option("dialogue,code,math,summary", "--kinds", help="Kinds of the suite, comma-separated."),
    baselines: str = typer.Option("early-exit,prompt-lookup", "--baselines", help="Other drafts on the same prompts: early-exit (as many blocks skipped, the last ones), prompt-lookup (n-grams of the sequence), or none."),
    assistant: Optional[str] = typer.Option(None, "--assistant", help="A smaller model of the same tokenizer as a draft too, in this loop and in transformers' own assisted decoding.", show_default="off"),
    sample: bool = typer.Option(False, "--sample", help="Sample at --temperature instead of greedy decoding (speculative sampling: the same distribution, not the same tokens)."),
    temperature: float = typer.Option(1.0, "--temperature", help="With --sample: the temperature (above 0)."),
    ngram: int = typer.Option(2, "--ngram", help="Prompt lookup's longest n-gram matched."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Generate --max-new-tokens on every prompt, past an end-of-sequence token."),
    seed: int = typer.Option(1234, "--seed", help="Sampling seed (each prompt's: this plus its index)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Results folder (default runs/speculate/<model>)."),
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
    trust_remote_code: bool = TrustOpt,
    revision: Optional[str] = RevisionOpt,
) -> None:
    """Self-speculative decoding: the model without some blocks drafts tokens, the whole model checks
    them in one pass. Greedy output equals model.generate's on every prompt (checked); against
    decoding alone, timed in turns: acceptance, the draft's cost, measured and expected speedup."""
    from depthcurse.speculate import POLICIES, SpeculateConfig

    if (skip is None) == (skip_from is None):
        raise DepthcurseError("give the blocks the draft skips: --skip LAYERS, or --skip-from a select run's folder (one of the two)")
    if sample and not temperature > 0:
        raise DepthcurseError(f"--sample with --temperature {temperature:g}: sampling needs a temperature above 0 (greedy decoding is the default)")
    if draft_length not in POLICIES:
        raise DepthcurseError(f"unknown --draft-length {draft_length!r}: use {', '.join(POLICIES)}")
    if draft_tokens is not None and draft_tokens < 1:
        raise DepthcurseError(f"--draft-tokens must be at least 1, got {draft_tokens}")
    cfg = SpeculateConfig(skip=(), draft_tokens=SpeculateConfig.draft_tokens if draft_tokens is None else draft_tokens, draft_length=draft_length, max_new_tokens=max_new_tokens, prompts=prompts, per_kind=per_kind,
                          kinds=_names(kinds), baselines=_names(baselines), assistant=assistant, temperature=temperature if sample else 0.0, ngram=ngram,
                          stop_at_eos=not ignore_eos, seed=seed).checked()
    capped = cfg.capped(draft_tokens) if draft_tokens is not None else None  # the default is capped silently: the user asked for no length
    if capped:
        err_console.print(Text(capped), soft_wrap=True)
    if prompts != "suite":
        from depthcurse.speculate import load_prompts

        load_prompts(prompts, per_kind)  # an unreadable file is the one line said, before a model loads
    picked = None
    if skip_from is not None or also_skip_from:
        from depthcurse.select.picks import draft_pick

        picked = draft_pick(skip_from) if skip_from is not None else None
        others = [draft_pick(folder) for folder in also_skip_from or []]
    else:
        others = []
    out = claim_out_dir(out or Path("runs/speculate") / slug(model))
    world = join_ranks(device)
    try:
        _speculate(model, cfg, skip, picked, out, world, also=(list(also_skip or []), others), dtype=dtype, device=device,
                   trust_remote_code=trust_remote_code, revision=revision)
    finally:
        world.close()


def _speculate(model, cfg, skip, picked, out: Path, world, also=([], []), **options) -> None:
    import dataclasses

    import torch

    from depthcurse.runtime import rank_gpus
    from depthcurse.select.picks import checked_pick
    from depthcurse.speculate import SPECULATE_JSON, kind_table, run_speculate, speculate_table, speculate_verdicts, write_speculate_files
    from depthcurse.speculate.run import FP32_ON_CPU, parse_skip
    from depthcurse.surgery import num_layers

    gpus = rank_gpus() if world.parallel and options["device"] != "cpu" and torch.cuda.is_available() else None
    options["fp32_on_cpu"] = FP32_ON_CPU
    loaded = load(model, **options, gpus=gpus, not_encoder=decoders_only("speculate"))
    n = num_layers(loaded.model)
    if picked is not None:
        cfg = dataclasses.replace(cfg, skip=checked_pick(picked, loaded.describe(), n, "--skip-from"), skip_from=picked[1])
    else:
        cfg = dataclasses.replace(cfg, skip=parse_skip(skip, n))
    typed, read = also
    read = [checked_pick(pick, loaded.describe(), n, "--also-skip-from") for pick in read]
    cfg = dataclasses.replace(cfg, also=tuple(parse_skip(t, n) for t in typed) + tuple(read))  # checked with the model by run_speculate
    helper = load(cfg.assistant, **options, gpus=gpus) if cfg.assistant else None
    header = once(lambda: console.print(model_line(loaded) + f" · drafting without {', '.join(map(str, cfg.skip))} · results in {out}"))
    progress = progress_bar()
    bar = progress.add_task("starting", total=None)

    def on_step(label: str, done: int, total: int) -> None:
        header()
        progress.update(bar, description=label, completed=done, total=total)

    try:
        with showing(progress):
            record = run_speculate(loaded, cfg, out, assistant=helper, on_step=on_step, world=world, on_note=lambda text: say("note", text))
    except KeyboardInterrupt:
        path = out / SPECULATE_JSON
        said = f"every finished prompt is in {path}; rerun the same command to continue" if path.exists() else "no prompt had finished"
        err_console.print(Text(f"interrupted: {said}"), soft_wrap=True)
        raise typer.Exit(130)
    if not world.main:
        return
    header()
    console.print(speculate_table(record))
    console.print(kind_table(record))
    verdicts(speculate_verdicts(record))
    written = [out / SPECULATE_JSON, *write_speculate_files(record, out)]
    say("written", ", ".join(map(str, written)), "green")
