"""Cost of `depthcurse angular-distance` against one bare forward pass over the same tokens.

Runs the real command (timed end to end, model loading and plots included), then, in this
process, the same batches through the same bare transformer with no hooks. Prints both and the
ratios, and apart from them what the identity-distance probes cost (`--identity-tokens`, 0 to
leave them out). Example (offline):

    DEPTHCURSE_CACHE=/tmp/dc_me .venv/bin/python benchmarks/angular_distance/angular_overhead.py smollm2-135m \
        --data wiki --tokens 65536 --out /tmp/ang
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default="smollm2-135m")
    parser.add_argument("--data", default="wiki")
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--token-position", default="last")
    parser.add_argument("--out", default="/tmp/ang")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--identity-tokens", type=int, default=1024)
    args = parser.parse_args()

    print(f"load average before: {os.getloadavg()}, cpus: {os.cpu_count()}", flush=True)
    cmd = [sys.executable, "-m", "depthcurse", "angular-distance", args.model, "--data", args.data, "--tokens", str(args.tokens),
           "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size), "--token-position", args.token_position,
           "--out", args.out, "--device", args.device, "--dtype", args.dtype, "--identity-tokens", str(args.identity_tokens)]
    print("$ " + " ".join(cmd), flush=True)
    started = time.perf_counter()
    proc = subprocess.run(cmd, env={**os.environ, "TQDM_DISABLE": "1"})
    cli_wall = time.perf_counter() - started
    if proc.returncode != 0:
        sys.exit(f"angular-distance failed with exit code {proc.returncode}")
    meta = json.loads((Path(args.out) / "angular.json").read_text())
    hooked = meta["seconds"]

    import torch

    from depthcurse.angular import measurement as diagnostics
    from depthcurse.loading import load_model
    from depthcurse.text import load_texts

    loaded = load_model(args.model, head="base", dtype=args.dtype, device=args.device)
    docs, _ = load_texts(args.data)
    data = diagnostics.tokenise_docs(loaded.tokenizer, docs, seq_len=args.seq_len, budget=args.tokens)
    batches = diagnostics.make_batches(data.sequences, args.batch_size, diagnostics.pad_id_of(loaded.tokenizer))
    assert data.tokens == meta["run"]["tokens_seen"], "not the same tokens as the command"
    bare = bare_forward(loaded.model, batches, device=loaded.device)
    if loaded.device.type == "cuda":
        torch.cuda.synchronize()

    print(f"load average after: {os.getloadavg()}")
    print(f"tokens: {data.tokens} in {len(batches)} batches of up to {args.batch_size} x {args.seq_len} ({loaded.device}, {loaded.dtype}, {torch.get_num_threads()} threads)")
    print(f"angular-distance command, wall (load + tokenise + measure + files): {cli_wall:8.2f} s")
    print(f"  of which the hooked forward passes + gram maths:                  {hooked:8.2f} s")
    print(f"one bare forward pass over the same batches, no hooks:               {bare:8.2f} s")
    print(f"ratio hooked measurement / bare forward: {hooked / bare:.3f}")
    print(f"ratio whole command / bare forward:      {cli_wall / bare:.3f}")
    identity = meta.get("identity") or {}
    if identity:
        print(f"identity distances, {identity['probes']} probes over {identity['tokens']} tokens: {identity['seconds']:8.2f} s "
              f"({identity['seconds'] / bare:.3f} of the bare forward over {data.tokens} tokens)")


def bare_forward(model, batches, device=None) -> float:
    """Seconds for the same forward passes without any hook (the cost baseline)."""
    import torch

    from depthcurse.angular.measurement import forward_module, run_forward

    module = forward_module(model)
    if device is None:
        device = model.get_input_embeddings().weight.device
    started = time.perf_counter()
    with torch.inference_mode():
        for ids, mask in batches:
            run_forward(module, ids, mask, device)
    return time.perf_counter() - started


if __name__ == "__main__":
    main()
