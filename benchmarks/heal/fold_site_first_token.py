"""Does a linear map folded into the block before a cut fail on the massive activation? (issue 58)

For a `heal --methods linear,linear-cosine` folder: each method's map, applied as `heal` applies it
(after the MLP output projection of the block before the cut), everywhere or everywhere but the
first token (where SmolLM2-135M's block 11 writes its massive activation); the share of the loss gap
won back on each text, and the relative error of the stream entering the block after the cut, at
the first token and at the others. docs/healing.md ("Checked against the authors' code") has the
figures, from:

    python benchmarks/heal/fold_site_first_token.py heal58-new --layers 12-15 --data wiki,lee.txt
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from depthcurse.heal.linear import output_projection
from depthcurse.loading import load_model
from depthcurse.surgery import find_blocks, parse_layers, removed_layers
from depthcurse.tasks import PerplexityTask
from depthcurse.text import load_texts


def stream_entering(model, block, ids) -> torch.Tensor:
    seen = {}
    hook = block.register_forward_pre_hook(lambda m, a, k: seen.__setitem__("x", (a[0] if a else k["hidden_states"]).detach().clone()), with_kwargs=True)
    try:
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
    finally:
        hook.remove()
    return seen["x"], F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("heal_dir", help="a `heal --methods linear,linear-cosine` results folder")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--layers", default="12-15", help="the removed run (one run)")
    parser.add_argument("--methods", default="linear,linear-cosine")
    parser.add_argument("--data", default="wiki,lee.txt")
    parser.add_argument("--windows", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args()
    loaded = load_model(args.model, dtype="fp32", device="cpu")
    model = loaded.model
    blocks = find_blocks(model).layers
    layers = parse_layers(args.layers, len(blocks))
    first, after = layers[0], layers[-1] + 1
    projection = output_projection(blocks[first - 1], f"layer {first - 1}")
    for data in args.data.split(","):
        texts, source = load_texts(data)
        ids = PerplexityTask(loaded.tokenizer, texts[len(texts) // 2:] if data == "wiki" else texts, source=source, seq_len=args.seq_len,
                             limit=args.windows).windows
        reference, unpruned = stream_entering(model, blocks[after], ids)
        with removed_layers(model, layers):
            _, pruned = stream_entering(model, find_blocks(model).layers[first], ids)
        print(f"{source}: unpruned {unpruned:.4f}, pruned {pruned:.4f}; |x| entering block {after}: first token "
              f"{reference[:, 0].norm(dim=-1).mean():,.0f}, the others {reference[:, 1:].norm(dim=-1).mean():,.0f}")
        for method in args.methods.split(","):
            t = torch.load(f"{args.heal_dir}/{method}/method.pt", weights_only=True)["state"]["maps"][str(first)]
            for skip_first in (False, True):
                def apply(module, inputs, out, t=t, skip_first=skip_first):
                    mapped = out @ t.to(out.dtype)
                    if skip_first:
                        mapped[:, 0] = out[:, 0]
                    return mapped

                hook = projection.register_forward_hook(apply)
                try:
                    with removed_layers(model, layers):
                        stream, healed = stream_entering(model, find_blocks(model).layers[first], ids)
                finally:
                    hook.remove()
                error = (stream - reference).norm(dim=-1) / reference.norm(dim=-1)
                print(f"  {method:14s} {'all but the first token' if skip_first else 'everywhere':24s} loss {healed:.4f}, won back "
                      f"{(pruned - healed) / (pruned - unpruned):+.1%}; relative error entering block {after}: first token "
                      f"{error[:, 0].mean():.3f}, the others {error[:, 1:].mean():.3f}")


if __name__ == "__main__":
    main()
