"""What a removal buys, on screen and in the report: each figure of the unpruned and the pruned
model, their ratio with its interval, the shares of layers, arithmetic and bytes it could reach,
and its verdict."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from depthcurse.errors import DepthcurseError
from depthcurse.io import atomic_write, json_text, read_record, record_path

SPEED_JSON = "speed.json"


def write_speed(record: dict, out_dir: Path) -> Path:
    return atomic_write(Path(out_dir) / SPEED_JSON, json_text(record))


def read_speed(folder: Path) -> dict:
    record = read_record(folder, SPEED_JSON, "speed result", needs=("models", "pruned"))
    if "checks" not in record:
        raise DepthcurseError(f"{record_path(folder, SPEED_JSON)} was written before speed judged its ratios (no intervals, no verdicts): run depthcurse speed again")
    return record


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _x(value) -> str:
    return "-" if value is None else f"{value:.3f}x"


HEADER = ("figure", "unpruned", "pruned", "pruned / unpruned (95% interval)", "share kept: layers · arithmetic · bytes", "verdict")


def _check(record: dict, key: str) -> tuple[str, str, str]:
    """(the ratio and its interval, the shares, the verdict) of one time ratio."""
    check, share = record["checks"][key], record["shares"][key]
    interval = check["interval"]
    ratio = f"{check['median']:.3f}x" + (f" ({interval[0]:.3f}-{interval[1]:.3f})" if interval else " (no interval)")
    shares = " · ".join(f"{share[name]:.3f}" for name in ("layers", "arithmetic", "bytes"))
    verdict = f"near the {check['regime']} share" if check["status"] == "ok" else f"{check['status'].upper()}"
    return ratio, shares, verdict


def speed_rows(record: dict) -> list[tuple[str, ...]]:
    """(figure, unpruned, pruned, pruned / unpruned, shares kept, verdict) for each figure."""
    u, p, ratios, cfg = record["models"]["unpruned"], record["models"]["pruned"], record["ratios"], record["config"]

    def spread(s: dict, scale: float = 1.0) -> str:
        return f"{s['median'] * scale:,.2f} ({s['min'] * scale:,.2f}-{s['max'] * scale:,.2f})"

    rows = [("layers", str(u["layers"]), str(p["layers"]), _x(p["layers"] / u["layers"]), "", ""),
            (f"prefill, {cfg['prefill_batch']} x {cfg['prefill_len']} tokens: tokens/s", f"{u['prefill']['tokens_per_s']:,.0f}",
             f"{p['prefill']['tokens_per_s']:,.0f}", _x(ratios["prefill_tokens_per_s"]), "", ""),
            ("prefill: seconds, median (min-max)", spread(u["prefill"]["seconds"]), spread(p["prefill"]["seconds"]), *_check(record, "prefill_time"))]
    for b in cfg["decode_batches"]:
        rows.append((f"decoding, batch {b}, {cfg['new_tokens']} tokens after {cfg['prompt_len']}: ms per token, median (min-max)",
                     spread(u["decode"][str(b)]["seconds_per_token"], 1e3), spread(p["decode"][str(b)]["seconds_per_token"], 1e3),
                     *_check(record, f"decode_time_b{b}")))
    rows += [("parameters", f"{u['params']:,}", f"{p['params']:,}", _x(ratios["params"]), "", ""),
             ("peak memory in prefill: weights + the rise", _mib(u["weight_bytes"] + u["prefill"]["peak_rise_bytes"]),
              _mib(p["weight_bytes"] + p["prefill"]["peak_rise_bytes"]), _x(ratios["peak_memory_prefill"]), "", ""),
             ("KV cache: bytes per token", f"{u['kv_bytes_per_token']:,.0f}", f"{p['kv_bytes_per_token']:,.0f}", _x(ratios["kv_bytes_per_token"]),
              f"{record['floor']['kv_bytes_per_token']:.3f} (layers)", "")]
    return rows


def distrusted(record: dict) -> list[str]:
    """One line per time ratio that is not a finding, saying why."""
    return [f"{key.replace('_', ' ')}: {check['status']}: {check['reason']}" for key, check in record["checks"].items() if check["status"] != "ok"]


def speed_table(record: dict) -> Table:
    run, cfg = record.get("run", {}), record["config"]
    pairs = max(c["pairs"] for c in record["checks"].values())
    table = Table(title=f"what the removal buys: {run.get('pruned', 'pruned')} against {run.get('unpruned', 'unpruned')} ({record['device']}, "
                        f"{run.get('dtype', '')}), {pairs} pairs in turns" + ("" if record["trusted"] else ": NOT TRUSTED, see the verdicts"),
                  caption=f"each time ratio is the median of the pairs' ratios, with a 95% interval for it; steady within +-{cfg['tolerance']:.0%}, "
                          "else UNSTABLE (so is one whose interval crosses the floor or 1); an interval wholly below the share of the layers kept (the floor: "
                          f"every block's cost goes with it) or wholly above 1, IMPOSSIBLE. The share of the arithmetic or bytes a ratio is near says what bounds it. {record['includes']}",
                  header_style="bold")
    for header in HEADER:
        table.add_column(header, justify="left" if header in ("figure", "verdict") else "right")
    for row in speed_rows(record):
        table.add_row(*row)
    return table
