"""Choosing what a draft skips: select's acceptance and speedup objectives, and the two skip-set
searches of the self-speculative decoding papers, each against its authors' loop.

- `--objective acceptance` scores a removal by 1 - its teacher-forced top-1 agreement with the
  unpruned model, checked against the model built without those layers compared by hand;
  `--objective speedup` by the expected time per token from that agreement and the measured costs.
- SWIFT's search (hemingkx/SWIFT @ 88caed7) and Draft & Verify's (dilab-zju/self-speculative-decoding
  @ 688db8b) are ported line by line below, their models and speeds replaced by a made-up score of a
  skip set; under one seed the ports and the searches try the same skip sets in the same order and
  choose the same one.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import assert_one_line_error

from depthcurse.errors import DepthcurseError
from depthcurse.select.search import SearchContext, Space, find_search
from depthcurse.select.searches.draft_verify import DraftVerify, DraftVerifySettings
from depthcurse.select.searches.swift import Swift, SwiftSettings
from depthcurse.speculate.costs import DraftCosts
from depthcurse.surgery import removed_layers, removed_units, skipped_branches

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# --------------------------------------------------------------------------- their loops, line by line
def port_of_swift(n, num_skip, matchness, seed, bayes=True, bayes_interval=25, max_opt_iter=1000, max_tolerance_iter=300, max_score=0.95):
    """`swift_optimization` called until it stops (hemingkx/SWIFT @ 88caed7, model/swift/utils.py, with
    inference_swift.py's optimiser, utility and statistics), the model's matchness replaced by
    `matchness(attention, mlp)`; numpy's global random state seeded. Returns every candidate tried and
    the set kept at the end."""
    from bayes_opt import BayesianOptimization, UtilityFunction

    np.random.seed(seed)
    pbounds = {f"x{i}": (0, 1) for i in range((n - 2) * 2)}
    optimizer = BayesianOptimization(f=None, pbounds=pbounds, random_state=1, verbose=0, allow_duplicate_points=True)
    optimizer.set_gp_params(alpha=1e-2)
    utility = UtilityFunction(kind="ucb", kappa=2.5, xi=0.0)
    statistics = {"origin_score": 0, "opt_iter": 0, "tolerance_iter": 0, "bayes_interval": bayes_interval, "max_opt_iter": max_opt_iter,
                  "max_tolerance_iter": max_tolerance_iter, "max_score": max_score, "optimization": True, "bayes": bayes}
    skip = (list(np.arange(1, n - 1, 2)), list(np.arange(1, n - 1, 2)))  # their unified initial set
    tried = []

    def get_next_point_to_probe(attn_skip_layers, mlp_skip_layers, num_hidden_layers):
        next_point_to_probe = {}
        for i in range(num_hidden_layers - 2):
            next_point_to_probe[f"x{i}"] = 1.0 if (i + 1) in attn_skip_layers else 0.0
        for i in range(num_hidden_layers - 2, (num_hidden_layers - 2) * 2):
            next_point_to_probe[f"x{i}"] = 1.0 if (i - (num_hidden_layers - 2) + 1) in mlp_skip_layers else 0.0
        return next_point_to_probe

    while statistics["optimization"]:
        origin = skip
        if (statistics["opt_iter"] + 1) % statistics["bayes_interval"] == 0 and statistics["bayes"]:
            next_point_to_probe = optimizer.suggest(utility)
            sorted_point = sorted(next_point_to_probe.items(), reverse=True, key=lambda item: item[1])
            skip_layer_list = [k for (k, v) in sorted_point[:num_skip]]
            attn = [i + 1 for i in range(n - 2) if f"x{i}" in skip_layer_list]
            mlp = [i - (n - 2) + 1 for i in range(n - 2, (n - 2) * 2) if f"x{i}" in skip_layer_list]
        else:
            skip_layer_list = np.random.choice((n - 2) * 2, num_skip, replace=False)
            attn = [i + 1 for i in range(n - 2) if i in skip_layer_list]
            mlp = [i - (n - 2) + 1 for i in range(n - 2, (n - 2) * 2) if i in skip_layer_list]
            next_point_to_probe = get_next_point_to_probe(attn, mlp, n)
        skip = (attn, mlp)
        score = matchness(attn, mlp)
        tried.append((attn, mlp))
        optimizer.register(params=next_point_to_probe, target=score)
        if score > statistics["origin_score"]:
            statistics["origin_score"] = score
            statistics["tolerance_iter"] = 0
            if score > statistics["max_score"]:
                statistics["optimization"] = False
        else:
            skip = origin
            statistics["tolerance_iter"] += 1
        statistics["opt_iter"] += 1
        if statistics["tolerance_iter"] > statistics["max_tolerance_iter"]:
            statistics["optimization"] = False
        if statistics["opt_iter"] > statistics["max_opt_iter"]:
            statistics["optimization"] = False
    return tried, skip


def port_of_draft_verify(n, tokens_per_s, n_iter, probes=(), kappa=None):
    """`LayerSkippingSearching` (dilab-zju/self-speculative-decoding @ 688db8b, searching.py): its
    black box's tokens per second replaced by `tokens_per_s(attention, mlp)`, its probes at x_(i+n) for
    an MLP (theirs: x_(i+40), Llama-2-13B's n). Returns every skip set scored and the solution."""
    from bayes_opt import BayesianOptimization

    tried = []

    def black_box(**kargs):
        attn_skip_layers = [i for i in range(n) if kargs[f"x{i}"] > 0.5]
        mlp_skip_layers = [i - n for i in range(n, n * 2) if kargs[f"x{i}"] > 0.5]
        tried.append((attn_skip_layers, mlp_skip_layers))
        return tokens_per_s(attn_skip_layers, mlp_skip_layers)

    optimizer = BayesianOptimization(f=black_box, pbounds={f"x{i}": (0, 1) for i in range(n * 2)}, random_state=1, verbose=0)
    optimizer.set_gp_params(alpha=1e-2)
    for attn_skip_layers, mlp_skip_layers in probes:
        params = {f"x{i}": 0.0 for i in range(n * 2)}
        for i in attn_skip_layers:
            params[f"x{i}"] = 1.0
        for i in mlp_skip_layers:
            params[f"x{i + n}"] = 1.0
        optimizer.probe(params=params, lazy=True)
    if kappa is None:  # theirs
        optimizer.maximize(init_points=0, n_iter=n_iter)
    else:  # the kappa setting: bayes_opt 1.5's own UCB, at another kappa
        from bayes_opt import UtilityFunction

        optimizer.maximize(init_points=0, n_iter=n_iter, acquisition_function=UtilityFunction(kind="ucb", kappa=kappa, xi=0.0))
    best = optimizer.max["params"]
    return tried, ([i for i in range(n) if best[f"x{i}"] > 0.5], [i - n for i in range(n, 2 * n) if best[f"x{i}"] > 0.5])


def _split(removal):
    return [int(u[1:]) for u in removal if u[0] == "a"], [int(u[1:]) for u in removal if u[0] == "m"]


def _made_up(attn, mlp) -> float:
    """A score of a skip set, distinct for each: skipping early attention and late MLPs costs most."""
    return 1.0 / (1.0 + 0.05 * sum((10 - i) ** 1.3 for i in attn) + 0.03 * sum((i + 1) ** 1.1 for i in mlp))


def _context(space, objective, score, seed=3):
    return SearchContext(space=space, objective=objective, score=score, score_many=lambda rs: [score(r) for r in rs], score_on=None, windows=4,
                         window_tokens=16, streams=None, seed=seed)


@pytest.mark.searching
def test_swift_tries_the_sets_its_authors_loop_tries_and_keeps_the_same():
    n, k = 6, 3  # a Bayesian suggestion costs seconds (bayes_opt's acquisition search): two of them, at the 2nd and 4th candidates
    tried, (attn, mlp) = port_of_swift(n, k, _made_up, seed=11, bayes_interval=2, max_opt_iter=4, max_tolerance_iter=6)
    search = Swift(SwiftSettings(bayes_interval=2, max_opt_iter=4, max_tolerance_iter=6, seed=11))
    space = Space(n, k, "branch")
    search.check(space)
    ctx = _context(space, "acceptance", lambda r: 1.0 - _made_up(*_split(r)))
    chosen = search.run(ctx)
    assert [_split(r) for r in search.trace] == [(list(a), list(m)) for a, m in tried]
    assert len(tried) == 5  # max_opt_iter 4: the fifth candidate passes it
    assert _split(chosen) == (list(attn), list(mlp))
    assert "swift stopped" in ctx.notes[0]


@pytest.mark.searching
def test_swift_stops_where_its_matchness_passes_max_score_and_says_which_bound_it_hit():
    n, k = 8, 4
    tried, kept = port_of_swift(n, k, _made_up, seed=2, bayes=False, max_opt_iter=200, max_score=0.55)
    search = Swift(SwiftSettings(bayes=False, max_opt_iter=200, max_score=0.55, seed=2))
    ctx = _context(Space(n, k, "branch"), "acceptance", lambda r: 1.0 - _made_up(*_split(r)))
    chosen = search.run(ctx)
    assert len(search.trace) == len(tried) < 201 and _split(chosen) == (list(kept[0]), list(kept[1]))
    assert _made_up(*_split(chosen)) > 0.55 and "passed max_score 0.55" in ctx.notes[0]
    # another objective: no matchness to stop at; the bound ends it, and says so
    bounded = Swift(SwiftSettings(bayes=False, max_opt_iter=5, seed=2))
    ctx = _context(Space(n, k, "branch"), "kl", lambda r: 1.0 - _made_up(*_split(r)))
    bounded.run(ctx)
    assert len(bounded.trace) == 6 and "stopped at the bound: 6 candidates (max_opt_iter 5)" in ctx.notes[0]


@pytest.mark.searching
def test_swift_with_its_run_scripts_settings_is_their_loop_at_their_k_stop_and_start():
    """`swift.skip_ratio=0.45,swift.max_score=0.93,swift.start=odd` (eval_llama.sh): on 12 blocks their
    k is int(2 x 10 x 0.45) = 9 branches whatever --k says, the loop stops at matchness 0.93, and where
    no candidate matches once their starting draft (both branches of blocks 1, 3, 5, 7, 9) stays."""
    from depthcurse.select.searches.swift import starting_set

    n = 12
    score = lambda a, m: 0.85 + 0.5 * _made_up(a, m)  # noqa: E731 (some sets pass 0.93)
    tried, kept = port_of_swift(n, 9, score, seed=4, bayes=False, max_opt_iter=300, max_score=0.93)
    search = Swift(SwiftSettings(bayes=False, max_opt_iter=300, seed=4, skip_ratio=0.45, max_score=0.93, start="odd"))
    space = Space(n, 2, "branch")  # --k 2: theirs sets its own
    search.check(space)
    assert search.chooses_k and search.k_of(space) == 9
    ctx = _context(space, "acceptance", lambda r: 1.0 - score(*_split(r)))
    chosen = search.run(ctx)
    assert [_split(r) for r in search.trace] == [(list(a), list(m)) for a, m in tried] and _split(chosen) == (list(kept[0]), list(kept[1]))
    assert len(chosen) == 9 and "passed max_score 0.93" in ctx.notes[0] and "k = 9 (skip_ratio 0.45)" in ctx.notes[0]
    assert starting_set(n) == ("a1", "a3", "a5", "a7", "a9", "m1", "m3", "m5", "m7", "m9")
    tried, kept = port_of_swift(n, 9, lambda a, m: 0.0, seed=4, bayes=False, max_opt_iter=3)
    nothing = Swift(SwiftSettings(bayes=False, max_opt_iter=3, seed=4, skip_ratio=0.45, start="odd"))
    ctx = _context(space, "acceptance", lambda r: 1.0)
    assert nothing.run(ctx) == starting_set(n) and _split(starting_set(n)) == (list(kept[0]), list(kept[1]))
    assert "no candidate matched once: their starting draft kept" in ctx.notes[0]
    for settings, said in ((SwiftSettings(skip_ratio=1.5), "--search-args swift.skip_ratio must lie between 0 and 1 (theirs: 0.45), got 1.5"),
                           (SwiftSettings(skip_ratio=0.01), "--search-args swift.skip_ratio=0.01: int(2 x 10 x 0.01) = 0 branches, none to skip"),
                           (SwiftSettings(start="even"), "--search-args swift.start=even: use none or odd (their starting draft)"),
                           (SwiftSettings(start="odd"), "--search-args swift.start=odd starts from 10 branches, not k = 2: give swift.skip_ratio too")):
        with pytest.raises(DepthcurseError, match="^" + re.escape(said)):
            Swift(settings).check(space)


@pytest.mark.searching
def test_draft_verify_scores_the_points_its_authors_loop_scores_and_chooses_the_same():
    n, probes = 4, (([1, 3], [2]), ([0], []))  # two probes first, then two suggestions (seconds each)
    tried, (attn, mlp) = port_of_draft_verify(n, lambda a, m: 1.0 + _made_up(a, m) * (len(a) + len(m)), n_iter=2, probes=probes)
    text = ";".join(",".join([f"a{i}" for i in a] + [f"m{i}" for i in m]) for a, m in probes)
    search = DraftVerify(DraftVerifySettings(n_iter=2, probes=text))
    space = Space(n, 3, "branch")
    search.check(space)
    ctx = _context(space, "speedup", lambda r: 1.0 / (1.0 + _made_up(*_split(r)) * len(r)))
    chosen = search.run(ctx)
    assert [_split(r) for r in search.trace] == tried and len(tried) == 4
    assert _split(chosen) == (attn, mlp)  # any number of branches: the search's own choice


@pytest.mark.searching
def test_the_searches_are_found_by_name_and_refuse_what_they_cannot_run():
    from depthcurse.errors import DepthcurseError

    assert find_search("swift") is Swift and find_search("draft-verify") is DraftVerify
    with pytest.raises(DepthcurseError, match="keeps the first and last blocks"):
        Swift().check(Space(2, 1, "branch"))
    with pytest.raises(DepthcurseError, match="'q1' is not a branch"):
        DraftVerify(DraftVerifySettings(probes="a1;q1")).check(Space(4, 2, "branch"))


# --------------------------------------------------------------------------- the objectives, by hand
def test_acceptance_and_speedup_scores_are_the_model_built_without_those_layers_compared_by_hand(run_cli, six_dir, text_file, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from depthcurse.select.config import SelectConfig
    from depthcurse.select.windows import text_windows

    out = tmp_path / "sel"
    code, stdout, err = run_cli("select", six_dir, "--k", "2", "--calibration", text_file, "--objective", "acceptance,speedup", "--search", "exact,greedy",
                                "--calib-windows", "4", "--eval-windows", "4", "--seq-len", "16", "--batch-size", "2", "--draft-tokens", "3", "--out", out)
    assert code == 0, err
    record = json.loads((out / "select.json").read_text())
    known = record["calibration_scores"][str(text_file)]
    costs = DraftCosts(**record["draft_costs"])
    assert costs.gamma == 3 and record["run"]["draft_tokens"] == 3
    model, tokenizer = AutoModelForCausalLM.from_pretrained(six_dir).eval(), AutoTokenizer.from_pretrained(six_dir)
    windows = text_windows(tokenizer, str(text_file), SelectConfig(k=2, calibration=(str(text_file),), calib_windows=4, eval_windows=4, seq_len=16)).calibration
    with torch.no_grad():
        unpruned = model(input_ids=windows).logits[:, :-1].argmax(-1)
        for removal in ((0, 1), (2, 5), (3, 4)):
            with removed_layers(model, removal):
                mine = model(input_ids=windows).logits[:, :-1].argmax(-1)
            agreement = (mine == unpruned).float().mean(1).mean().item()
            scores = known[",".join(map(str, removal))]
            assert scores[2] == pytest.approx(1 - agreement, abs=1e-6)
            assert scores[3] == pytest.approx(costs.time_per_token(1 - scores[2], removal), rel=1e-12)
            assert scores[3] == pytest.approx(costs.time_per_token(agreement, removal), rel=1e-6)
    exact = record["cells"][f"{text_file.stem}/exact/acceptance"]["layers"]
    assert known[",".join(map(str, exact))][2] == min(v[2] for name, v in known.items() if name.count(",") == 1)
    fastest = record["cells"][f"{text_file.stem}/exact/speedup"]["layers"]
    assert known[",".join(map(str, fastest))][3] == min(v[3] for name, v in known.items() if name.count(",") == 1)
    # a draft made from the pick: speculate --skip-from reads it back
    spec = tmp_path / "spec"
    prompts = tmp_path / "p.txt"
    prompts.write_text("The river flows\n\nWater boils at", encoding="utf-8")
    code, stdout, err = run_cli("speculate", six_dir, "--skip-from", out, "--prompts", prompts, "--max-new-tokens", "6", "--baselines", "none", "--out", spec)
    assert code == 0, err
    run = json.loads((spec / "speculate.json").read_text())["run"]
    assert run["skip"] == exact and f"{text_file.stem}/exact/acceptance" in run["skip_from"]
    other = [i for i in range(6) if i not in exact][:2]  # another draft on the same prompts, the select run's pick beside it
    code, stdout, err = run_cli("speculate", six_dir, "--skip", ",".join(map(str, other)), "--also-skip-from", out, "--prompts", prompts, "--max-new-tokens", "6",
                                "--baselines", "none", "--out", tmp_path / "spec2")
    assert code == 0 and json.loads((tmp_path / "spec2" / "speculate.json").read_text())["run"]["also"] == [exact], err
    assert "self-draft #2 against self-draft:" in " ".join(stdout.split())


@pytest.mark.statistics
def test_draft_costs_price_a_draft_by_hand():
    costs = DraftCosts(gamma=4, block_share=0.03, verify=1.5)
    assert costs.c(tuple(range(10))) == pytest.approx(0.7) and costs.c(tuple(range(40))) == 0.0
    e = (1 - 0.8**5) / 0.2
    assert costs.speedup(0.8, tuple(range(10))) == pytest.approx(e / (4 * 0.7 + 1.5))
    assert costs.time_per_token(0.8, tuple(range(10))) == pytest.approx((4 * 0.7 + 1.5) / e)
    assert costs.c(("a1", "m1", "a2")) == pytest.approx(1 - 3 * 0.015)  # a record from before branches were priced: half a block each
    apart = DraftCosts(gamma=4, block_share=0.03, verify=1.5, attention_share=0.004, mlp_share=0.026)
    assert apart.c(("a1", "a2", "a3", "m7")) == pytest.approx(1 - 3 * 0.004 - 0.026)  # an MLP branch 6.5 attention branches' worth
    assert apart.c(("m1", "m2", "m3", "a7")) == pytest.approx(1 - 3 * 0.026 - 0.004) and apart.c((3, 4)) == pytest.approx(0.94)


@pytest.mark.searching
def test_draft_costs_measure_each_kind_of_branch_apart_by_a_clock_the_test_controls():
    """A clock that advances by what runs: each attention branch 1 unit, each MLP branch 6, the head 10
    (hooks on a projection of each, which a skipped branch does not run). A step of the 6-block model is 6 x 7 + 10 = 52 units; the
    later half's 3 blocks are 21 of them, its attentions 3, its MLPs 18; so a block's share is 7 / 52,
    an attention's 1 / 52 and an MLP's 6 / 52, and a check of gamma + 1 tokens 52 too (the clock counts
    calls, not tokens)."""
    from helpers import tiny_llama

    from depthcurse.speculate.costs import measure_costs

    model = tiny_llama(60, layers=6, seed=2).eval()
    units = [0]
    hooks = [model.lm_head.register_forward_hook(lambda *a: units.__setitem__(0, units[0] + 10))]
    for block in model.model.layers:  # on a projection each branch runs only when it is not skipped
        hooks.append(block.self_attn.q_proj.register_forward_hook(lambda *a: units.__setitem__(0, units[0] + 1)))
        hooks.append(block.mlp.down_proj.register_forward_hook(lambda *a: units.__setitem__(0, units[0] + 6)))
    try:
        costs = measure_costs(model, gamma=3, steps=3, prompt_tokens=8, now=lambda: float(units[0]))
    finally:
        for h in hooks:
            h.remove()
    assert costs.step_s == 52 and costs.verify == pytest.approx(1.0)
    assert costs.block_share == pytest.approx(7 / 52) and costs.attention_share == pytest.approx(1 / 52) and costs.mlp_share == pytest.approx(6 / 52)
    from depthcurse.few_row_linear import status

    assert costs.check_linear == status()  # the check timed as speculate runs it, and said so in select's record


# --------------------------------------------------------------------------- a draft that skips branches
@pytest.mark.searching
def test_a_skipped_branch_costs_nothing_and_gives_the_zeroed_branch_s_logits_and_generate_s_tokens():
    from helpers import tiny_llama

    from depthcurse.speculate import DecodeSettings, LayerSkipDraft, Stopwatch, build_length, speculative

    model = tiny_llama(50, layers=6, seed=3)
    ids = torch.tensor([[3, 4, 5, 6, 7, 8, 3, 4, 5]])
    units = ("a0", "a3", "m2", "m5")
    calls = []
    hooks = [model.model.layers[i].self_attn.q_proj.register_forward_hook(lambda *a, i=i: calls.append(i)) for i in range(6)]
    with torch.no_grad(), skipped_branches(model, units):
        skipped = model(input_ids=ids).logits
    assert sorted(set(calls)) == [1, 2, 4, 5]  # blocks 0 and 3's attention never ran
    for h in hooks:
        h.remove()
    with torch.no_grad(), removed_units(model, [0, 3], "attn"), removed_units(model, [2, 5], "mlp"):
        zeroed = model(input_ids=ids).logits
    assert torch.allclose(skipped, zeroed, atol=1e-6)
    assert all("forward" not in vars(m) for m in model.modules())  # put back
    reference = model.generate(ids, do_sample=False, max_new_tokens=20)[0, ids.shape[1]:].tolist()
    g = speculative(model, LayerSkipDraft(model, units), ids, DecodeSettings(20), build_length("fixed", 3), Stopwatch("cpu"))
    assert g.tokens == reference and g.rounds


@pytest.mark.searching
def test_block_0_s_attention_is_refused_where_the_model_reads_its_cache_length_there_and_it_cannot_be_written(run_cli, tmp_path, tiny_tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel



    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tiny_tokenizer), n_embd=32, n_layer=3, n_head=4, n_positions=128)).eval()
    path = tmp_path / "gpt2"
    gpt2.save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    prompts = tmp_path / "p.txt"
    prompts.write_text("The river flows", encoding="utf-8")
    code, out, err = run_cli("speculate", path, "--skip", "a0,m1", "--prompts", prompts, "--out", tmp_path / "o")
    assert_one_line_error(code, out, err, "cannot skip a0: the model reads its KV cache's length off block 0")
    code, out, err = run_cli("speculate", path, "--skip", "m0,a1", "--prompts", prompts, "--max-new-tokens", "5", "--baselines", "none", "--out", tmp_path / "o2")
    assert code == 0 and "lossless" in out, err


@pytest.mark.searching
def test_swift_stops_on_its_tolerance_as_theirs_and_says_every_stop_and_refusal_by_value():
    """bayes off, max_tolerance_iter 3: the port's candidates one by one, kept set, and the stop said;
    matchness never above 0 is one line; k, n and each count at their edges."""
    import re

    from depthcurse.select.estimate import mean_run

    n, k = 8, 4
    matchness = lambda a, m: _made_up(a, m) if len(a) >= 2 else _made_up(a, m) / 10  # noqa: E731 (some sets far below others: repeats of no gain)
    tried, kept = port_of_swift(n, k, matchness, seed=5, bayes=False, max_opt_iter=500, max_tolerance_iter=3)
    search = Swift(SwiftSettings(bayes=False, max_opt_iter=500, max_tolerance_iter=3, seed=5))
    ctx = _context(Space(n, k, "branch"), "acceptance", lambda r: 1.0 - matchness(*_split(r)))
    chosen = search.run(ctx)
    assert [_split(r) for r in search.trace] == [(list(a), list(m)) for a, m in tried] and _split(chosen) == (list(kept[0]), list(kept[1]))
    assert ctx.notes == [f"swift stopped: 4 candidates in a row without a better one (max_tolerance_iter 3), after {len(tried)} candidates"]
    # a lower score is better on another objective: the first candidate is kept over worse ones (their origin_score starts at -inf there)
    lowest = Swift(SwiftSettings(bayes=False, max_opt_iter=3, seed=5))
    ctx = _context(Space(n, k, "branch"), "kl", lambda r: float(len(lowest.trace)))  # each later candidate scores worse
    assert lowest.run(ctx) == lowest.trace[0] and ctx.notes == ["swift stopped at the bound: 4 candidates (max_opt_iter 3), after 4 candidates"]
    with pytest.raises(DepthcurseError, match=r"^--search swift: no candidate matched the unpruned model once \(matchness 0 throughout\): nothing to choose$"):
        Swift(SwiftSettings(bayes=False, max_opt_iter=2, seed=5)).run(_context(Space(n, k, "branch"), "acceptance", lambda r: 1.0))

    Swift().check(Space(3, 2, "branch"))  # blocks 0-2: the middle block's two branches
    assert Swift(SwiftSettings(max_opt_iter=7)).passes(Space(8, 3, "branch"), 0) == (8 * mean_run(8, 3, "branch"), 8.0)  # their `opt_iter > 7`: 8 candidates at most
    for space, settings, said in (
            (Space(2, 1, "branch"), SwiftSettings(), "--search swift keeps the first and last blocks and skips branches between them: 2 blocks leave none"),
            (Space(3, 3, "branch"), SwiftSettings(), "--search swift: k = 3 is more than the 2 branches of blocks 1-1"),
            (Space(8, 3, "branch"), SwiftSettings(bayes_interval=0), "--search-args swift.bayes_interval must be at least 1, got 0"),
            (Space(8, 3, "branch"), SwiftSettings(max_opt_iter=0), "--search-args swift.max_opt_iter must be at least 1, got 0"),
            (Space(8, 3, "branch"), SwiftSettings(max_tolerance_iter=0), "--search-args swift.max_tolerance_iter must be at least 1, got 0")):
        with pytest.raises(DepthcurseError, match="^" + re.escape(said) + "$"):
            Swift(settings).check(space)


@pytest.mark.searching
def test_draft_verify_on_another_objective_reads_its_probes_and_points_by_value():
    """KL (lower is better, their black box given -KL) with two probes and one suggestion: the port's
    points and choice; the note; a point's x exactly 0.5 keeps its branch; each bad probe by value."""
    import re

    from depthcurse.select.estimate import mean_run
    from depthcurse.select.searches.draft_verify import parse_probes, skipped

    n, probes = 4, (([0, 2], [3]), ([1], [0, 1]))
    kl = lambda a, m: 1.0 - _made_up(a, m) + 0.01 * (len(a) + len(m))  # noqa: E731
    tried, (attn, mlp) = port_of_draft_verify(n, lambda a, m: -kl(a, m), n_iter=1, probes=probes)
    search = DraftVerify(DraftVerifySettings(n_iter=1, probes="a0,a2,m3; ;a1,m0,m1;"))
    ctx = _context(Space(n, 2, "branch"), "kl", lambda r: kl(*_split(r)))
    chosen = search.run(ctx)
    assert [_split(r) for r in search.trace] == tried and len(tried) == 3 and _split(chosen) == (attn, mlp)
    assert ctx.notes == [f"draft-verify: 3 points scored (n_iter 1, its bound), {len(chosen)} branches chosen"]

    assert parse_probes("a0,m3; ;a3;", 4) == [("a0", "m3"), ("a3",)]
    for text, bad in (("a4", "'a4'"), ("m1,x2", "'x2'"), ("a", "'a'"), ("m-1", "'m-1'")):
        with pytest.raises(DepthcurseError, match="^" + re.escape(f"--search-args draft-verify.probes: {bad} is not a branch of this model (a0-a3, m0-m3)") + "$"):
            parse_probes(text, 4)
    point = {f"x{i}": v for i, v in enumerate([0.5, 0.51, 0.0, 1.0, 0.5, 0.9, 0.49, 0.5])}
    assert skipped(point, 4) == ("a1", "a3", "m1")
    assert DraftVerify(DraftVerifySettings(n_iter=5, probes="a0;m1")).passes(Space(6, 2, "branch"), 0) == (7 * mean_run(6, 6, "branch"), 7.0)
    DraftVerify(DraftVerifySettings(n_iter=0)).check(Space(4, 2, "branch"))
    with pytest.raises(DepthcurseError, match=r"^--search-args draft-verify.n_iter must be 0 or more, got -1$"):
        DraftVerify(DraftVerifySettings(n_iter=-1)).check(Space(4, 2, "branch"))
    with pytest.raises(DepthcurseError, match=r"^--search-args draft-verify.probes: 'a9' is not a branch"):
        DraftVerify(DraftVerifySettings(probes="a9")).check(Space(4, 2, "branch"))


@pytest.mark.searching
def test_draft_verify_gives_the_optimiser_the_speedup_or_minus_the_score_and_follows_its_kappa(capsys):
    """What the optimiser maximises, pinned per point: the expected speedup (1 / time per token) on
    the speedup objective, minus the score on any other; and kappa 0.01 (not bayes_opt's 2.576)
    suggests what the port's UCB at 0.01 suggests (there: a0 alone, where 2.576 suggests a0, m0, m2, m3)."""
    n, probes = 4, (([1, 3], [2]), ([0], []))
    value = lambda r: 1.0 / (1.0 + _made_up(*_split(r)) * len(r))  # noqa: E731
    for objective, target in (("speedup", lambda r: 1.0 / value(r)), ("kl", lambda r: -value(r))):
        search = DraftVerify(DraftVerifySettings(n_iter=0, probes="a1,a3,m2;a0"))
        search.run(_context(Space(n, 2, "branch"), objective, value))
        assert search.targets == [target(r) for r in search.trace] and len(search.targets) == 2
    tried, (attn, mlp) = port_of_draft_verify(n, lambda a, m: 1.0 + _made_up(a, m) * (len(a) + len(m)), n_iter=1, probes=probes, kappa=0.01)
    search = DraftVerify(DraftVerifySettings(n_iter=1, kappa=0.01, probes="a1,a3,m2;a0"))
    chosen = search.run(_context(Space(n, 2, "branch"), "speedup", value))
    assert [_split(r) for r in search.trace] == tried and _split(chosen) == (attn, mlp) and tried[-1] == ([0], [])
    capsys.readouterr()
    DraftVerify(DraftVerifySettings(n_iter=1, probes="a1,a3,m2;a0")).run(_context(Space(n, 2, "branch"), "speedup", value))
    assert capsys.readouterr().out == ""  # bayes_opt's own table of points stays out of the command's output


@pytest.mark.searching
def test_draft_verify_takes_probes_from_a_file_with_plus_signs_and_their_two_published_sets(tmp_path):
    """Their notebook's two sets for Llama-2-13B (20 and 34 branches: "theirs") are probed first on a model
    of 40 blocks and refused in one line on a shallower one; any sets from a file (a line each, "#"
    comments) or inline with "+" between branches, since --search-args splits on commas (issue 87)."""
    import re

    from depthcurse.errors import DepthcurseError
    from depthcurse.select.searches.draft_verify import THEIRS, parse_probes, probe_sets

    listed = tmp_path / "probes.txt"
    listed.write_text("# two sets\na0, a2 m3\n\na1+m0,m1  # the second # of two\n")
    assert parse_probes(f"@{listed}", 4) == parse_probes("a0+a2+m3;a1+m0+m1", 4) == parse_probes("a0,a2,m3;a1,m0,m1", 4) == [("a0", "a2", "m3"), ("a1", "m0", "m1")]
    with pytest.raises(DepthcurseError, match=r"^--search-args draft-verify.probes=@.*nowhere.txt: cannot read .*nowhere.txt \(No such file or directory\)$"):
        probe_sets(f"@{tmp_path / 'nowhere.txt'}")
    theirs = parse_probes("theirs", 40)
    assert [len(t) for t in theirs] == [20, 34] and theirs[0][:3] == ("a8", "a10", "a15") and theirs[1][-3:] == ("m27", "m28", "m35")
    assert theirs == [a + m for a, m in THEIRS]
    with pytest.raises(DepthcurseError, match=re.escape("'a30' is not a branch of this model (a0-a29, m0-m29): theirs are for Llama-2-13B's 40 blocks")):
        parse_probes("theirs", 30)
    search = DraftVerify(DraftVerifySettings(n_iter=1, probes="theirs"))
    ctx = _context(Space(40, 2, "branch"), "kl", lambda r: 1.0 - 0.001 * len(r))
    search.run(ctx)
    assert search.trace[:2] == theirs and len(search.trace) == 3  # their two probes, then one suggestion


# docs/speculate.md's "theirs here" cells and one-flag lines, verbatim: each runs (issue 87)
SWIFT_THEIRS = ("--calibration continuations --seq-len 51 --objective acceptance", "--search-args swift.skip_ratio=0.45", "swift.max_score=0.93",
                "swift.start=odd", "swift.seed=2024",
                "--granularity branch --search swift --objective acceptance\n--calibration continuations --seq-len 51 --search-args swift.skip_ratio=0.45,swift.max_score=0.93,swift.start=odd")
DRAFT_VERIFY_THEIRS = ("--calibration continuations", "--search-args draft-verify.probes=theirs", "draft-verify.probes=a8+a10+m6;a3", "draft-verify.probes=@FILE")


def test_every_theirs_here_setting_of_the_ports_tables_runs(run_cli, six_dir, tmp_path):
    """SWIFT's run-script settings and Draft & Verify's probes, as the tables give them, on a tiny model of
    6 blocks (their bounds cut to a few candidates: `max_opt_iter`, `n_iter`; their probes' block numbers
    to this model's): each select run finishes and says it ran their search."""
    doc = " ".join((Path(__file__).parent.parent / "docs" / "speculate.md").read_text().split())
    for cell in SWIFT_THEIRS + DRAFT_VERIFY_THEIRS:
        assert " ".join(cell.split()) in doc, cell
    swift = "swift.skip_ratio=0.45,swift.max_score=0.93,swift.start=odd,swift.seed=2024,swift.max_opt_iter=3"
    common = ["--granularity", "branch", "--calibration", "continuations", "--seq-len", "51", "--calib-windows", "2", "--eval-windows", "2",
              "--batch-size", "2", "--resamples", "0"]
    code, out, err = run_cli("select", six_dir, "--search", "swift", "--objective", "acceptance", *common, "--search-args", swift, "--out", tmp_path / "swift")
    assert code == 0, err
    assert "swift stopped at the bound: 4 candidates (max_opt_iter 3), after 4 candidates; k = 3 (skip_ratio 0.45)" in (tmp_path / "swift" / "select.json").read_text()
    probes = tmp_path / "probes.txt"
    probes.write_text("a1, a3, m2\na4\n")
    for given in ("a1+a3+m2;a4", f"@{probes}"):
        out_dir = tmp_path / f"dv{len(given)}"
        code, out, err = run_cli("select", six_dir, "--search", "draft-verify", "--objective", "speedup", *common,
                                 "--search-args", f"draft-verify.probes={given},draft-verify.n_iter=1", "--out", out_dir)
        assert code == 0, err
        assert "draft-verify: 3 points scored (n_iter 1, its bound)" in (out_dir / "select.json").read_text()
    assert_one_line_error(*run_cli("select", six_dir, "--search", "draft-verify", "--objective", "speedup", *common,
                                   "--search-args", "draft-verify.probes=theirs", "--out", tmp_path / "theirs"),
                          "'a8' is not a branch of this model (a0-a5, m0-m5): theirs are for Llama-2-13B's 40 blocks")
