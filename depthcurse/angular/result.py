"""What `angular-distance` measured, written and read back in one place: the angular distance
between every pair of depths, the per-layer statistics, and the blocks they single out."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from depthcurse.errors import DepthcurseError
from depthcurse.io import atomic_write, csv_text, json_text

ANGULAR_JSON = "angular.json"
# Sun et al. (2024, "Massive Activations in Large Language Models"): an activation is massive when
# its magnitude is over 100 and about 1,000 times the median magnitude of its layer's activations.
MASSIVE_MAGNITUDE = 100.0
MASSIVE_RATIO = 1000.0


def massive_activation(max_abs: list[float], median: list[float], channel: list[int], position: list[int], token: list[int],
                       token_text: list[str] | None = None) -> dict:
    """Per depth l (the stream x_l entering block l; x_L after the last block): the largest |activation|
    over the median, whether it is massive (Sun et al.'s two thresholds), and the blocks that write
    one: block l writes one when x_{l+1} holds a massive activation that x_l did not (none there, or
    in another channel). The first such block is where the model makes it; a cut or a fold there
    takes it out of the stream or changes it."""
    ratio = [m / d if d > 0 else float("inf") for m, d in zip(max_abs, median)]
    massive = [m > MASSIVE_MAGNITUDE and r > MASSIVE_RATIO for m, r in zip(max_abs, ratio)]
    writers = [l for l in range(len(max_abs) - 1) if massive[l + 1] and (not massive[l] or channel[l] != channel[l + 1])]
    first = next((l for l, m in enumerate(massive) if m), None)
    out = {"definition": f"|x| > {MASSIVE_MAGNITUDE:g} and > {MASSIVE_RATIO:g} x the median |activation| of the stream x_l (Sun et al. 2024)",
           "ratio": ratio, "massive": massive, "writers": writers, "first_depth": first}
    if first is not None:
        out.update(written_by=first - 1 if first > 0 else None, value=max_abs[first], median=median[first], channel=channel[first],
                   position=position[first] if position else None, token=token[first] if token else None,
                   token_text=token_text[first] if token_text else None)
    return out


@dataclass
class AngularResult:
    num_layers: int
    max_n: int
    position: str
    pairwise: list[list[float]]  # [L+1][L+1]: mean d(x_i, x_j)
    samples: int  # tokens averaged in the angular matrix
    stat_tokens: int  # real tokens behind the per-layer statistics
    block_influence: list[float]  # [L]
    relative_update: list[float]  # [L]
    norm: list[float]  # [L+1]
    variance: list[float]  # [L+1]
    sequences: int = 0
    seconds: float = 0.0
    run: dict = field(default_factory=dict)
    variance_bulk: list[float] = field(default_factory=list)  # [L+1]: per-token variance without its largest channels
    max_activation: list[float] = field(default_factory=list)  # [L+1]: the largest |activation| at each depth
    max_channel: list[int] = field(default_factory=list)  # [L+1]: its channel
    max_position: list[int] = field(default_factory=list)  # [L+1]: the position of its token in its sequence
    max_token: list[int] = field(default_factory=list)  # [L+1]: that token's id (-1: not recorded)
    median_activation: list[float] = field(default_factory=list)  # [L+1]: the median |activation| (mean over batches)
    max_token_text: list[str] = field(default_factory=list)  # [L+1]: that token as text (where a tokenizer was at hand)
    identity: dict | None = None  # depthcurse.identity.IdentityDistances.to_json(): identity distance and branch gains per block

    def massive(self) -> dict | None:
        """`massive_activation` of this measurement (None for a result written before it was measured)."""
        if not self.median_activation:
            return None
        return massive_activation(self.max_activation, self.median_activation, self.max_channel, self.max_position, self.max_token,
                                  self.max_token_text)

    def distance(self, l: int, n: int) -> float:
        return self.pairwise[l][l + n]

    def matrix(self) -> list[list[float | None]]:
        """matrix[n-1][l] = d(x_l, x_{l+n}) for n = 1..max_n, l = 0..L-1; None where l+n > L."""
        L = self.num_layers
        return [[self.distance(l, n) if l + n <= L else None for l in range(L)] for n in range(1, self.max_n + 1)]

    def best_blocks(self) -> list[dict]:
        """For each n, l* = argmin_l d(x_l, x_{l+n}): the n blocks l*..l*+n-1 that change the stream least."""
        out = []
        for n in range(1, self.max_n + 1):
            candidates = [(self.distance(l, n), l) for l in range(self.num_layers - n + 1)]
            d, l = min(candidates)
            out.append({"n": n, "l": l, "layers": f"{l}-{l + n - 1}" if n > 1 else str(l), "distance": d})
        return out

    def block_choices(self, n: int) -> list["BlockChoice"]:
        """The two n-layer blocks `prune --block n` compares: the one angular distance picks
        (l* = argmin_l d(x_l, x_{l+n})) and the n deepest layers before the final one, the
        rule of thumb the heuristic has to beat."""
        L = self.num_layers
        if not 1 <= n <= L - 1:
            raise DepthcurseError(f"--block {n} is out of range: the model has {L} layers (use 1-{L - 1}; the final layer is kept)")
        if n > self.max_n:
            raise DepthcurseError(f"--block {n} exceeds the angular result's max n ({self.max_n}); measure it with a larger --max-n")
        best = min((self.distance(l, n), l) for l in range(L - n + 1))[1]
        deepest = L - 1 - n
        return [
            BlockChoice("angular", tuple(range(best, best + n)), self.distance(best, n)),
            BlockChoice("deepest", tuple(range(deepest, deepest + n)), self.distance(deepest, n)),
        ]

    def angular_rows(self) -> list[dict]:
        return [
            {"l": l, "n": n, "distance": self.distance(l, n), "count": self.samples}
            for n in range(1, self.max_n + 1)
            for l in range(self.num_layers - n + 1)
        ]

    def layer_rows(self) -> list[dict]:
        rows = []
        ident = self.identity or {}

        def per_block(values, l):
            return None if values is None or l >= len(values) else values[l]

        massive = self.massive()
        ratios = massive["ratio"] if massive else None

        for l in range(self.num_layers + 1):
            last = l == self.num_layers
            rows.append({
                "l": l,
                "block_influence": None if last else self.block_influence[l],
                "relative_update": None if last else self.relative_update[l],
                "norm": self.norm[l],
                "variance": self.variance[l],
                "variance_bulk": per_block(self.variance_bulk, l),
                "max_activation": per_block(self.max_activation, l),
                "max_channel": per_block(self.max_channel, l),
                "max_position": per_block(self.max_position, l),
                "max_token": per_block(self.max_token, l),
                "median_activation": per_block(self.median_activation, l),
                "max_over_median": per_block(ratios, l),
                "writes_massive": None if last or massive is None else l in massive["writers"],
                "identity_distance": per_block(ident.get("identity_distance"), l),
                "attn_gain": per_block(ident.get("attn_gain"), l),
                "mlp_gain": per_block(ident.get("mlp_gain"), l),
                "count": self.stat_tokens,
            })
        return rows

    def to_json(self) -> dict:
        return {
            "run": self.run,
            "num_layers": self.num_layers,
            "max_n": self.max_n,
            "token_position": self.position,
            "samples": self.samples,
            "sequences": self.sequences,
            "seconds": self.seconds,
            "definition": "d(x_l, x_{l+n}) = arccos(cos(x_l, x_{l+n}))/pi, x_l = input of block l, x_L = output of the last block before the final norm",
            "matrix_index": "matrix[n-1][l] = d(x_l, x_{l+n}); null where l+n > L",
            "matrix": self.matrix(),
            "pairwise": self.pairwise,
            "best_blocks": self.best_blocks(),
            "layers": {
                "block_influence": self.block_influence,
                "relative_update": self.relative_update,
                "norm": self.norm,
                "variance": self.variance,
                "variance_bulk": self.variance_bulk,
                "max_activation": self.max_activation,
                "max_channel": self.max_channel,
                "max_position": self.max_position,
                "max_token": self.max_token,
                "median_activation": self.median_activation,
                "max_token_text": self.max_token_text,
                "tokens": self.stat_tokens,
            },
            "massive_activation": self.massive(),
            "identity": self.identity,
        }


@dataclass(frozen=True)
class BlockChoice:
    rule: str  # "angular" or "deepest"
    layers: tuple[int, ...]
    distance: float  # d(x_first, x_first+n) measured on the unpruned model

    @property
    def label(self) -> str:
        return f"{self.layers[0]}-{self.layers[-1]}" if len(self.layers) > 1 else str(self.layers[0])


def load_angular(path) -> AngularResult:
    """An `angular.json` written by `depthcurse angular-distance` (or `prune --block`), read back."""
    path = Path(path)
    if path.is_dir():
        path = path / ANGULAR_JSON
    try:
        data = json.loads(path.read_text())
        layers = data["layers"]
        return AngularResult(
            num_layers=data["num_layers"], max_n=data["max_n"], position=data["token_position"],
            pairwise=data["pairwise"], samples=data["samples"], stat_tokens=layers["tokens"],
            block_influence=layers["block_influence"], relative_update=layers["relative_update"],
            norm=layers["norm"], variance=layers["variance"], sequences=data.get("sequences", 0),
            seconds=data.get("seconds", 0.0), run=data.get("run", {}),
            variance_bulk=layers.get("variance_bulk", []), max_activation=layers.get("max_activation", []),
            max_channel=layers.get("max_channel", []), max_position=layers.get("max_position", []), max_token=layers.get("max_token", []),
            median_activation=layers.get("median_activation", []), max_token_text=layers.get("max_token_text", []), identity=data.get("identity"),
        )
    except FileNotFoundError as exc:
        raise DepthcurseError(f"no angular-distance result at {path}: run `depthcurse angular-distance` first") from exc
    except (ValueError, KeyError, TypeError) as exc:
        raise DepthcurseError(f"{path} is not a depthcurse angular.json ({type(exc).__name__}: {exc})") from exc


def write_angular(result: AngularResult, out_dir: Path) -> list[Path]:
    """angular.csv (l, n, distance, count), angular.json (everything) and layers.csv."""
    out_dir = Path(out_dir)
    paths = [out_dir / "angular.csv", out_dir / ANGULAR_JSON, out_dir / "layers.csv"]
    atomic_write(paths[0], csv_text(result.angular_rows()))
    atomic_write(paths[1], json_text(result.to_json()))
    atomic_write(paths[2], csv_text(result.layer_rows()))
    return paths
