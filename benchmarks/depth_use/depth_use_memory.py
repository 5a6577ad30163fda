"""depth-use's peak memory beyond the weights, measured against `depth.memory`'s estimate (issue 80).

A model of a real model's shape with random weights (memory depends on shapes alone: no checkpoint
is needed, offline), one batch of `--batch-size` windows of `--seq-len` tokens measured with the
influence matrix (the peak is a batch's), the process's peak resident memory above what it held
after loading, read from the kernel (ru_maxrss). glibc keeps freed large blocks for reuse unless
they were mmapped, which would make the peak the allocator's rather than the tensors', so the
script reruns itself with MALLOC_MMAP_THRESHOLD_ set (large blocks mmapped, returned on free).

    python benchmarks/depth_use/depth_use_memory.py --shape qwen2.5-0.5b                    # measure (minutes on 2 cores)
    python benchmarks/depth_use/depth_use_memory.py --shape qwen2.5-0.5b --shape-only        # the estimate alone
    python benchmarks/depth_use/depth_use_memory.py --shape llama-3-8b --shape-only          # a 128k vocabulary, 32 layers
    python benchmarks/depth_use/depth_use_memory.py --shape qwen2.5-0.5b --code-from DIR     # an older checkout's depthcurse, same measurement
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys

SHAPES = {  # hidden, intermediate, layers, heads, kv heads, vocab (their configs)
    "smollm2-135m": (576, 1536, 30, 9, 3, 49152),
    "qwen2.5-0.5b": (896, 4864, 24, 14, 2, 151936),
    "llama-3-8b": (4096, 14336, 32, 32, 8, 128256),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    parser.add_argument("--batch-size", type=int, default=4)  # depth-use's defaults
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--shape-only", action="store_true", help="print the estimate and build nothing")
    parser.add_argument("--code-from", help="measure another checkout's depthcurse (its folder)")
    args = parser.parse_args()
    if not args.shape_only and os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
        if args.code_from:
            env["PYTHONPATH"] = args.code_from
        sys.exit(subprocess.call([sys.executable, *sys.argv], env=env))

    import psutil
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden, intermediate, layers, heads, kv, vocab = SHAPES[args.shape]
    b, t = args.batch_size, args.seq_len
    print(f"{args.shape}: {layers} layers, width {hidden}, vocabulary {vocab:,}; batch {b} x {t} tokens, float32")
    try:
        from depthcurse.depth.memory import Shape, gib, lens_bytes, measuring_bytes
    except ImportError:  # an older checkout (--code-from): no estimate to print
        def gib(n: float) -> str:
            return f"{n / 2**30:.1f} GiB"
    else:
        shape = Shape(layers, hidden, vocab)
        print(f"estimate: measuring {gib(measuring_bytes(shape, b, t))}, tuned lens training (micro-batch 4) {gib(lens_bytes(shape, 4, t))}")
    if args.shape_only:
        return
    from depthcurse.depth.measure import measure_depth_use

    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv, vocab_size=vocab, max_position_embeddings=4096, tie_word_embeddings=args.shape != "llama-3-8b")
    model = Qwen2ForCausalLM(config).eval()
    ids = torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(1))
    loaded = psutil.Process().memory_info().rss
    measure_depth_use(model, ids, b, influence=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"measured: peak {gib(peak - loaded)} above the {gib(loaded)} held after loading (weights {gib(sum(p.numel() * 4 for p in model.parameters()))})"
          f"{' (code from ' + args.code_from + ')' if args.code_from else ''}")


if __name__ == "__main__":
    main()
