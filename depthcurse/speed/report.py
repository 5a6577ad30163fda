"""What a removal buys, on screen and in the report: each figure of the unpruned and the pruned
model, their ratio, and the floor the removal could reach."""

from __future__ import annotations

import json
from pathlib import Path

from rich.table import Table

from depthcurse.errors import DepthcurseError
from depthcurse.io import atomic_write, json_text

SPEED_JSON = "speed.json"


def write_speed(record: dict, out_dir: Path) -> Path:
    return atomic_write(Path(out_dir) / SPEED_JSON, json_text(record))


def read_speed(folder: Path) -> dict:
    path = Path(folder)
    path = path / SPEED_JSON if path.is_dir() else path
    try:
        record = json.loads(path.read_text())
        record["models"]["pruned"]
        return record
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DepthcurseError(f"{folder} holds no speed result ({SPEED_JSON}): {exc}") from None


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _x(value) -> str:
    return "-" if value is None else f"{value:.3f}x"


def speed_rows(record: dict) -> list[tuple[str, str, str, str, str]]:
    """(figure, unpruned, pruned, pruned / unpruned, floor) for each figure."""
    u, p, ratios, floor, cfg = record["models"]["unpruned"], record["models"]["pruned"], record["ratios"], record["floor"], record["config"]

    def spread(s: dict, scale: float = 1.0, unit: str = "") -> str:
        return f"{s['median'] * scale:,.2f}{unit} ({s['min'] * scale:,.2f}-{s['max'] * scale:,.2f})"

    rows = [("layers", str(u["layers"]), str(p["layers"]), _x(p["layers"] / u["layers"]), ""),
            (f"prefill, {cfg['prefill_batch']} x {cfg['prefill_len']} tokens: tokens/s", f"{u['prefill']['tokens_per_s']:,.0f}",
             f"{p['prefill']['tokens_per_s']:,.0f}", _x(ratios["prefill_tokens_per_s"]), f"{1 / floor['prefill_time']:.3f}x"),
            ("prefill: seconds, median (min-max)", spread(u["prefill"]["seconds"]), spread(p["prefill"]["seconds"]), _x(ratios["prefill_time"]),
             _x(floor["prefill_time"]))]
    for b in cfg["decode_batches"]:
        rows.append((f"decoding, batch {b}, {cfg['new_tokens']} tokens after {cfg['prompt_len']}: ms per token, median (min-max)",
                     spread(u["decode"][str(b)]["seconds_per_token"], 1e3), spread(p["decode"][str(b)]["seconds_per_token"], 1e3),
                     _x(ratios[f"decode_time_b{b}"]), _x(floor["decode_time"])))
    rows += [("parameters", f"{u['params']:,}", f"{p['params']:,}", _x(ratios["params"]), _x(floor["params"])),
             ("peak memory in prefill: weights + the rise", _mib(u["weight_bytes"] + u["prefill"]["peak_rise_bytes"]),
              _mib(p["weight_bytes"] + p["prefill"]["peak_rise_bytes"]), _x(ratios["peak_memory_prefill"]), ""),
             ("KV cache: bytes per token", f"{u['kv_bytes_per_token']:,.0f}", f"{p['kv_bytes_per_token']:,.0f}", _x(ratios["kv_bytes_per_token"]),
              _x(floor["kv_bytes_per_token"]))]
    return rows


def speed_table(record: dict) -> Table:
    run = record.get("run", {})
    table = Table(title=f"what the removal buys: {run.get('pruned', 'pruned')} against {run.get('unpruned', 'unpruned')} ({record['device']}, "
                        f"{run.get('dtype', '')}), {record['config']['repeats']} alternated repeats",
                  caption=f"floor: the share of the arithmetic (time) or of the parameters and the KV cache the pruned model keeps. {record['includes']}",
                  header_style="bold")
    for header in ("figure", "unpruned", "pruned", "pruned / unpruned", "floor"):
        table.add_column(header, justify="left" if header == "figure" else "right")
    for row in speed_rows(record):
        table.add_row(*row)
    return table
