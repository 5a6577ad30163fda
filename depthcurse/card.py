"""A checkpoint that explains itself: `depthcurse.json` (how it was made, which `speed` reads to
find the model it came from) and `README.md`, the hub's model card. The card's front matter is
the hub's (`base_model`, `library_name: transformers`, tags, the source's licence where it is
known); its body says which layers of which model were removed and why, how the rest was
healed, what was measured (unpruned, pruned, healed; speed), and the command that makes it again.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from depthcurse import assets
from depthcurse.io import atomic_write, json_text

PROVENANCE = "depthcurse.json"
CARD = "README.md"
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def base_model_id(name: str, source: str) -> str | None:
    """The hub repository the checkpoint derives from, where there is one: an alias's hub id, a hub
    id typed as it is; a local folder's own `base_model` if it was made here; else None."""
    alias = assets.MODEL_ALIASES.get(name.lower())
    if alias is not None:
        return alias.hub_id
    if HUB_ID.match(name) and not Path(name).exists():
        return name
    made_here = Path(source).expanduser() / PROVENANCE
    if made_here.is_file():
        return json.loads(made_here.read_text()).get("base_model")
    return None


def weights_note(name: str, source: str) -> str | None:
    """What a reader of the card must know of the weights themselves: an alias's offline copy is
    not the hub's checkpoint its `base_model` names (SmolLM2's is dequantised from a 4-bit GGUF)."""
    asset = assets.MODEL_ALIASES.get(name.lower())
    if asset is None or Path(source).expanduser().resolve() != asset.local_path().resolve():
        return None
    return asset.notes


def licence_of(name: str, source: str) -> str | None:
    """The source's licence where it is known: an alias's, a local folder's card front matter, a
    checkpoint made here (its source's), or the hub's model card where the hub is reachable."""
    alias = assets.MODEL_ALIASES.get(name.lower())
    if alias is not None:
        return alias.licence.lower()
    folder = Path(source).expanduser()
    folder = folder.parent if folder.suffix == ".gguf" else folder
    if (folder / PROVENANCE).is_file():
        return json.loads((folder / PROVENANCE).read_text()).get("license")
    if (folder / CARD).is_file():
        return _front_matter(folder / CARD).get("license")
    if HUB_ID.match(name) and assets.hub_reachable():
        try:
            from huggingface_hub import model_info  # lazy: only a hub id's card is asked for

            data = model_info(name).card_data
            return getattr(data, "license", None) if data is not None else None
        except Exception:  # a card that cannot be read leaves the licence unknown, nothing else
            return None
    return None


def _front_matter(path: Path) -> dict:
    import yaml  # lazy: only cards are read

    text = path.read_text(encoding="utf-8", errors="replace")
    if not text.startswith("---"):
        return {}
    try:
        data = yaml.safe_load(text.split("---", 2)[1])
    except (yaml.YAMLError, IndexError):
        return {}
    return data if isinstance(data, dict) else {}


def provenance(loaded, removed: list[int], n_layers: int, *, why: str, made_by: str, command: str, layers_left: int | None = None,
               healing: dict | None = None, new_at: tuple[int, ...] = ()) -> dict:
    """How a checkpoint of `loaded` without `removed` was made. `new_at`: the source layers whose
    place a new layer took (a trained replacement). Each of the checkpoint's layers is traced to the
    layer of the source it came from (`layers_from`, None for a new one) and, where the source was
    itself made here, to the first model's (`root`): a `drop` of a `drop` names its layers in the
    numbering of the model the hub knows."""
    typed = Path(loaded.name).expanduser()
    load_as = loaded.name if loaded.name.lower() in assets.MODEL_ALIASES or not typed.exists() else str(typed.resolve())
    layers_from = [None if i in new_at else i for i in range(n_layers) if i not in removed or i in new_at]
    described = loaded.describe()
    record = {"made_by": made_by, "model": loaded.name, "load_as": load_as, "source": described["source"],
              "base_model": base_model_id(loaded.name, loaded.source), "weights": weights_note(loaded.name, loaded.source),
              "license": licence_of(loaded.name, loaded.source), "n_layers": n_layers, "removed_layers": list(removed),
              "layers_left": n_layers - len(removed) if layers_left is None else layers_left, "layers_from": layers_from, "why": why, "healing": healing,
              "command": command, "computed_in": f"{described['dtype']} ({loaded.dtype_why})" if loaded.dtype_why else described["dtype"]}
    parent = _made_here(loaded.source)
    if parent is not None:
        record["root"] = _root(parent, layers_from)
    return record


def _made_here(source: str) -> dict | None:
    path = Path(source).expanduser() / PROVENANCE
    return json.loads(path.read_text()) if path.is_file() else None


def _root(parent: dict, layers_from: list[int | None]) -> dict:
    """The first model this checkpoint descends from, and which of its layers it lacks."""
    if "root" in parent:
        root, parent_from_root = parent["root"], parent["root"]["layers_from"]
    else:
        root = {"model": parent["model"], "n_layers": parent["n_layers"]}
        parent_from_root = parent.get("layers_from") or [i for i in range(parent["n_layers"]) if i not in parent["removed_layers"]]
    from_root = [parent_from_root[j] if j is not None else None for j in layers_from]
    kept = {i for i in from_root if i is not None}
    return {"model": root["model"], "n_layers": root["n_layers"], "layers_from": from_root,
            "removed_layers": [i for i in range(root["n_layers"]) if i not in kept]}


def write_card(folder: Path, record: dict) -> Path:
    """`depthcurse.json` and `README.md` in `folder` (a saved checkpoint): `record` from
    `provenance`, with, where measured, `measured` (rows, header first, of the unpruned, pruned
    and healed model), `evaluation` (what the hub's model-index lists) and `speed` (rows, header
    first, of what the removal buys)."""
    folder = Path(folder)
    atomic_write(folder / PROVENANCE, json_text(record))
    adapters = ((record.get("healing") or {}).get("files") or {}).get("adapters")
    if adapters and (folder / adapters).is_dir():
        atomic_write(folder / adapters / CARD, adapter_card_text(record))  # in place of peft's empty template
    return atomic_write(folder / CARD, card_text(record))


def read_card(folder: Path) -> dict | None:
    """The provenance of a checkpoint made here (None for any other)."""
    path = Path(folder) / PROVENANCE
    return json.loads(path.read_text()) if path.is_file() else None


def add_speed(folder: Path, rows: list[tuple[str, ...]]) -> Path:
    """The card of a checkpoint made here, with what the removal buys added."""
    return write_card(folder, {**read_card(folder), "speed": rows})


def card_text(record: dict) -> str:
    """The hub's model card: its front matter made by huggingface_hub's `ModelCardData` (the
    measurements of the healed model as `model-index` evaluation results, which the hub shows),
    its body saying what was removed, how it was healed and what changed in the weights."""
    from huggingface_hub import EvalResult, ModelCardData  # lazy: only cards are written

    measured, speed, healing = record.get("measured"), record.get("speed"), record.get("healing")
    root = record.get("root")
    removed = root["removed_layers"] if root else record["removed_layers"]
    n_layers = root["n_layers"] if root else record["n_layers"]
    name = record.get("base_model") or (root or record)["model"]
    method = healing["method"] if healing else None
    tags = list(dict.fromkeys(["depthcurse", "layer-pruning", "pruned", *(["healed", *method.split("+")] if method else [])]))
    made = {"made_by": record["made_by"], "source": (root or record)["model"], "n_layers": n_layers, "removed_layers": removed,
            "layers_left": record["layers_left"], **({"method": method} if method else {}), **({"made_from": record["model"]} if root else {})}
    results = [EvalResult(task_type=e["task"], dataset_type=e["dataset"], dataset_name=e["dataset"], metric_type=e["metric"], metric_value=e["value"])
               for e in record.get("evaluation") or []]
    data = ModelCardData(base_model=record.get("base_model"), library_name="transformers", license=record.get("license"), tags=tags,
                         model_name=f"{name} without layers {_ranges(removed)}" if results else None, eval_results=results or None, depthcurse=made)
    files = (healing or {}).get("files") or {}
    loads = ("a normal `transformers` checkpoint (`AutoModelForCausalLM.from_pretrained` loads it)" if "patches" not in files else
             "a `transformers` checkpoint with a linear patch kept beside its weights (see below): `from_pretrained` alone loads it without the patch")
    lines = ["---", data.to_yaml().strip(), "---", "",
             f"# {name} without layers {_ranges(removed)}", "",
             f"`{name}` with {len(removed)} of its {n_layers} layers removed ({', '.join(map(str, removed))}): {record['layers_left']} "
             f"layers left, {loads}.", "",
             *([f"Made from `{record['model']}` (itself made by depthcurse) without its layers {_ranges(record['removed_layers'])}, in its own "
                "numbering; the layers above are the first model's.", ""] if root else []),
             f"**Why these layers:** {record['why']}", ""]
    if record.get("computed_in"):  # a card written before the dtype was recorded has none
        lines += [f"**Computed in:** {record['computed_in']}: the measurements below, and the choice where this tool made it.", ""]
    if record.get("weights"):
        lines += [f"**The weights:** {record['weights']}", ""]
    if healing:
        lines += ["## How it was healed", ""]
        if record.get("unchanged"):
            lines += [f"**Not healed:** {record['unchanged']}; this checkpoint is the plain removal.", ""]
        spec = healing.get("spec") or method
        lines += [f"By {healing.get('title') or method} (`--method {spec}`): {healing.get('how', '')}.", ""]
        if any(":" in part for part in spec.split("+")):
            lines += [f"**{method} is not one of depthcurse's methods:** `{spec}` names the file (or module) and the class that define it; "
                      "the command below makes this checkpoint again where that file is at that path (or that module imports).", ""]
        if healing.get("cost"):
            lines += [f"**What it cost:** {healing['cost']} (the method's own work: estimating, training; not the measurements).", ""]
        if healing.get("changes"):
            lines += [f"**What the checkpoint holds besides the removal:** {healing['changes']}.", ""]
        settings = healing.get("settings") or {}
        lines += [*[f"- {k.replace('_', ' ')}: {v}" for k, v in healing.items() if v is not None and k not in ("method", "title", "how", "changes", "files", "settings", "spec", "cost")],
                  *[f"- {k.replace('_', ' ')}: {v}" for k, v in _flat(settings).items()], ""]
    if measured:
        lines += ["## Measured", "", *_markdown(measured), ""]
        if record.get("measured_note"):
            lines += [record["measured_note"], ""]
    if speed:
        lines += ["## What the removal buys", "", *_markdown(speed), ""]
    if files.get("adapters"):
        lines += ["## The adapters", "", f"`{files['adapters']}/` holds the LoRA adapters in peft's format, {_adapters_text(record)}", ""]
    if files.get("patches"):
        lines += ["## The linear patch", "", f"`{files['patches']}` holds, for each cut, the matrix the residual stream is multiplied by where it enters "
                  "the layer after the cut (`before.<k>`: the pruned model's layer k; `before.final`: the final norm). `depthcurse` loads the folder with "
                  "the patch on; with transformers alone, add it as a forward pre-hook: "
                  "`model.model.layers[k].register_forward_pre_hook(lambda m, a, kw: ((a[0] @ P, *a[1:]), kw) if a else "
                  "(a, {**kw, 'hidden_states': kw['hidden_states'] @ P}), with_kwargs=True)`.", ""]
    lines += ["## Made with", "", "depthcurse made it, and this command makes it again:", "", "```bash", record["command"], "```", ""]
    return "\n".join(lines)


def _flat(settings: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in settings.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k} "))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _adapters_text(record: dict) -> str:
    removed = ",".join(map(str, record["removed_layers"]))
    return (f"numbered for the pruned model: on `depthcurse drop {record['model']} --layers {removed}`'s checkpoint, "
            f"`PeftModel.from_pretrained(model, this_folder, subfolder=\"{record['healing']['files']['adapters']}\")` gives this model.")


def adapter_card_text(record: dict) -> str:
    """The adapters' own card. No `base_model`: the hub would take the adapters for ones of the
    unpruned model, whose layers they do not number (their config names none either)."""
    import yaml  # lazy: only cards are written

    name = record.get("base_model") or record["model"]
    front = {"library_name": "peft", "tags": ["depthcurse", "layer-pruning", "lora"]}
    return "\n".join(["---", yaml.safe_dump(front, sort_keys=False).strip(), "---", "",
                      f"# LoRA adapters for {name} without layers {_ranges(record['removed_layers'])}", "",
                      f"The adapters `depthcurse heal` trained, numbered for the pruned model: on `depthcurse drop {record['model']} --layers "
                      f"{','.join(map(str, record['removed_layers']))}`'s checkpoint, `PeftModel.from_pretrained(model, this_folder)` gives the "
                      "healed model of the folder above, where they are also merged.",
                      "They do not fit the unpruned model: its layers after the first removed one have other numbers.", ""])


def _ranges(layers: list[int]) -> str:
    out, start = [], None
    for i, layer in enumerate(layers):
        if start is None:
            start = layer
        if i + 1 == len(layers) or layers[i + 1] != layer + 1:
            out.append(str(start) if start == layer else f"{start}-{layer}")
            start = None
    return ",".join(out)


def _markdown(rows: list[tuple[str, ...]]) -> list[str]:
    header, *body = rows
    cell = lambda text: str(text).replace("|", "\\|")  # noqa: E731
    return ["| " + " | ".join(map(cell, header)) + " |", "|" + "---|" * len(header), *("| " + " | ".join(map(cell, row)) + " |" for row in body)]
