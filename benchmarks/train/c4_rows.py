"""The training stream's host time per step: `C4Rows.next_batch` tokenising one document per call
against `TOKENISE_DOCS` per call (the default), in one run.

C4 itself streams from the hub; here its stand-in is the offline Wikipedia text cut into
documents of C4's mean length (about 2,200 characters), written as JSONL and streamed through
the same `datasets` calls, tokenised by SmolLM2's tokenizer (offline; the papers' t5-base needs
the hub). One step of the 130m preset is 512 rows of 256 tokens. The GPU waits for this time only
when it exceeds the step's own (about 0.42 s at the 311,588 tokens/s measured on an H100).

    .venv/bin/python benchmarks/train/c4_rows.py
    .venv/bin/python benchmarks/train/c4_rows.py --pack --steps 10
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=512, help="rows per step (the presets' batch)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--pack", action="store_true", help="documents joined into full rows (default: one per row, the papers)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per setting, after one untimed")
    parser.add_argument("--doc-chars", type=int, default=2200)
    parser.add_argument("--tokenizer", default="smollm2-135m", help="a name or folder (on the GPU machine the bundle's copy, /root/dccache/tok)")
    args = parser.parse_args()

    import datasets
    from transformers import AutoTokenizer

    from depthcurse import assets
    from depthcurse.text import load_texts
    from depthcurse.train import data as D

    tokenizer = AutoTokenizer.from_pretrained(assets.resolve_model(args.tokenizer))
    texts, _ = load_texts("wiki")
    joined = "\n".join(texts)
    docs = [joined[i : i + args.doc_chars] for i in range(0, len(joined), args.doc_chars)]
    needed = 10_000 + (args.steps + 1) * args.rows  # each setting streams from the start: the shuffle buffer, then its steps
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "c4.jsonl"
        with path.open("w") as f:
            for i in range(needed):
                f.write(json.dumps({"text": docs[i % len(docs)]}) + "\n")
        real = datasets.load_dataset
        stand_in = lambda *a, **k: real("json", data_files=str(path), split="train", streaming=True)  # noqa: E731
        results = {}
        with mock.patch.object(datasets, "load_dataset", stand_in):
            for per_call in (1, D.TOKENISE_DOCS):
                with mock.patch.object(D, "TOKENISE_DOCS", per_call):
                    rows = D.C4Rows(tokenizer, args.seq_len, args.pack, seed=0)
                    first = rows.next_batch(args.rows).input_ids  # fills the shuffle buffer
                    seconds = []
                    for _ in range(args.steps):
                        started = time.perf_counter()
                        rows.next_batch(args.rows)
                        seconds.append(time.perf_counter() - started)
                results[per_call] = (statistics.median(seconds), first)
    (one, first_one), (many, first_many) = results[1], results[D.TOKENISE_DOCS]
    print(f"{args.rows} rows of {args.seq_len} tokens per step, {'packed' if args.pack else 'one document per row'}, "
          f"{os.cpu_count()} CPUs, median of {args.steps} steps")
    print(f"one document per tokenizer call:   {one:.3f} s per step")
    print(f"{D.TOKENISE_DOCS} documents per call:           {many:.3f} s per step ({many / one:.2f}x)")
    print(f"same first batch: {bool((first_one == first_many).all())}")


if __name__ == "__main__":
    main()
