"""Save a published shape with random weights in bf16, with SmolLM2's tokenizer, as a checkpoint
folder that `depthcurse prune` loads like any other: the way to time a 7B sweep end to end where
no 7B checkpoint can be downloaded. Timings depend on shapes, not values; its scores mean nothing.

    python benchmarks/prune/save_shape.py llama-2-7b /root/l7b --device cuda      # 21 s on an H100
    depthcurse prune /root/l7b --task mmlu --dtype bf16
"""

from __future__ import annotations

import argparse
import time

import torch
from sweep_shapes import SHAPES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokenizer", default="smollm2-135m", help="a name or a folder")
    args = parser.parse_args()

    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from depthcurse import assets

    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(assets.resolve_model(args.tokenizer))
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # initialised in place: a 7B model never exists in fp32
    with torch.device(args.device):
        model = LlamaForCausalLM(LlamaConfig(**{**SHAPES[args.shape], "vocab_size": len(tokenizer)}, attn_implementation="sdpa"))
    torch.set_default_dtype(torch.float32)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(f"saved {args.shape} (random weights, bf16) to {args.out} in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
