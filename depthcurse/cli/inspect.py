"""`angular-distance`: the per-layer diagnostics of a model, and the angular pass `prune --block` and `--greedy` make."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from depthcurse.cli.shared import (
    DeviceOpt, DtypeOpt, ModelArg, RevisionOpt, TrustOpt, console, load, measure_angular, slug,
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
