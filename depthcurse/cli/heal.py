"""`heal`: win back a removal (LoRA, a folded linear map, a trained layer), one method, several side by side, or along an order."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.progress import TextColumn
from rich.text import Text

from depthcurse.cli.shared import (
    SUITES_HELP, DeviceOpt, DtypeOpt, ModelArg, RevisionOpt, TrustOpt, console, err_console, interrupted, join_ranks, load,
    model_line, once, progress_bar, push, renamed, say, showing, slug, time_checkpoint, verdicts,
)
from depthcurse.errors import DepthcurseError
from depthcurse.granularity import check_granularity_taken, granularity_help
from depthcurse.io import claim_out_dir


def heal(
    model: str = ModelArg,
    layers: Optional[str] = typer.Option(None, "--layers", help="Layers to remove, e.g. 20-23 or 3,7 (whole layers).", show_default="none: give --layers or --order"),
    order: Optional[Path] = typer.Option(None, "--order", help="Instead of --layers: a healed depth curve along an earlier result's order (a prune --greedy, --block, angular-distance or prune folder), one heal per --ks.", show_default="off"),
    ks: Optional[str] = typer.Option(None, "--ks", help="With --order: numbers of layers removed, e.g. 2,4,8, or shares of the depth, e.g. 25%,50% (the first k of the order).", show_default="none: with --order, give --ks or --max-drop"),
    max_drop: Optional[str] = typer.Option(None, "--max-drop", help="With --order: find the largest k whose healed held-out loss stays within this share of the unpruned model's, e.g. 5% (a bisection over the order's prefixes, or over --ks).", show_default="off"),
    strategy: Optional[str] = typer.Option(None, "--strategy", help="With --order: which of its orders (greedy, one-shot, block-influence, angular, last; angular or deepest for an angular result).", show_default="the order's own"),
    method: Optional[str] = typer.Option(None, "--method", help="How the removal is won back (docs/methods.md; default lora): lora (adapters trained on text, Gromov et al.), linear (ReplaceMe's least-squares map, folded in), linear-cosine (ReplaceMe's cosine map), layer (a trained layer per removed run: LLM-Streamline), ffn (a trained FFN per run: LLM-Streamline), tune-last (the last kept layers and the head trained), prune-comp (Prune&Comp's magnitude compensation), linearpatch (LinearPatch), laco (merged into the layer before: LaCo's RDSC, as=paper or as=code), swm (merged: Sliding-Window Merging), a+b (one after the other, e.g. linear+lora), or your own: module:Class or file.py:Class."),
    methods: Optional[str] = typer.Option(None, "--methods", help="Instead of --method: several, side by side on the same removal, data and measurements, e.g. lora,linear,layer,linear+lora (each in <out>/<method>/; one this model cannot take is left out, with why)."),
    method_args: Optional[str] = typer.Option(None, "--method-args", help="The methods' own settings, key=value,... (lm-eval's --model_args form), e.g. ridge=0.1 or lora.lora_rank=16 for one method of several; docs/methods.md lists each method's.", show_default="each method's own (depthcurse settings)"),
    adapt: Optional[str] = typer.Option(None, "--adapt", help="lora: where the adapters go: all (every kept block, the default) or after (only the blocks after the first removed layer: those before run once per batch, without a backward pass)."),
    calib_tokens: Optional[int] = typer.Option(None, "--calib-tokens", help="linear, linear-cosine, prune-comp, linearpatch: tokens of the training text they estimate on (default 16384)."),
    ridge: Optional[float] = typer.Option(None, "--ridge", help="linear: pulls each map toward the identity (the plain removal); relative to the mean eigenvalue of its Gram matrix (default 0)."),
    loss: Optional[str] = typer.Option(None, "--loss", help="lora, tune-last: lm (next-token, as Gromov et al.; the default) or distill (KL from the unpruned model: the same weights, layers back, every change off)."),
    targets: Optional[str] = typer.Option(None, "--targets", help="lora: where the adapters go in each kept block: mlp (the paper's, the default), attn or all."),
    lora_rank: Optional[int] = typer.Option(None, "--lora-rank", help="lora: its rank (default 8)."),
    lora_alpha: Optional[float] = typer.Option(None, "--lora-alpha", help="lora: its alpha, the update scaled by alpha / rank (default 16)."),
    lora_dropout: Optional[float] = typer.Option(None, "--lora-dropout", help="lora: dropout on the adapters' input (default 0.05)."),
    calibration: Optional[str] = typer.Option(None, "--calibration", help="Text to heal on and to hold windows out of: auto (C4 where the hub is reachable, else wiki), c4, wiki, or a .txt/.jsonl/.parquet file.", show_default="auto"),
    data: Optional[str] = typer.Option(None, "--data", hidden=True, help="Now --calibration."),
    steps: int = typer.Option(100, "--steps", help="Optimizer steps."),
    batch_size: int = typer.Option(8, "--batch-size", help="Sequences per step."),
    micro_batch: Optional[int] = typer.Option(None, "--micro-batch", help="Sequences per forward and backward (default: the whole batch)."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="Tokens per sequence, BOS first where the tokenizer adds one (default 512, or the model's maximum if less)."),
    lr: float = typer.Option(2e-4, "--lr", help="Peak learning rate (AdamW, linear warm-up, cosine decay to a tenth)."),
    warmup: Optional[int] = typer.Option(None, "--warmup", help="Warm-up steps (default: a tenth of --steps)."),
    eval_windows: int = typer.Option(32, "--eval-windows", help="Held-out windows (of --seq-len tokens, from documents never trained on) the models are measured on."),
    eval_data: Optional[str] = typer.Option(None, "--eval-data", help="Also measure on --eval-windows windows of text of another source (wiki, c4, a file): what a method won back beyond the text it healed on.", show_default="off"),
    task: Optional[str] = typer.Option(None, "--task", "-t", help="Also measure on this task: any lm-eval task prune takes (arc_easy, mmlu, ...), or " + SUITES_HELP + ".", show_default="off"),
    limit: Optional[int] = typer.Option(None, "--limit", help="--task: examples per subtask (default all)."),
    num_fewshot: int = typer.Option(0, "--num-fewshot", help="--task: few-shot examples in each prompt."),
    granularity: str = typer.Option("layer", "--granularity", help=granularity_help("heal") + " Only whole blocks are healed for now."),
    seed: int = typer.Option(1234, "--seed", help="Seed of the adapters' initial weights, the data order and dropout."),
    save_every: int = typer.Option(25, "--save-every", help="Steps between resumable checkpoints."),
    report_to: str = typer.Option("none", "--report-to", help="Also send the training's metrics.jsonl rows, as they happen, to: none, tensorboard, wandb, or both (comma separated; W&B offline unless an API key is set up): one run per method's folder."),
    out: Optional[Path] = typer.Option(None, "--out", help="Run folder (default runs/heal/<model>/<layers or order>-<loss>)."),
    speed: bool = typer.Option(False, "--speed", help="Also measure what the removal buys (depthcurse speed): the healed checkpoint against its source, in speed.json and the model card."),
    push_to_hub: Optional[str] = typer.Option(None, "--push-to-hub", help="Also upload the healed checkpoint (hf/, with its card and adapters) to this hub repository.", show_default="off"),
    private: bool = typer.Option(False, "--private", help="With --push-to-hub: make the repository private."),
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
    trust_remote_code: bool = TrustOpt,
    revision: Optional[str] = RevisionOpt,
) -> None:
    """Remove layers, win the removal back by a method (LoRA, a folded linear map, a trained layer or FFN, a compensation, a patch, your own), and measure what came back: the model unpruned, pruned and healed. Rerun to resume."""
    from dataclasses import replace  # lazy: start-up

    from depthcurse import heal as healing
    from depthcurse.runtime import rank_gpus
    from depthcurse.surgery import num_layers, parse_layers

    data = renamed("heal", "--data", data, calibration, "auto")
    check_granularity_taken("heal", granularity)
    if (layers is None) == (order is None):
        raise DepthcurseError("give --layers L (the layers to remove), or --order DIR with --ks K,K,... (a healed depth curve), not both")
    if max_drop is not None and order is None:
        raise DepthcurseError("--max-drop searches an order for the largest k within the budget: give --order DIR")
    if order is not None and ks is None and max_drop is None:
        raise DepthcurseError("--order DIR takes --ks K,K,... (a healed depth curve) or --max-drop 5% (the largest k within a budget)")
    if ks is not None and order is None:
        raise DepthcurseError("--ks and --order go together: the first k layers of the order, for each k")
    budget = healing.parse_share(max_drop) if max_drop is not None else None
    if (speed or push_to_hub is not None) and (order is not None or (methods is not None and len(healing.parse_methods(methods)) > 1)):
        raise DepthcurseError("--speed and --push-to-hub take the one healed checkpoint of --layers L with one --method")
    if push_to_hub is not None:
        from depthcurse.hub import check_repo

        check_repo(push_to_hub)
    if strategy is not None and order is None:
        raise DepthcurseError("--strategy picks one of the orders in --order DIR")
    chosen = healing.parse_methods(methods) if methods is not None else None
    if chosen is not None and method is not None:
        raise DepthcurseError(f"give --method M or --methods M,M,..., not both (--method {method} with --methods {methods})")
    method = method or "lora"
    args = healing.method_args(method_args, loss=loss, targets=targets, lora_rank=lora_rank, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
                               adapt=adapt, calib_tokens=calib_tokens, ridge=ridge)
    cfg = healing.HealConfig(layers=(), method=chosen[0] if chosen else method, method_args=args, data=data, steps=steps, batch_size=batch_size,
                             micro_batch=micro_batch, seq_len=seq_len, lr=lr, warmup=warmup, eval_windows=eval_windows, eval_data=eval_data, task=task,
                             limit=limit, num_fewshot=num_fewshot, seed=seed, save_every=save_every, report_to=report_to)
    if chosen is None or len(chosen) == 1:
        cfg.resolved()  # every option checked before a model is loaded
    else:
        healing.check_settings(cfg, chosen)
    several = chosen is not None and len(chosen) > 1
    if ks is not None:
        healing.parse_ks(ks)  # checked now; shares of the depth become numbers once the model is loaded
    how = "-".join(chosen) if chosen else method
    along = f"order-{slug(str(order))}-" + (f"k{ks.replace(',', '-').replace('%', 'pc')}" if ks else f"within{max_drop.replace('%', 'pc')}") if order else ""
    tag = slug(f"{along or 'L' + layers.replace(',', '_')}-{how}" + (f"-{loss}" if loss else ""))
    out_dir = out or Path("runs") / "heal" / slug(model) / tag
    claim_out_dir(out_dir)
    world = join_ranks(device, "ddp")
    try:
        import torch  # lazy: start-up

        gpus = rank_gpus()[:1] if world.parallel and device != "cpu" and torch.cuda.is_available() else None  # DDP: one GPU per rank
        from depthcurse.heal.loop import FP32_ON_CPU

        options = dict(head="causal-lm", dtype=dtype, device=device, trust_remote_code=trust_remote_code, revision=revision, gpus=gpus, fp32_on_cpu=FP32_ON_CPU,
                       not_encoder="heal trains a decoder's next-token predictions: give a decoder (Llama, Qwen, Mistral, SmolLM2...)")
        loaded = load(model, **options)
        n = num_layers(loaded.model)
        if order is not None:
            sets, source = healing.order_sets(order, healing.parse_ks(ks, n) if ks is not None else None, n, strategy)
        progress = progress_bar(TextColumn("{task.fields[stats]}"), disable=not world.main)
        bar = progress.add_task("starting", total=None, stats="")
        header = once(lambda: console.print(f"{model_line(loaded)} · heal by {', '.join(chosen or (method,))} · results in {out_dir}"))

        def on_start(info: dict) -> None:
            header()
            progress.update(bar, total=info["steps"], completed=info["start_step"])

        callbacks = dict(on_start=on_start, on_phase=lambda text: progress.update(bar, description=text), on_note=lambda text: say("note", text),
                         on_progress=lambda p: progress.update(bar, completed=p.step, stats=f"loss {p.loss:.4f} · lr {p.lr:.2e} · {p.tokens_per_s:,.0f} tok/s"))
        if several:
            def on_method(m: str, i: int, total: int) -> None:
                header()
                progress.console.print(f"  method {m} ({i + 1} of {total})")

            callbacks["on_method"] = on_method
        load_again = lambda: load(model, **options)  # noqa: E731 (each heal changes the model it is given)
        try:
            with showing(progress):
                if budget is not None:
                    record = healing.heal_within(loaded, load_again, cfg, sets, source, out_dir, budget, world=world,
                                                 on_point=lambda k, i, total: progress.console.print(f"trying k = {k} (bisection step {i + 1} of at most {total}): "
                                                                                                     f"layers {','.join(map(str, sets[k]))}"),
                                                 **callbacks)
                elif order is not None:
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
                interrupted(healing.kept_summary(out_dir))
            raise typer.Exit(130)
        if record is None:  # another rank: rank 0 measures and writes
            return
        if order is not None:
            figure = healing.plot_heal_curve(record, out_dir / "heal.png")
            console.print(healing.curve_table(record))
            if "budget" in record:
                console.print(f"[bold]within {record['budget']['max_drop']:.1%}:[/] {record['budget']['why']}")
            console.print(f"wrote {out_dir / healing.HEAL_JSON}, {figure}, and each k's run in {out_dir}/kNNN/" + ("<method>/" if several else ""))
        elif several:
            console.print(healing.methods_table(record))
            verdicts(healing.heal_verdicts(record))
            console.print(f"wrote {out_dir / healing.HEAL_JSON} and each method's run, with its healed checkpoint hf/, in {out_dir}/<method>/")
            if record.get("refused"):  # the table says which and why; the exit code says not every method ran
                err_console.print(Text(f"not every method ran: {', '.join(record['refused'])} could not (heal.json's refused says why)"), soft_wrap=True)
                raise typer.Exit(1)
        else:
            console.print(healing.heal_table(record))
            verdicts(healing.heal_verdicts(record))
            console.print(f"wrote {out_dir / healing.HEAL_JSON}, {out_dir / 'metrics.jsonl'}, {out_dir / 'loss.png'} and the healed checkpoint {record['hf']} "
                          f"({record['hf_dtype']}, {record['hf_bytes'] / 1e6:,.1f} MB, with its model card)")
            if speed:
                del loaded  # the source is loaded again beside the checkpoint, in the dtype both are timed in
                time_checkpoint(Path(record["hf"]), out_dir, device=device, dtype=dtype, trust_remote_code=trust_remote_code)
            if push_to_hub is not None:
                push(Path(record["hf"]), push_to_hub, private)
    finally:
        world.close()
