"""Capability probes: the simplest test of each algorithmic capability a removal may take first
(arithmetic, balanced brackets, copying, recall), scored by greedy exact match.

"On the Limits of Layer Pruning for Generative Reasoning" (arXiv 2602.01997) finds that what a
pruned model loses, and healing does not win back, is algorithmic: arithmetic, balanced-bracket
generation. Log-likelihood suites and perplexity say "it recovered"; these say whether the model
still *produces* the answer. Each probe is a ladder rung: its examples generated from a seed (no
download; the same seed gives the same examples on every machine), a few-shot prompt of the same
rung's examples (a small instruct model follows it without a chat template), and one answer.

Greedy exact match needs no generation loop: the greedy continuation is the answer exactly when,
with the answer teacher-forced, the argmax at every answer position is the answer's token and the
next is the stop (a newline). That is lm-eval's `loglikelihood` request with its `acc` metric
(`is_greedy`, as lambada scores it), one forward pass per example: so each probe is an lm-eval task
built from a config here, and it runs wherever lm-eval tasks run, through prune's reuse engine
with every variant at once. `tests/test_probes.py` checks it against `model.generate`.

A probe is data: one entry of `PROBES` (a generator of (prompt, answer) pairs and its rung), and
`--task probes` the family as a suite, each probe, their average and the share kept.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from depthcurse.stats.intervals import wilson

SHOTS = 5  # examples of the same rung before each question
STOP = "\n"  # what ends an answer: the continuation scored is answer + STOP
SEED = 1234  # the examples' seed; recorded with every result (`describe`)
POOL = 500  # examples a probe can give (--limit takes the first)


@dataclass(frozen=True)
class Probe:
    """One rung of one capability: `make(rng) -> (question, answer)`, the ladder's generator at the
    rung's `size` (digits, open brackets, letters, keys); the prompt is `SHOTS` solved examples and
    the question, each `question + answer` on its own line."""

    capability: str  # arithmetic, brackets, copying, recall
    rung: str  # what makes it harder: "2 digits", "depth 4", ...
    ladder: Callable[[int], Callable[[random.Random], tuple[str, str]]]
    size: int

    def make(self, rng: random.Random) -> tuple[str, str]:
        return self.ladder(self.size)(rng)  # the generator made when asked, not at import: its code is what runs now


def _digits(rng: random.Random, n: int) -> int:
    return rng.randint(10 ** (n - 1) if n > 1 else 0, 10**n - 1)


def _add(n: int):
    def make(rng):
        a, b = _digits(rng, n), _digits(rng, n)
        return f"{a}+{b}=", str(a + b)
    return make


def _mul(n: int):
    def make(rng):  # n digits times one digit (2-9): the ladder's next step after addition
        a, b = _digits(rng, n), rng.randint(2, 9)
        return f"{a}*{b}=", str(a * b)
    return make


PAIRS = {"(": ")", "[": "]", "{": "}", "<": ">"}


def _dyck(depth: int):
    """A bracket string whose deepest point has `depth` open, cut there: the answer closes every
    open bracket in order (BIG-bench's dyck_languages, without its words)."""
    def make(rng):
        opened, out = [], []
        while len(opened) < depth:  # wander (open and close) while climbing to `depth`
            if opened and rng.random() < 0.3:
                out.append(PAIRS[opened.pop()])
            else:
                b = rng.choice(list(PAIRS))
                opened.append(b)
                out.append(b)
        return " ".join(out) + " ->", " " + " ".join(PAIRS[b] for b in reversed(opened))
    return make


LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _copy(length: int):
    def make(rng):  # the induction mechanism: repeat what was just seen
        word = " ".join(rng.choice(LETTERS) for _ in range(length))
        return f"{word} ->", f" {word}"
    return make


def _recall(pairs: int):
    def make(rng):  # associative recall: the value a key was given earlier in the line
        keys = rng.sample(LETTERS, pairs)
        values = [rng.randint(0, 9) for _ in keys]
        asked = rng.randrange(pairs)
        return " ".join(f"{k}={v}" for k, v in zip(keys, values)) + f" ; {keys[asked]} ->", f" {values[asked]}"
    return make


#: every probe, by the lm-eval task name it runs as; the ladders go from what SmolLM2-135M mostly
#: solves to what it mostly does not (docs/probes.md has its scores)
PROBES: dict[str, Probe] = {
    **{f"probe_add_{n}d": Probe("arithmetic", f"addition, {n} digit{'s' if n > 1 else ''}", _add, n) for n in (1, 2, 3)},
    **{f"probe_mul_{n}d": Probe("arithmetic", f"multiplication, {n} digit{'s' if n > 1 else ''} x 1", _mul, n) for n in (1, 2)},
    **{f"probe_brackets_{d}": Probe("brackets", f"close {d} open brackets", _dyck, d) for d in (1, 2, 4)},
    **{f"probe_copy_{n}": Probe("copying", f"copy {n} letters", _copy, n) for n in (4, 8, 16)},
    **{f"probe_recall_{n}": Probe("recall", f"recall 1 of {n} keys", _recall, n) for n in (2, 4, 8)},
}


def examples(name: str, seed: int = SEED, n: int = POOL) -> list[dict]:
    """`n` examples of probe `name`, each with its few-shot prompt: the same for a seed, everywhere."""
    probe = PROBES[name]
    rng = random.Random(f"{name}:{seed}")  # a string seed: each probe its own stream, independent of the others' order
    out = []
    for i in range(n):
        shots = [probe.make(rng) for _ in range(SHOTS)]
        question, answer = probe.make(rng)
        prompt = "".join(q + a + STOP for q, a in shots) + question
        out.append({"id": i, "prompt": prompt, "answer": answer, "target": answer + STOP})
    return out


def task_config(name: str, seed: int = SEED) -> dict:
    """The lm-eval task config of probe `name`: a log-likelihood request per example, whose `acc`
    is greedy exact match (answer and stop)."""
    def dataset(**_):
        import datasets  # lazy: only lm-eval tasks need it

        return {"test": datasets.Dataset.from_list(examples(name, seed))}

    return {"task": name, "custom_dataset": dataset, "test_split": "test", "output_type": "loglikelihood", "doc_to_text": "prompt",
            "doc_to_target": "target", "target_delimiter": "", "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
            "num_fewshot": 0, "metadata": {"version": 1, "seed": seed, "shots": SHOTS}}


def describe(names) -> dict:
    """What a result records of the probes among `names`: how their examples were made (nothing
    where there are none)."""
    ran = {n: {"capability": PROBES[n].capability, "rung": PROBES[n].rung} for n in names if n in PROBES}
    return {"probes": ran, "probe_seed": SEED, "probe_shots": SHOTS,
            "probe_metric": "greedy exact match of the answer and a newline (teacher-forced argmax)"} if ran else {}


CAPABILITIES = tuple(dict.fromkeys(p.capability for p in PROBES.values()))


def per_rung(limit: int | None) -> int:
    """Examples each probe scores under `--limit` (its pool where none is given)."""
    return min(limit, POOL) if limit else POOL


def capability_scores(metrics: dict[str, float], examples: int) -> dict[str, dict]:
    """Each capability among `metrics` (probe name -> exact-match rate, each over `examples`
    examples): the share of its examples solved over all its rungs, their count, and the 95%
    Wilson interval of that proportion (honest at 20 examples, where the normal's is not)."""
    out = {}
    for capability in CAPABILITIES:
        rungs = [name for name, probe in PROBES.items() if probe.capability == capability and name in metrics]
        if not rungs or examples < 1:
            continue
        solved = sum(round(metrics[name] * examples) for name in rungs)
        n = examples * len(rungs)
        out[capability] = {"score": solved / n, "solved": solved, "examples": n, "rungs": rungs, "interval": wilson(solved, n)}
    return out
