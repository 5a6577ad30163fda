"""What `depth-use` costs against one forward pass that keeps the streams (issue 73's speed goals).

In one process, on the same windows, in turns (A B A B, `--rounds` of each): the model's own forward
with `output_hidden_states=True` (the pass that keeps every stream), `measure_depth_use` without the
influence matrix (the per-layer report: branches, the logit lens at every layer, settling), and,
once, the influence matrix alone. Prints the medians, the ratios, and the blocks the influence
matrix steps, counted (sum over skipped layers i of the n - 1 - i blocks after it, per window) and
as forward passes' worth (n - 1) / 2. The logit lens runs the head at every layer; the head's share
of a pass (`select.estimate.head_blocks`: its parameters over a block's) says how much of the
report's cost that is. `--against FILE` times another version of `depth/measure.py` (an older
checkout's) against this one instead, in turns, on the same windows, with the influence matrix: what a
change to the measurement costs. Example (offline):

    python benchmarks/depth_use/depth_use_cost.py smollm2-135m --windows 8 --seq-len 128 --rounds 3
    git show COMMIT:depthcurse/depth/measure.py > /tmp/old_measure.py
    python benchmarks/depth_use/depth_use_cost.py smollm2-135m --windows 8 --seq-len 128 --rounds 2 --against /tmp/old_measure.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default="smollm2-135m")
    parser.add_argument("--data", default="wiki")
    parser.add_argument("--windows", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--against", help="another version of depth/measure.py, timed against this one in turns")
    args = parser.parse_args()

    from depthcurse.heap import keep_freed_memory

    print(f"heap: {keep_freed_memory()}")  # as the command line does before any command's work
    import torch

    from depthcurse.depth import measure_depth_use
    from depthcurse.loading import load_model
    from depthcurse.select.estimate import head_blocks
    from depthcurse.surgery import num_layers
    from depthcurse.tasks import PerplexityTask
    from depthcurse.text import load_texts

    loaded = load_model(args.model, fp32_on_cpu="as this benchmark's figures in docs/benchmarks.md were measured")
    model = loaded.model.eval()
    texts, label = load_texts(args.data)
    ids = PerplexityTask(loaded.tokenizer, texts, source=label, seq_len=args.seq_len, limit=args.windows, warn_short=False).windows
    batches = [ids[i : i + args.batch_size] for i in range(0, len(ids), args.batch_size)]
    n = num_layers(model)

    def streams() -> float:
        started = time.perf_counter()
        with torch.inference_mode():
            for batch in batches:
                model(input_ids=batch, output_hidden_states=True, use_cache=False)
        return time.perf_counter() - started

    def report() -> float:
        started = time.perf_counter()
        measure_depth_use(model, ids, args.batch_size, influence=False)
        return time.perf_counter() - started

    print(f"{args.model}: {len(ids)} windows x {args.seq_len} tokens of {label}, batches of {args.batch_size}, {n} layers, "
          f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}", flush=True)
    if args.against:
        import importlib.util
        import sys

        spec = importlib.util.spec_from_file_location("other_measure", args.against)
        other = sys.modules["other_measure"] = importlib.util.module_from_spec(spec)  # a dataclass looks its module up there
        spec.loader.exec_module(other)
        timed = {"this": measure_depth_use, "other": other.measure_depth_use}
        seconds = {name: [] for name in timed}
        for _ in range(args.rounds):
            for name, measure in timed.items():  # in turns: A B A B
                started = time.perf_counter()
                measure(model, ids, args.batch_size, influence=True)
                seconds[name].append(time.perf_counter() - started)
        this, that = statistics.median(seconds["this"]), statistics.median(seconds["other"])
        print(f"this measure.py: median {this:.2f} s ({', '.join(f'{t:.2f}' for t in seconds['this'])}); {args.against}: median {that:.2f} s "
              f"({', '.join(f'{t:.2f}' for t in seconds['other'])}); this / that {this / that:.3f}")
        return
    streams()  # warm-up
    a, b = [], []
    for _ in range(args.rounds):
        a.append(streams())
        b.append(report())
    started = time.perf_counter()
    measure_depth_use(model, ids, args.batch_size, influence=True)
    both = time.perf_counter() - started
    pass_s, report_s = statistics.median(a), statistics.median(b)
    influence_s = max(0.0, both - report_s)
    blocks = n * (n - 1) // 2
    head = head_blocks(model)
    print(f"forward keeping the streams: median {pass_s:.2f} s of {args.rounds} ({', '.join(f'{t:.2f}' for t in a)})")
    print(f"per-layer report (no influence): median {report_s:.2f} s ({', '.join(f'{t:.2f}' for t in b)}): {report_s / pass_s:.2f}x the pass")
    print(f"  the logit lens runs the head at each of the {n} layers; the head is {head:.1f} blocks' worth of parameters, so a pass is about "
          f"{n + head:.0f} blocks and the report about {n + n * head:.0f}: {(n + n * head) / (n + head):.1f}x by parameters")
    print(f"influence matrix: {influence_s:.2f} s ({both:.2f} s with the report), {blocks} blocks a window stepped = {blocks / n:.1f} passes' worth "
          f"((n - 1) / 2, goal n / 2 = {n / 2:.1f}); measured {influence_s / pass_s:.2f}x the pass (its output KLs run the head {n} times too)")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
