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
               healing: dict | None = None) -> dict:
    """How a checkpoint of `loaded` without `removed` was made."""
    typed = Path(loaded.name).expanduser()
    load_as = loaded.name if loaded.name.lower() in assets.MODEL_ALIASES or not typed.exists() else str(typed.resolve())
    return {"made_by": made_by, "model": loaded.name, "load_as": load_as, "source": loaded.describe()["source"],
            "base_model": base_model_id(loaded.name, loaded.source), "weights": weights_note(loaded.name, loaded.source),
            "license": licence_of(loaded.name, loaded.source), "n_layers": n_layers, "removed_layers": list(removed),
            "layers_left": n_layers - len(removed) if layers_left is None else layers_left, "why": why, "healing": healing, "command": command}


def write_card(folder: Path, record: dict) -> Path:
    """`depthcurse.json` and `README.md` in `folder` (a saved checkpoint): `record` from
    `provenance`, with, where measured, `measured` (rows, header first, of the unpruned, pruned
    and healed model) and `speed` (rows, header first, of what the removal buys)."""
    folder = Path(folder)
    atomic_write(folder / PROVENANCE, json_text(record))
    adapters = (record.get("healing") or {}).get("adapters")
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
    import yaml  # lazy: only cards are written

    measured, speed = record.get("measured"), record.get("speed")
    healing = record.get("healing")
    tags = ["depthcurse", "layer-pruning", "pruned"] + (["healed", healing["method"]] if healing else [])
    if healing and healing["method"] in ("lora", "linear+lora"):
        tags.append("lora")
    tags = list(dict.fromkeys(tags))
    made = {"made_by": record["made_by"], "source": record["model"], "n_layers": record["n_layers"], "removed_layers": record["removed_layers"],
            "layers_left": record["layers_left"], **({"method": healing["method"]} if healing else {})}
    front = {k: v for k, v in (("base_model", record.get("base_model")), ("library_name", "transformers"), ("license", record.get("license")),
                               ("tags", tags), ("depthcurse", made)) if v is not None}
    removed = record["removed_layers"]
    name = record.get("base_model") or record["model"]
    lines = ["---", yaml.safe_dump(front, sort_keys=False).strip(), "---", "",
             f"# {name} without layers {_ranges(removed)}", "",
             f"`{name}` with {len(removed)} of its {record['n_layers']} layers removed ({', '.join(map(str, removed))}): {record['layers_left']} "
             f"layers left, a normal `transformers` checkpoint (`AutoModelForCausalLM.from_pretrained` loads it).", "",
             f"**Why these layers:** {record['why']}", ""]
    if record.get("weights"):
        lines += [f"**The weights:** {record['weights']}", ""]
    if healing:
        lines += ["## How it was healed", "", *[f"- {k.replace('_', ' ')}: {v}" for k, v in healing.items() if v is not None and k != "adapters"], ""]
    if measured:
        lines += ["## Measured", "", *_markdown(measured), ""]
    if speed:
        lines += ["## What the removal buys", "", *_markdown(speed), ""]
    if healing and healing.get("adapters"):
        lines += ["## The adapters", "", f"`{healing['adapters']}/` holds the LoRA adapters in peft's format, {_adapters_text(record)}", ""]
    lines += ["## Made with", "", "depthcurse made it, and this command makes it again:", "", "```bash", record["command"], "```", ""]
    return "\n".join(lines)


def _adapters_text(record: dict) -> str:
    removed = ",".join(map(str, record["removed_layers"]))
    return (f"numbered for the pruned model: on `depthcurse drop {record['model']} --layers {removed}`'s checkpoint, "
            f"`PeftModel.from_pretrained(model, this_folder, subfolder=\"{record['healing']['adapters']}\")` gives this model.")


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
