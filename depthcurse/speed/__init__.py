"""`speed`: what a removal buys. The unpruned model against the pruned one in one process, in
turns: prefill tokens/s, decoding time per token with the KV cache, peak memory, parameters, KV
bytes per token, their ratios, and the floor the removal could reach (`measure`); the table and
the record (`report`). `speed_in_memory` removes the layers from the model in memory (no copy);
`speed_against` times two loaded models; `speed_checkpoint` a checkpoint `drop` or `heal` saved
against the model it came from, end to end (its source loaded, the record written, and the table
added to its card where every time ratio is a finding). `paired` says when a ratio is one."""

from __future__ import annotations

import functools
from pathlib import Path

from depthcurse.card import CARD, PROVENANCE, add_speed, read_card
from depthcurse.errors import DepthcurseError
from depthcurse.loading import load_model
from depthcurse.speed.measure import MODELS, SpeedConfig, as_is, measure_speed, parse_batches
from depthcurse.speed.report import HEADER, SPEED_JSON, distrusted, read_speed, speed_rows, speed_table, write_speed
from depthcurse.surgery import removed_layers

__all__ = ["made_here", "made_from", "SpeedConfig", "MODELS", "measure_speed", "parse_batches", "speed_in_memory", "speed_against", "speed_checkpoint",
           "SPEED_JSON", "read_speed", "write_speed", "speed_rows", "speed_table", "distrusted"]


def made_here(folder: Path) -> tuple[Path, dict] | None:
    """(the checkpoint folder, how it was made) for a checkpoint `drop` or `heal` saved (or a
    heal run's folder, whose `hf/` it is); None for any other folder."""
    for candidate in (Path(folder), Path(folder) / "hf"):
        record = read_card(candidate)
        if record is not None:
            return candidate, record
    return None


def made_from(folder: Path) -> tuple[Path, dict]:
    found = made_here(folder)
    if found is None:
        raise DepthcurseError(f"{folder} holds no checkpoint made by depthcurse drop or heal ({PROVENANCE}): give a model and --layers")
    return found


def speed_in_memory(loaded, layers, cfg: SpeedConfig, **options) -> dict:
    """`loaded` with and without `layers` (removed in memory, no weight copied), in turns."""
    as_model = {"unpruned": functools.partial(as_is, loaded.model), "pruned": functools.partial(removed_layers, loaded.model, tuple(layers))}
    record = measure_speed(as_model, loaded.device, cfg, len(loaded.tokenizer) if loaded.tokenizer is not None else loaded.model.config.vocab_size, **options)
    record["run"] = {"unpruned": loaded.name, "pruned": f"{loaded.name} without layers {','.join(map(str, layers))}", "removed": list(layers),
                     "dtype": str(loaded.dtype).removeprefix("torch."), **{k: v for k, v in loaded.describe().items() if k != "dtype"}}
    return record


def speed_against(base, pruned, cfg: SpeedConfig, **options) -> dict:
    """Two loaded models, the source `base` and a checkpoint made from it, in turns."""
    as_model = {"unpruned": functools.partial(as_is, base.model), "pruned": functools.partial(as_is, pruned.model)}
    vocab = min(base.model.config.vocab_size, pruned.model.config.vocab_size)
    record = measure_speed(as_model, base.device, cfg, vocab, **options)
    record["run"] = {"unpruned": base.name, "pruned": pruned.name, "dtype": str(base.dtype).removeprefix("torch."), "model": base.name,
                     "source": base.describe()["source"], "checkpoint": pruned.describe()["source"]}
    return record


def speed_checkpoint(checkpoint: Path, out_dir: Path, cfg: SpeedConfig, *, device: str = "auto", dtype: str = "auto", trust_remote_code: bool = False,
                     on_step=None, clock=None) -> dict:
    """`checkpoint` (made by drop or heal, or a heal run's folder) against the model it came from,
    in turns: the record, written to `out_dir`/speed.json, and into the checkpoint's card only
    where every time ratio passed its checks (`record["card"]`: the card written, or None).
    `clock`: as `measure_speed`'s."""
    folder, made = made_from(checkpoint)
    options = dict(dtype=dtype, device=device, trust_remote_code=trust_remote_code)
    base, pruned = load_model(made.get("load_as") or made["model"], **options), load_model(str(folder), **options)
    record = speed_against(base, pruned, cfg, on_step=on_step, clock=clock)
    removed = made["removed_layers"]
    record["run"].update(removed=removed, pruned=f"{made['model']} without layers {','.join(map(str, removed))} ({folder})")
    record["card"] = str(folder / CARD) if record["trusted"] else None
    write_speed(record, out_dir)
    if record["trusted"]:
        add_speed(folder, [HEADER, *speed_rows(record)])
    return record
