"""`select`'s searches behind their contract (issue 65): the exact optimum against a brute force done
another way (each removal built by `removed_layers` and run whole), the prefix walk's scores and
block passes against the plain path and the counting formula, EvoPress's loop candidate by candidate
against a line-by-line port of `evo_drop_search.py` (IST-DASLab/EvoPress @ 50888a0), its defaults
against `scripts/run_drop_search.sh`, the baselines, a search from outside, and the bad input.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import random

import numpy as np
import pytest
import torch

from helpers import assert_one_line_error

from depthcurse.errors import DepthcurseError
from depthcurse.loading import load_model
from depthcurse.select import SelectConfig, run_select
from depthcurse.select.scoring import CalibrationScorer
from depthcurse.select.search import Space, SearchContext, key
from depthcurse.select.searches.evo import PAPER_DEFAULTS, Evo, EvoSettings, generations_for, scaled_tokens
from depthcurse.select.searches.exact import walk_passes
from depthcurse.surgery import removed_layers

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture()
def text(tmp_path):
    from conftest import CORPUS

    path = tmp_path / "text.txt"
    path.write_text("\n\n".join(f"w{i} {CORPUS[i % len(CORPUS)]} {CORPUS[(i * 5 + 1) % len(CORPUS)]}" for i in range(80)))
    return str(path)


@pytest.fixture()
def six(six_dir):
    return load_model(str(six_dir))


def _plain(model, windows, removal):
    """Mean next-token loss and KL(unpruned || pruned) of `removal`, by the model's own forward on a
    model built without those layers (no stepping, no kept streams)."""
    with torch.no_grad():
        ref = torch.log_softmax(model(input_ids=windows).logits[:, :-1].float(), -1)
        with removed_layers(model, removal):
            logp = torch.log_softmax(model(input_ids=windows).logits[:, :-1].float(), -1)
    loss = -logp.gather(-1, windows[:, 1:, None])[..., 0]
    kl = torch.nn.functional.kl_div(logp, ref, log_target=True, reduction="none").sum(-1)
    return loss.mean().item(), kl.mean().item()


# --------------------------------------------------------------------------- exact and the prefix walk


@pytest.mark.searching
def test_the_prefix_walk_scores_every_removal_as_a_plain_forward_does_and_counts_its_block_passes(six, tiny_tokenizer, text):
    from depthcurse.select.windows import text_windows

    windows = text_windows(tiny_tokenizer, text, SelectConfig(k=2, calibration=(text,), calib_windows=5, eval_windows=2, seq_len=16)).calibration
    for k in (2, 3):
        known = {}
        scorer = CalibrationScorer(six.model, windows, 2, known, lambda: None)
        every = list(itertools.combinations(range(6), k))
        got = scorer.score_many(every)
        for removal, scores in zip(every, got):
            loss, kl = _plain(six.model, windows, removal)
            assert scores["ppl"] == pytest.approx(loss, rel=1e-5) and scores["kl"] == pytest.approx(kl, rel=1e-4, abs=1e-7), removal
        blocks, heads = walk_passes(6, k)
        cost = scorer.cost.summary(len(windows))
        # the walk's block passes are its own count, each shared prefix once; the naive count, every removal through every kept block
        assert (cost["block_passes"], cost["head_passes"]) == (blocks, heads) and cost["naive_block_passes"] == math.comb(6, k) * (6 - k)
        assert cost["sets_scored"] == len(every) and json.dumps(known)  # kept as the record keeps it


@pytest.mark.searching
def test_walk_passes_is_the_trie_counted_by_hand():
    # every 2-set of 4: advances 2 + 1 + 0 (from 0, 1, 2 to their last child), finishes 2 + 1 + 0 + 1 + 0 + 0
    assert walk_passes(4, 2) == (7, 6)
    assert walk_passes(30, 3) == (31_437, 4_060)  # against the naive 4,060 x 27 = 109,620
    for n, k in ((5, 1), (6, 3), (7, 4)):  # the formula against a walk over the trie, counted here
        blocks = 0
        for prefix_len in range(1, k + 1):
            for prefix in itertools.combinations(range(n), prefix_len):
                if n - 1 - prefix[-1] < k - prefix_len:
                    continue  # no completion
                if prefix_len == k:
                    blocks += n - 1 - prefix[-1]
                else:
                    children = [c for c in range(prefix[-1] + 1, n) if n - 1 - c >= k - prefix_len - 1]
                    blocks += children[-1] - (prefix[-1] + 1)
        assert walk_passes(n, k) == (blocks, math.comb(n, k)), (n, k)


@pytest.mark.searching
def test_the_exact_optimum_is_a_brute_force_done_another_way(six, text, tmp_path, tiny_tokenizer):
    """select's exact cell at k = 2 (ppl and KL) is the best of the 15 removals, each scored here by
    the model's own forward on the calibration windows; every pick's rank is counted from them."""
    from depthcurse.select.windows import text_windows

    cfg = SelectConfig(k=2, calibration=(text,), objectives=("ppl", "kl"), searches=("exact", "greedy", "angular", "random", "last"),
                       calib_windows=4, eval_windows=3, seq_len=16, batch_size=2, search_args={"random.sets": "6"})
    record = run_select(six, cfg, tmp_path / "grid")
    windows = text_windows(tiny_tokenizer, text, cfg).calibration
    plain = {r: _plain(six.model, windows, r) for r in itertools.combinations(range(6), 2)}
    for index, objective in enumerate(("ppl", "kl")):
        best = min(plain, key=lambda r: (round(plain[r][index], 6), r))
        assert record["cells"][f"text/exact/{objective}"]["layers"] == list(best)
        d = record["distances"][f"text {objective}"]
        assert d["exact"] and d["best"] == key(best) and d["space"] == 15 and len(d["all_scores"]) == 15
        for cell, pick in d["picks"].items():
            mine = tuple(int(u) for u in pick["layers"].split(","))
            assert pick["rank"] == 1 + sum(1 for r in plain if plain[r][index] < plain[mine][index] - 1e-7), cell
    assert record["cells"]["text/last"]["layers"] == [3, 4]  # the k before the final block
    drawn = record["cells"]["text/random/ppl"]["drawn"]
    assert len(set(drawn)) == 6 and record["cells"]["text/random/kl"]["drawn"] == drawn  # one seed, the same draws for both objectives


@pytest.mark.searching
def test_exact_resumes_where_it_stopped(six, text, tmp_path):
    cfg = SelectConfig(k=2, calibration=(text,), searches=("exact",), calib_windows=3, eval_windows=2, seq_len=16, batch_size=2)
    whole = run_select(six, cfg, tmp_path / "whole")
    saved = json.loads((tmp_path / "whole" / "select.json").read_text())
    cut = {**saved, "cells": {}, "held_out": {}, "calibration_scores": {s: dict(list(v.items())[:7]) for s, v in saved["calibration_scores"].items()}}
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "select.json").write_text(json.dumps(cut))
    again = run_select(six, cfg, tmp_path / "cut")
    assert again["cells"]["text/exact/ppl"]["layers"] == whole["cells"]["text/exact/ppl"]["layers"]
    assert again["cells"]["text/exact/ppl"]["cost"]["sets_scored"] == 15 - 7  # the seven scored before the stop not scored again


# --------------------------------------------------------------------------- EvoPress


def port_of_evopress(n: int, k: int, fitness, windows: int, window_tokens: int, seed: int, block_mode: bool, population_size=1, offspring=32,
                     initially_generated=64, initial_tokens=2048, survivors_per_selection=(2, 1), tokens_per_selection=(2048, 32768),
                     max_mutations=3, generations=None):
    """`evo_drop_search.py`'s main() and selection(), line by line (IST-DASLab/EvoPress @ 50888a0), the
    model and its fitness replaced by `fitness(state, minibatch ids, tokens of the last)`, the global
    `random` seeded as their fix_seed does. Returns every selection's candidates, in order."""
    random.seed(seed)
    seen = []
    port_of_evopress.minibatches = batches = []  # each selection's (window ids, tokens of the last)
    calibration_data = [window_tokens] * windows  # each "sequence" by its length

    def selection(candidates, num_survive, num_tokens):
        minibatch_ids, tokens_used, last = [], 0, window_tokens
        while tokens_used < num_tokens:
            minibatch_id = random.randint(0, len(calibration_data) - 1)
            if minibatch_id in minibatch_ids:
                continue
            minibatch_ids.append(minibatch_id)
            if tokens_used + calibration_data[minibatch_id] > num_tokens:
                last = num_tokens - tokens_used
                tokens_used = num_tokens
            else:
                last = calibration_data[minibatch_id]
                tokens_used += calibration_data[minibatch_id]
        seen.append([copy.deepcopy(c) for c in candidates])
        batches.append((list(minibatch_ids), last))
        fitnesses = [fitness(c, minibatch_ids, last) for c in candidates]
        best_ids = np.argsort(fitnesses)[:num_survive]
        return [candidates[i] for i in best_ids], [fitnesses[i] for i in best_ids]

    total_blocks, blocks_to_remove = n, k
    generations = generations if generations is not None else int(k * (n - k) / 1.5)
    initial_population_candidates = []
    while len(initial_population_candidates) < initially_generated:
        removed_state = {"attn": [False] * total_blocks, "mlp": [False] * total_blocks}
        attn_remove_ind = random.sample(list(range(total_blocks)), blocks_to_remove)
        for ind in attn_remove_ind:
            removed_state["attn"][ind] = True
        mlp_remove_ind = random.sample(list(range(total_blocks)), blocks_to_remove)
        for ind in mlp_remove_ind:
            removed_state["mlp"][ind] = True
        if block_mode:
            removed_state["mlp"] = copy.deepcopy(removed_state["attn"])
        if removed_state in initial_population_candidates:
            continue
        initial_population_candidates.append(removed_state)
    population, train_fitnesses = selection(initial_population_candidates, population_size, initial_tokens)
    for gen_id in range(generations):
        offspring_list = []
        while len(offspring_list) < offspring:
            offspring_ = copy.deepcopy(random.choice(population))
            num_flips = min(random.randint(1, max_mutations), random.randint(1, max_mutations))
            for _ in range(num_flips):
                remove_type = random.randint(0, 1)
                subblock_type = "attn" if remove_type == 0 else "mlp"
                remove_ind = random.randint(0, total_blocks - 1)
                while offspring_[subblock_type][remove_ind]:
                    remove_ind = random.randint(0, total_blocks - 1)
                add_ind = random.randint(0, total_blocks - 1)
                while not offspring_[subblock_type][add_ind]:
                    add_ind = random.randint(0, total_blocks - 1)
                offspring_[subblock_type][remove_ind] = True
                offspring_[subblock_type][add_ind] = False
            if block_mode:
                offspring_["mlp"] = copy.deepcopy(offspring_["attn"])
            if offspring_ in offspring_list or offspring_ in population:
                continue
            offspring_list.append(offspring_)
        for num_survive, num_tokens in zip(survivors_per_selection, tokens_per_selection):
            if num_survive == survivors_per_selection[-1]:
                for i in range(len(population)):
                    if population[i] not in offspring_list:
                        offspring_list.append(population[i])
            offspring_list, train_fitnesses = selection(offspring_list, num_survive, num_tokens)
        population = offspring_list
    return seen, population[0]


def _fitness(state, ids, last):
    """A made-up fitness of a state on a minibatch: distinct for every candidate, and moved by the
    minibatch, so that a different draw would change the survivors."""
    attn = sum((i + 1) ** 1.5 for i, r in enumerate(state["attn"]) if r)
    mlp = sum((i + 2) ** 1.2 for i, r in enumerate(state["mlp"]) if r)
    return -(attn + 0.7 * mlp) + 0.01 * sum(ids) + 0.001 * last


def _state(removal, n):
    state = {"attn": [False] * n, "mlp": [False] * n}
    for u in removal:
        if isinstance(u, int):
            state["attn"][u] = state["mlp"][u] = True
        else:
            state["attn" if u[0] == "a" else "mlp"][int(u[1:])] = True
    return state


@pytest.mark.searching
@pytest.mark.parametrize("granularity", ["layer", "sub-block"])
def test_evo_makes_the_candidates_evopress_makes_one_by_one(granularity):
    """The same seed, the same scores: every selection's candidates the port's, in the same order,
    and the same final choice (30 blocks, k = 6, their defaults, 12 generations, 16 windows of 512)."""
    n, k, windows, window_tokens = 30, 6, 16, 512
    block_mode = granularity == "layer"
    seen, final = port_of_evopress(n, k, _fitness, windows, window_tokens, seed=7, block_mode=block_mode, generations=12,
                                   tokens_per_selection=(2048, 8192))
    search = Evo(EvoSettings(generations=12, tokens_per_selection="2048/8192"))
    space = Space(n, k, granularity)
    search.check(space)
    ctx = SearchContext(space=space, objective="kl", score=None, score_many=None, windows=windows, window_tokens=window_tokens, streams=None, seed=7,
                        score_on=lambda removal, ids, last: _fitness(_state(removal, n), ids, last))
    chosen = search.run(ctx)
    ours = [[_state(r, n) for r in stage["candidates"]] for stage in search.trace]
    assert len(ours) == len(seen) == 1 + 12 * 2
    assert ours == seen
    assert _state(chosen, n) == final and not ctx.notes  # 16 x 512 tokens: no stage scaled


@pytest.mark.searching
@pytest.mark.parametrize("population, survivors, stage_tokens", [(2, (4, 2), (2048, 8192)), (1, (2, 1), (2000, 7000))])
def test_evo_with_a_population_of_two_and_a_cut_last_window_makes_evopress_candidates(population, survivors, stage_tokens):
    """A population of 2 (each child copied from a random parent, which a population of 1 cannot
    show) and stages whose tokens cut their last window (2,000 of 512-token windows: 3 whole and
    464 of the 4th), which whole-window stages never reach: the same candidates, minibatches and
    cut as the port's."""
    n, k, windows, window_tokens = 30, 6, 16, 512
    seen, final = port_of_evopress(n, k, _fitness, windows, window_tokens, seed=3, block_mode=True, generations=8, population_size=population,
                                   survivors_per_selection=survivors, tokens_per_selection=stage_tokens, offspring=16)
    batches = port_of_evopress.minibatches
    search = Evo(EvoSettings(generations=8, population_size=population, survivors_per_selection="/".join(map(str, survivors)), offspring=16,
                             tokens_per_selection="/".join(map(str, stage_tokens))))
    space = Space(n, k)
    search.check(space)
    ctx = SearchContext(space=space, objective="kl", score=None, score_many=None, windows=windows, window_tokens=window_tokens, streams=None, seed=3,
                        score_on=lambda removal, ids, last: _fitness(_state(removal, n), ids, last))
    chosen = search.run(ctx)
    assert [[_state(r, n) for r in stage["candidates"]] for stage in search.trace] == seen and _state(chosen, n) == final
    assert [(stage["windows"], stage["last"]) for stage in search.trace] == batches
    if stage_tokens[0] == 2000:
        assert batches[1][1] == 2000 - 3 * 512 == 464 and batches[2][1] == 7000 - 13 * 512 == 344


@pytest.mark.searching
def test_a_stage_scores_its_cut_window_on_exactly_its_tokens(six, tiny_tokenizer, text):
    """score_on with the last window cut to t tokens: the mean over the whole windows' predictions
    and the cut one's first t - 1, computed here from the plain forward."""
    from depthcurse.select.windows import text_windows

    windows = text_windows(tiny_tokenizer, text, SelectConfig(k=2, calibration=(text,), calib_windows=4, eval_windows=2, seq_len=16)).calibration
    scorer = CalibrationScorer(six.model, windows, 2, {}, lambda: None)
    with torch.no_grad():
        ref = torch.log_softmax(six.model(input_ids=windows).logits[:, :-1].float(), -1)
        with removed_layers(six.model, (2,)):
            logp = torch.log_softmax(six.model(input_ids=windows).logits[:, :-1].float(), -1)
    loss = -logp.gather(-1, windows[:, 1:, None])[..., 0]
    expected = torch.cat([loss[3], loss[1, :6]]).mean().item()  # window 3 whole (15 predictions), window 1 cut to 7 tokens (6)
    assert scorer.score_on((2,), [3, 1], 7, "ppl") == pytest.approx(expected, rel=1e-5)
    assert scorer.score_on((2,), [3, 1], 7, "ppl") != pytest.approx(torch.cat([loss[3], loss[1, :7]]).mean().item(), rel=1e-7)


@pytest.mark.searching
@pytest.mark.parametrize("name, settings", [("evo", EvoSettings(generations=3, offspring=8, initially_generated=16)), ("random", None)])
def test_a_searchs_own_seed_setting_is_the_seed_its_draws_follow(name, settings):
    """`evo.seed` and `random.seed` set: the draws are those of that seed given as --seed, and not
    those of the --seed given."""
    from depthcurse.select.searches.random_sets import RandomSets, RandomSettings

    n, k = 12, 3

    def run(seed, own):
        cls, made = (Evo, EvoSettings(**{**settings.__dict__, "seed": own})) if name == "evo" else (RandomSets, RandomSettings(sets=6, seed=own))
        search = cls(made)
        ctx = SearchContext(space=Space(n, k), objective="kl", windows=4, window_tokens=512, streams=None, seed=seed,
                            score=lambda r: _fitness(_state(r, n), [0], 1), score_many=lambda rs: [_fitness(_state(r, n), [0], 1) for r in rs],
                            score_on=lambda r, ids, last: _fitness(_state(r, n), ids, last))
        chosen = search.run(ctx)
        return chosen, (search.trace if name == "evo" else search.drawn)

    assert run(1234, 7) == run(7, None) and run(1234, 7) != run(1234, None)


@pytest.mark.searching
def test_random_sub_block_draws_choose_the_attention_and_mlp_branches_apart():
    """EvoPress's default space: k attention and k MLP branches drawn apart, as a port draws them."""
    from depthcurse.select.searches.random_sets import RandomSets, RandomSettings

    n, k = 6, 2
    search = RandomSets(RandomSettings(sets=10))
    ctx = SearchContext(space=Space(n, k, "sub-block"), objective="kl", windows=1, window_tokens=8, streams=None, seed=5, score=None,
                        score_many=lambda rs: [0.0] * len(rs), score_on=None)
    search.run(ctx)
    rng = random.Random("random:5")
    first = [f"a{i}" for i in sorted(rng.sample(range(n), k))] + [f"m{i}" for i in sorted(rng.sample(range(n), k))]
    assert list(search.drawn[0]) == first
    assert any({u[1:] for u in r if u[0] == "a"} != {u[1:] for u in r if u[0] == "m"} for r in search.drawn)


@pytest.mark.searching
def test_a_loop_past_its_bound_is_one_line_naming_the_procedure():
    from depthcurse.select.search import Bound

    bound = Bound(3, "swm's procedure")
    for _ in range(3):
        bound.step()
    with pytest.raises(DepthcurseError, match=r"^swm's procedure did not end within its bound of 3 steps \(window 2-4\): a loop that cannot end"):
        bound.step("window 2-4")


@pytest.mark.searching
def test_evo_keeps_evopress_defaults_and_scales_its_stages_to_the_calibration_text():
    assert {f: getattr(EvoSettings(), f) for f in EvoSettings.__dataclass_fields__} == {k: v for k, v in PAPER_DEFAULTS.items() if k != "fitness"}
    assert PAPER_DEFAULTS["fitness"] == "kl" and generations_for(32, 12) == 160 and generations_for(30, 8) == 117  # their script's int(k (n - k) / 1.5)
    # cut, not rounded, as awk's int() does: at n = 32 (their models) with k one more than a multiple of 3 the two differ
    assert generations_for(32, 4) == 74 and generations_for(32, 7) == 116 and generations_for(32, 10) == 146  # 74.67, 116.67, 146.67
    assert scaled_tokens([2048, 2048, 32768], 40_000) == ([2048, 2048, 32768], 1.0)
    assert scaled_tokens([2048, 2048, 32768], 1024) == ([64, 64, 1024], 1024 / 32768)  # 8 windows x 128: the last stage every token
    assert scaled_tokens([2048, 32768], 16) == ([2, 16], 16 / 32768)  # never below one prediction


@pytest.mark.searching
def test_evo_on_a_model_says_when_it_scaled_its_stages(six, text, tmp_path):
    cfg = SelectConfig(k=2, calibration=(text,), objectives=("kl",), searches=("evo",), calib_windows=4, eval_windows=2, seq_len=16, batch_size=2,
                       search_args={"evo.generations": "2", "evo.offspring": "4", "evo.initially_generated": "5"})
    record = run_select(six, cfg, tmp_path / "evo")
    cell = record["cells"]["text/evo/kl"]
    assert len(cell["layers"]) == 2 and cell["notes"][0].startswith("evo: the calibration windows hold 64 tokens, fewer than its stages ask")
    # 5 initially; each generation 4 children, then the best 2 of them with the parent (never a child: duplicates are drawn again)
    assert cell["cost"]["subset_scores"] == 5 + 2 * (4 + 3)
    assert cell["settings"] == "offspring=4,initially_generated=5,generations=2"


# --------------------------------------------------------------------------- sub-blocks


@pytest.mark.searching
def test_sub_block_removals_score_as_branches_zeroed_by_hand(six, text, tiny_tokenizer, tmp_path):
    """A sub-block removal (attention of block 1, MLP of block 3) scores as the model with those two
    branches' outputs zeroed in its own forward; exact over C(4, 1)^2 = 16 on a 4-block model."""
    from helpers import tiny_llama

    from depthcurse.select.windows import text_windows

    windows = text_windows(tiny_tokenizer, text, SelectConfig(k=1, calibration=(text,), calib_windows=3, eval_windows=2, seq_len=16)).calibration
    scorer = CalibrationScorer(six.model, windows, 2, {}, lambda: None, granularity="sub-block")
    got = scorer(("a1", "m3"))
    zero = lambda module, args, output: (torch.zeros_like(output[0]), *output[1:]) if isinstance(output, tuple) else torch.zeros_like(output)  # noqa: E731
    hooks = [six.model.model.layers[1].self_attn.register_forward_hook(zero), six.model.model.layers[3].mlp.register_forward_hook(zero)]
    try:
        with torch.no_grad():
            logp = torch.log_softmax(six.model(input_ids=windows).logits[:, :-1].float(), -1)
    finally:
        for h in hooks:
            h.remove()
    assert got["ppl"] == pytest.approx((-logp.gather(-1, windows[:, 1:, None])[..., 0]).mean().item(), rel=1e-5)
    path = tmp_path / "four"
    tiny_llama(len(tiny_tokenizer), layers=4, seed=5).save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    four = load_model(str(path))
    cfg = SelectConfig(k=1, calibration=(text,), searches=("exact", "last", "random"), calib_windows=3, eval_windows=2, seq_len=16, batch_size=2,
                       granularity="sub-block", search_args={"random.sets": "4"})
    record = run_select(four, cfg, tmp_path / "sub")
    scores = record["calibration_scores"][text]
    assert len([k for k in scores if len(k.split(",")) == 2]) == 16
    best = min((v[0], k) for k, v in scores.items() if len(k.split(",")) == 2)[1]
    assert ",".join(record["cells"]["text/exact/ppl"]["layers"]) == best and record["cells"]["text/last"]["layers"] == ["a2", "m2"]


# --------------------------------------------------------------------------- the contract and the bad input


PLUGIN = '''
from depthcurse.select.search import Search

class Middle(Search):
    name = "middle"
    reads = "nothing"
    def run(self, ctx):
        start = (ctx.space.n - ctx.space.k) // 2
        return tuple(range(start, start + ctx.space.k))

class TooMany(Search):
    name = "too-many"
    reads = "nothing"
    def run(self, ctx):
        return tuple(range(ctx.space.k + 1))

class Raises(Search):
    name = "raises"
    def run(self, ctx):
        return ctx.score_many([(0,)])[5]
'''


@pytest.mark.searching
def test_a_search_from_outside_runs_and_one_that_breaks_the_contract_is_one_line(run_cli, six, text, tmp_path):
    plugin = tmp_path / "my_searches.py"
    plugin.write_text(PLUGIN)
    cfg = SelectConfig(k=2, calibration=(text,), searches=(f"{plugin}:Middle", "last"), calib_windows=3, eval_windows=2, seq_len=16)
    record = run_select(six, cfg, tmp_path / "plug")
    assert record["cells"]["text/middle"]["layers"] == [2, 3]
    with pytest.raises(DepthcurseError, match=r"^--search too-many: run\(\) chose no removal of this grid: it removes 3 blocks, not k = 2$"):
        run_select(six, SelectConfig(k=2, calibration=(text,), searches=(f"{plugin}:TooMany",), calib_windows=3, eval_windows=2, seq_len=16), tmp_path / "bad1")
    with pytest.raises(DepthcurseError, match=r"^--search raises: its run\(\) raised IndexError: list index out of range$"):
        run_select(six, SelectConfig(k=2, calibration=(text,), searches=(f"{plugin}:Raises",), calib_windows=3, eval_windows=2, seq_len=16), tmp_path / "bad2")


@pytest.mark.searching
def test_a_failed_cell_loses_no_finished_one(six, text, tmp_path):
    plugin = tmp_path / "my_searches.py"
    plugin.write_text(PLUGIN)
    cfg = SelectConfig(k=2, calibration=(text,), searches=("last", f"{plugin}:Raises"), calib_windows=3, eval_windows=2, seq_len=16)
    with pytest.raises(DepthcurseError):
        run_select(six, cfg, tmp_path / "grid")
    assert json.loads((tmp_path / "grid" / "select.json").read_text())["cells"]["text/last"]["layers"] == [3, 4]


def test_select_with_searches_on_the_command_line_and_its_bad_input(run_cli, tiny_model_dir, text, tmp_path):
    code, stdout, err = run_cli("select", tiny_model_dir, "--k", "2", "--calibration", text, "--search", "exact,greedy,angular,evo,random", "--calib-windows", "4",
                                "--eval-windows", "8", "--seq-len", "16", "--search-args", "evo.generations=2,evo.offspring=3,evo.initially_generated=4,random.sets=3",
                                "--out", tmp_path / "cli")
    assert code == 0, err
    said = " ".join(stdout.split())
    assert "how far each pick of 2 is from the best" in said and "text ppl: the exact optimum removes" in said
    assert (tmp_path / "cli" / "distances.png").is_file()
    base = ["select", tiny_model_dir, "--calibration", text, "--calib-windows", "2", "--eval-windows", "2", "--seq-len", "16", "--out", tmp_path / "bad"]
    for args, said in (
        (["--search", "magic"], "--search magic: use angular, bi, draft-verify, evo, exact, greedy, laco, last, one-shot, random, swift, swm"),
        (["--k", "4", "--search", "exact"], "--k 4 is out of range: the model has 4 layers (1-3)"),
        (["--k", "2", "--search", "exact", "--search-args", "exact.max_sets=3"], "--search exact: C(4, 2) = 6 removals, more than exact.max_sets=3"),
        (["--k", "1", "--search", "evo", "--search-args", "evo.offspring=1"], "survivors cannot outnumber the offspring"),
        (["--k", "1", "--search", "evo", "--search-args", "evo.tokens_per_selection=2048"], "must have one entry per selection stage each"),
        (["--k", "1", "--search", "evo"], "initially_generated (64) is more than the 4 distinct removals of C(4, 1)"),
        (["--k", "1", "--search", "greedy", "--granularity", "sub-block"], "--search greedy removes layer units, not sub-block"),
        (["--k", "1", "--search", "exact", "--granularity", "columns"], "unknown --granularity 'columns'"),
        (["--k", "1", "--search", "exact", "--search-args", "exact.budget=3"], "--search-args exact.budget: exact has no setting 'budget'"),
        (["--k", "1", "--search", "exact", "--search-args", "max_sets=lots"], "--search-args max_sets=lots: exact's max_sets takes int"),
    ):
        assert_one_line_error(*run_cli(*base, *args), said)


def test_prune_greedy_beside_an_exact_run_says_where_its_pick_falls(run_cli, tiny_model_dir, text, tmp_path):
    out = tmp_path / "both"
    assert run_cli("select", tiny_model_dir, "--k", "2", "--calibration", text, "--search", "exact", "--calib-windows", "3", "--eval-windows", "2",
                   "--seq-len", "16", "--out", out)[0] == 0
    code, stdout, err = run_cli("prune", tiny_model_dir, "--task", "ppl", "--data", text, "--seq-len", "16", "--limit", "4", "--greedy", "2", "--out", out)
    assert code == 0, err
    said = " ".join(stdout.split())
    assert "- optimum at k = 2 (select's exact, ppl on text's 3 calibration windows x 16 tokens): without" in said and "greedy's" in said


@pytest.mark.searching
def test_exacts_budget_says_the_work_and_the_time_by_value_and_its_walk_ties_to_the_first(monkeypatch):
    """C(10, 3) = 120 removals: 120 allowed runs, 119 is refused with the prefix walk's 322 block
    passes (`walk_passes`, counted by hand above) and, with a measured timing (0.5 s a block pass, 2 s a
    head pass), 322 x 0.5 + 120 x 2 = 401 s, "about 7 minutes"; sub-blocks (C(4, 2)^2 = 36) say
    36 x 4 = 144 block passes. Run in chunks of 4 over C(5, 2) = 10: the phases count what is
    scored, and of two equal best scores the first in lexicographic order is chosen."""
    import re

    from depthcurse.select.estimate import PassTiming, mean_run
    from depthcurse.select.searches import exact as exact_module
    from depthcurse.select.searches.exact import Exact, ExactSettings

    Exact(ExactSettings(max_sets=120)).check(Space(10, 3))
    Exact(ExactSettings(max_sets=1)).check(Space(3, 3))
    said = ("--search exact: C(10, 3) = 120 removals, more than exact.max_sets=119 (322 block passes and 120 head passes by the prefix walk): "
            "give --search-args exact.max_sets=120 to run it, or a smaller --k")
    with pytest.raises(DepthcurseError, match="^" + re.escape(said) + "$"):
        Exact(ExactSettings(max_sets=119)).check(Space(10, 3))
    with pytest.raises(DepthcurseError, match=re.escape("by the prefix walk, about 7 minutes): give")):
        Exact(ExactSettings(max_sets=119)).check(Space(10, 3, timing=PassTiming(0.5, 2.0)))
    with pytest.raises(DepthcurseError, match="^" + re.escape("--search exact: C(4, 2)^2 (k attention and k MLP branches) = 36 removals, more than "
                                                             "exact.max_sets=35 (about 144 block passes): give --search-args exact.max_sets=36")):
        Exact(ExactSettings(max_sets=35)).check(Space(4, 2, "sub-block"))
    with pytest.raises(DepthcurseError, match=r"^--search-args exact.max_sets must be at least 1, got 0$"):
        Exact(ExactSettings(max_sets=0)).check(Space(3, 1))
    assert Exact().passes(Space(10, 3), 0) == (322.0, 120.0)
    assert Exact().passes(Space(4, 2, "sub-block"), 0) == (36 * mean_run(4, 2, "sub-block"), 36.0) == (134.0, 36.0)

    monkeypatch.setattr(exact_module, "CHUNK", 4)
    scores = {(0, 1): 3.0, (0, 2): 1.0, (3, 4): 1.0, (1, 3): 2.0}  # (0, 2) and (3, 4) tie for the best
    phases, asked = [], []

    def score_many(chunk):
        asked.append(list(chunk))
        return [scores.get(r, 5.0) for r in chunk]

    ctx = SearchContext(space=Space(5, 2), objective="kl", score=None, score_many=score_many, score_on=None, windows=2, window_tokens=8, streams=None,
                        seed=0, phase=phases.append)
    assert Exact().run(ctx) == (0, 2)
    assert phases == ["exact: 0 of 10 removals scored", "exact: 4 of 10 removals scored", "exact: 8 of 10 removals scored"]
    assert [len(c) for c in asked] == [4, 4, 2] and sum(asked, []) == list(Space(5, 2).every())


@pytest.mark.searching
def test_random_checks_its_count_and_draws_branches_as_a_port_draws_them():
    """sets = 1 and sets = every removal run; 0 and one more than there are are refused by value; the
    passes are sets x the mean run of the granularity; at branch granularity the draws are k of the
    2n branches, sampled as one, in the port's order, and the best scored is chosen."""
    import re

    from depthcurse.select.estimate import mean_run
    from depthcurse.select.searches.random_sets import RandomSets, RandomSettings

    RandomSets(RandomSettings(sets=1)).check(Space(4, 2))
    RandomSets(RandomSettings(sets=6)).check(Space(4, 2))
    with pytest.raises(DepthcurseError, match=r"^--search-args random.sets must be at least 1, got 0$"):
        RandomSets(RandomSettings(sets=0)).check(Space(4, 2))
    with pytest.raises(DepthcurseError, match="^" + re.escape("--search-args random.sets=29 is more than the 28 removals there are: use exact for all of them") + "$"):
        RandomSets(RandomSettings(sets=29)).check(Space(4, 2, "branch"))
    for granularity in ("layer", "sub-block", "branch"):
        assert RandomSets(RandomSettings(sets=7)).passes(Space(6, 2, granularity), 0) == (7 * mean_run(6, 2, granularity), 7.0)
    assert mean_run(6, 2, "layer") != mean_run(6, 2, "branch")

    n, k = 5, 3
    search = RandomSets(RandomSettings(sets=8))
    score = lambda r: sum(int(u[1:]) * (1 if u[0] == "a" else 1.5) for u in r)  # noqa: E731 (made up: the lowest branches cost least)
    ctx = SearchContext(space=Space(n, k, "branch"), objective="kl", windows=1, window_tokens=8, streams=None, seed=9, score=None,
                        score_many=lambda rs: [score(r) for r in rs], score_on=None)
    chosen = search.run(ctx)
    rng, port = random.Random("random:9"), {}
    units = [f"a{i}" for i in range(n)] + [f"m{i}" for i in range(n)]
    while len(port) < 8:
        port.setdefault(tuple(sorted(rng.sample(units, k), key=lambda u: (u[0], int(u[1:])))), None)
    assert search.drawn == list(port) and chosen == min(port, key=score)
    assert any(sum(u[0] == "a" for u in r) != sum(u[0] == "m" for u in r) for r in search.drawn)  # either kind, in any mix


@pytest.mark.searching
def test_evo_checks_each_setting_by_value_counts_its_passes_by_hand_and_says_its_phases_and_scaling():
    """Every refusal's line and every edge that passes; the passes of population 1, 4 offspring, 6
    first draws of 64 tokens, stages 2/1 on 64/128 tokens, 3 generations, over 256 tokens:
    6 x 64/256 + 3 x (4 x 64/256 + (2 + 1) x 128/256) = 1.5 + 3 x 2.5 = 9 head passes, times the mean
    run; and a run on 2 windows of 16 tokens with generations left to their rule (k (n - k) / 1.5 =
    8 at n = 8, k = 2): its phases, and its stages scaled by 32/128 = 0.25, said by value."""
    import re

    from depthcurse.select.estimate import mean_run

    space = Space(8, 2)  # C(8, 2) = 28 removals
    fine = dict(population_size=2, offspring=26, initially_generated=28, survivors_per_selection="26/2", tokens_per_selection="64/128", generations=0)
    Evo(EvoSettings(**fine)).check(space)  # every edge at once: generations 0, the first stage keeps every child, all 28 drawn, 26 + 2 = 28
    for change, said in (
            ({"population_size": 0, "survivors_per_selection": "2/1"}, "--search-args evo.population_size must be at least 1, got 0"),
            ({"offspring": 0}, "--search-args evo.offspring must be at least 1, got 0"),
            ({"initially_generated": 0}, "--search-args evo.initially_generated must be at least 1, got 0"),
            ({"initial_tokens": 0}, "--search-args evo.initial_tokens must be at least 1, got 0"),
            ({"max_mutations": 0}, "--search-args evo.max_mutations must be at least 1, got 0"),
            ({"generations": -1}, "--search-args evo.generations must be 0 or more, got -1"),
            ({"tokens_per_selection": "64"}, "--search-args evo: survivors_per_selection 26/2 and tokens_per_selection 64 must have one entry per "
                                             "selection stage each (2 against 1)"),
            ({"survivors_per_selection": "26/1"}, "--search-args evo: the last stage keeps 1, which must be population_size (2)"),
            ({"survivors_per_selection": "27/2", "offspring": 25}, "--search-args evo: its first stage keeps 27 of 25 offspring: survivors cannot outnumber the offspring"),
            ({"initially_generated": 1}, "--search-args evo: population_size 2 is more than the 1 removals initially generated it is chosen from"),
            ({"initially_generated": 29}, "--search-args evo: initially_generated (29) is more than the 28 distinct removals of C(8, 2): the search would "
                                          "never find enough (use exact)"),
            ({"offspring": 27, "survivors_per_selection": "27/2"}, "--search-args evo: offspring + population_size (29) is more than the 28 distinct removals"),
            ({"survivors_per_selection": "26/x"}, "--search-args evo.survivors_per_selection=26/x: give whole numbers separated by /, e.g. 2/1"),
            ({"tokens_per_selection": "64/0"}, "--search-args evo.tokens_per_selection=64/0: each stage needs at least 1")):
        with pytest.raises(DepthcurseError, match="^" + re.escape(said)):
            Evo(EvoSettings(**{**fine, **change})).check(space)

    counted = EvoSettings(population_size=1, offspring=4, initially_generated=6, initial_tokens=64, survivors_per_selection="2/1",
                          tokens_per_selection="64/128", generations=3)
    assert Evo(counted).passes(space, 256) == (9.0 * mean_run(8, 2), 9.0)
    assert Evo(EvoSettings(**{**counted.__dict__, "generations": None})).passes(space, 256)[1] == 1.5 + 8 * 2.5  # their rule: int(2 x 6 / 1.5) = 8 generations

    phases = []
    search = Evo(EvoSettings(offspring=4, initially_generated=6, initial_tokens=64, tokens_per_selection="64/128"))
    ctx = SearchContext(space=space, objective="kl", score=None, score_many=None, windows=2, window_tokens=16, streams=None, seed=2,
                        score_on=lambda r, ids, last: _fitness(_state(r, 8), ids, last), phase=phases.append)
    search.run(ctx)
    assert phases == ["evo: the first population", *(f"evo: generation {g} of 8" for g in range(1, 9))]
    assert ctx.notes == ["evo: the calibration windows hold 32 tokens, fewer than its stages ask (64 for the first population; 64, then 128 in each "
                         "generation): every stage scaled by 0.25, to 16; 16, then 32 (the largest: every calibration token)"]
    assert [t["tokens"] for t in search.trace] == [16, *([16, 32] * 8)] and search.trace[0]["last"] == 16 and len(search.trace[0]["windows"]) == 1


@pytest.mark.searching
def test_greedy_and_block_influence_pinned_by_value():
    """Greedy's estimate: k = 1 is one walk over the n single removals (trie_passes of them: 15 block
    passes and 6 head passes at n = 6, each of the 8 draws the same); k = 2 adds the second step's
    walks for 8 seeded draws of the first (26.5 at n = 6, the draws of random.Random(0)). Its phases
    count its steps; Block Influence takes the k least influential blocks, ties to the lower."""
    from depthcurse.select.estimate import trie_passes
    from depthcurse.select.searches.bi import BlockInfluence
    from depthcurse.select.searches.greedy import Greedy

    assert Greedy().passes(Space(6, 1), 0) == (float(trie_passes([[u] for u in range(6)], 6)), 6.0) == (15.0, 6.0)
    assert Greedy().passes(Space(6, 2), 0) == (26.5, 11.0)
    phases = []
    ctx = SearchContext(space=Space(5, 3), objective="kl", score=None, score_many=lambda rs: [sum(r) for r in rs], score_on=None, windows=1,
                        window_tokens=4, streams=None, seed=0, phase=phases.append)
    assert Greedy().run(ctx) == (0, 1, 2) and phases == ["greedy step 1 of 3", "greedy step 2 of 3", "greedy step 3 of 3"]
    assert BlockInfluence().passes(Space(7, 2), 0) == (7.0, 0.0)
    streams = type("Streams", (), {"block_influence": [0.3, 0.1, 0.2, 0.1, 0.5]})()
    ctx = SearchContext(space=Space(5, 2), objective="kl", score=None, score_many=None, score_on=None, windows=1, window_tokens=4,
                        streams=lambda: streams, seed=0)
    assert BlockInfluence().run(ctx) == (1, 3)
    ctx = SearchContext(space=Space(5, 3), objective="kl", score=None, score_many=None, score_on=None, windows=1, window_tokens=4,
                        streams=lambda: type("S", (), {"block_influence": [0.9, 0.2, 0.2, 0.2, 0.2]})(), seed=0)
    assert BlockInfluence().run(ctx) == (1, 2, 3)  # four tie: the three lowest


@pytest.mark.searching
def test_a_stage_of_three_windows_scores_every_objective_as_the_plain_forward_does(six, tiny_tokenizer, text):
    """Windows 3, 0 and 1 cut to 7 tokens: loss and KL the mean over the whole windows' predictions
    and the cut one's first 6; rejection 1 - the top-1 agreement over the same predictions; the
    speedup objective 1 / expected speedup at that agreement, the draft without block 2 (by
    `DraftCosts`, here made up: gamma 3, a block 0.1 of a step, a check 1.2 steps)."""
    from depthcurse.select.windows import text_windows
    from depthcurse.speculate.costs import DraftCosts

    windows = text_windows(tiny_tokenizer, text, SelectConfig(k=2, calibration=(text,), calib_windows=4, eval_windows=2, seq_len=16)).calibration
    costs = DraftCosts(gamma=3, block_share=0.1, verify=1.2)
    scorer = CalibrationScorer(six.model, windows, 2, {}, lambda: None, costs=costs)
    with torch.no_grad():
        ref = torch.log_softmax(six.model(input_ids=windows).logits[:, :-1].float(), -1)
        with removed_layers(six.model, (2,)):
            logp = torch.log_softmax(six.model(input_ids=windows).logits[:, :-1].float(), -1)
    loss = -logp.gather(-1, windows[:, 1:, None])[..., 0]
    kl = torch.nn.functional.kl_div(logp, ref, log_target=True, reduction="none").sum(-1)
    agree = (logp.argmax(-1) == ref.argmax(-1)).float()
    pick = lambda t: torch.cat([t[3], t[0], t[1, :6]]).mean().item()  # noqa: E731
    assert scorer.score_on_many([(2,)], [3, 0, 1], 7, "ppl") == [pytest.approx(pick(loss), rel=1e-5)]
    assert scorer.score_on_many([(2,)], [3, 0, 1], 7, "kl") == [pytest.approx(pick(kl), rel=1e-5, abs=1e-7)]
    assert scorer.score_on_many([(2,)], [3, 0, 1], 7, "acceptance") == [pytest.approx(1.0 - pick(agree), abs=1e-7)]
    assert scorer.score_on_many([(2,), (1, 2)], [3, 0, 1], 7, "speedup") == [pytest.approx(costs.time_per_token(pick(agree), (2,)), rel=1e-6),
                                                                              pytest.approx(scorer.score_on_many([(1, 2)], [3, 0, 1], 7, "speedup")[0])]
    assert scorer.cost.subset_scores == 6 and scorer.cost.tokens == 6 * (16 + 16 + 7)
    whole = -ref.gather(-1, windows[:, 1:, None])[..., 0].mean(-1)  # nothing removed: the unpruned model, per window
    losses, kls, agreements = scorer.unpruned_windows()
    assert losses == pytest.approx(whole.tolist(), rel=1e-5) and kls == [0.0] * 4 and agreements == [1.0] * 4
    assert scorer.score_many([()]) == [{"ppl": pytest.approx(whole.mean().item(), rel=1e-5), "kl": 0.0, "acceptance": 0.0,
                                        "speedup": pytest.approx(costs.time_per_token(1.0, ()))}]
    # both branches of block 2 skipped: the same predictions as block 2 removed, and a draft one block shorter (two branches, half a block each)
    branches = CalibrationScorer(six.model, windows, 2, {}, lambda: None, "sub-block", costs=costs)
    assert branches.score_on_many([("a2", "m2")], [3, 0, 1], 7, "speedup") == [pytest.approx(costs.time_per_token(pick(agree), (2,)), rel=1e-6)]
    # priced apart (made up: an attention branch 0.02 of a step, an MLP branch 0.08): the same agreement, a cheaper draft
    apart = DraftCosts(gamma=3, block_share=0.1, verify=1.2, attention_share=0.02, mlp_share=0.08)
    priced = CalibrationScorer(six.model, windows, 2, {}, lambda: None, "sub-block", costs=apart)
    e = (1 - pick(agree) ** 4) / (1 - pick(agree))
    assert priced.score_on_many([("a2", "m2")], [3, 0, 1], 7, "speedup") == [pytest.approx((3 * (1 - 0.1) + 1.2) / e, rel=1e-6)]


@pytest.mark.searching
def test_a_costs_summary_and_difference_by_value():
    from depthcurse.select.scoring import Cost

    now = Cost(window_blocks=30, window_heads=12, sets=5, subset_scores=7, tokens=900, seconds=2.34567, naive_window_blocks=48)
    before = Cost(window_blocks=6, window_heads=2, sets=1, subset_scores=3, tokens=100, seconds=0.5, naive_window_blocks=8)
    assert now.minus(before) == Cost(window_blocks=24, window_heads=10, sets=4, subset_scores=4, tokens=800, seconds=pytest.approx(1.84567),
                                     naive_window_blocks=40)
    assert now.summary(4) == {"block_passes": 7.5, "head_passes": 3.0, "naive_block_passes": 12.0, "sets_scored": 5, "subset_scores": 7,
                              "tokens_scored": 900, "seconds": 2.346}


@pytest.mark.searching
def test_a_kept_score_of_an_earlier_record_is_measured_again_only_where_it_lacks_what_is_asked(six, tiny_tokenizer, text):
    """A removal kept with three scores (before the speedup objective) or with no speedup where the
    costs are known is measured again; one kept whole is not (its made-up values come back)."""
    from depthcurse.select.windows import text_windows
    from depthcurse.speculate.costs import DraftCosts

    windows = text_windows(tiny_tokenizer, text, SelectConfig(k=2, calibration=(text,), calib_windows=2, eval_windows=2, seq_len=16)).calibration
    made_up = [9.0, 8.0, 0.7, 0.5]
    costs = DraftCosts(gamma=3, block_share=0.1, verify=1.2)
    known = {"1": made_up[:3], "2": [9.0, 8.0, 0.7, None], "3": list(made_up)}
    scorer = CalibrationScorer(six.model, windows, 2, known, lambda: None, costs=costs)
    scores = scorer.score_many([(1,), (2,), (3,)])
    assert scores[2] == dict(zip(("ppl", "kl", "acceptance", "speedup"), made_up))
    assert scores[0]["ppl"] != 9.0 and scores[1]["ppl"] != 9.0 and scores[1]["speedup"] is not None and len(known["1"]) == 4
    plain = CalibrationScorer(six.model, windows, 2, {"2": [9.0, 8.0, 0.7, None]}, lambda: None)  # no costs: a missing speedup is not asked
    assert plain.score_many([(2,)]) == [{"ppl": 9.0, "kl": 8.0, "acceptance": 0.7, "speedup": None}]


@pytest.mark.searching
def test_two_ranks_in_threads_share_the_removals_and_give_one_processs_scores_and_blocks(six, tiny_tokenizer, text):
    """The torchrun path in one process: two scorers, each on its own copy of the model, exchange
    their shares through a stand-in world (a barrier and a list); each gets every score in order,
    as one scorer alone computes them, and the blocks both ran added to its cost."""
    import copy
    import threading

    from depthcurse.select.windows import text_windows

    windows = text_windows(tiny_tokenizer, text, SelectConfig(k=2, calibration=(text,), calib_windows=2, eval_windows=2, seq_len=16)).calibration
    removals = [(0, 1), (0, 2), (1, 3), (2, 4), (4, 5)]
    alone = CalibrationScorer(six.model, windows, 2, {}, lambda: None)
    expected = alone.score_many(removals)
    barrier, slots = threading.Barrier(2), [None, None]

    class ThreadWorld:
        size, parallel = 2, "requests"

        def __init__(self, rank):
            self.rank = rank

        @property
        def main(self):
            return self.rank == 0

        def all_gather(self, obj):
            slots[self.rank] = obj
            barrier.wait()
            out = list(slots)
            barrier.wait()
            return out

    results, scorers = [None, None], [CalibrationScorer(copy.deepcopy(six.model), windows, 2, {}, lambda: None, world=ThreadWorld(r)) for r in (0, 1)]

    def run(rank):
        results[rank] = scorers[rank].score_many(removals)

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    for got in results:
        assert [d["kl"] for d in got] == pytest.approx([d["kl"] for d in expected], rel=1e-5, abs=1e-7)
        assert [d["ppl"] for d in got] == pytest.approx([d["ppl"] for d in expected], rel=1e-5)
    # each rank's cost holds both ranks' blocks: at least the one walk's, at most its shares' prefixes run twice
    assert scorers[0].cost.window_blocks == scorers[1].cost.window_blocks >= alone.cost.window_blocks
    assert scorers[0].cost.window_heads == scorers[1].cost.window_heads == alone.cost.window_heads


@pytest.mark.searching
def test_angular_takes_the_first_of_the_streams_choices():
    """The angular pass ranks its candidate runs best first (`block_choices`): the search takes the first."""
    from depthcurse.select.searches.angular import Angular

    run = lambda layers: type("Choice", (), {"layers": layers})()  # noqa: E731
    streams = type("Streams", (), {"block_choices": lambda self, k: [run([3, 4]), run([1, 2])]})()
    ctx = SearchContext(space=Space(6, 2), objective="kl", score=None, score_many=None, score_on=None, windows=1, window_tokens=4,
                        streams=lambda: streams, seed=0)
    assert Angular().run(ctx) == (3, 4)


@pytest.mark.searching
def test_each_procedures_bound_says_its_name_and_where_it_stood(monkeypatch, tiny_tokenizer):
    """Each loop held to a bound of 2 steps here (the bound's own test: `Bound`), as a bug that never
    ends would meet it: random drawing the same removal for ever, evo's first population likewise,
    SWM's and LaCo's procedures on a 6-layer model; each one line naming the procedure and where it
    stood."""
    import re

    from depthcurse.select import search as search_module
    from depthcurse.select.searches import evo as evo_module
    from depthcurse.select.searches import laco as laco_module
    from depthcurse.select.searches import random_sets as random_module
    from depthcurse.select.searches import swm as swm_module
    from depthcurse.select.searches.laco import LacoSearchSettings, laco_procedure
    from depthcurse.select.searches.random_sets import RandomSets, RandomSettings
    from depthcurse.select.searches.swm import SwmSearchSettings, swm_procedure
    from helpers import tiny_llama

    small = lambda limit, procedure: search_module.Bound(2, procedure)  # noqa: E731
    for module in (random_module, evo_module, swm_module, laco_module):
        monkeypatch.setattr(module, "Bound", small)

    class Stuck(random.Random):  # every draw the same: no second distinct removal is ever found
        def sample(self, population, k):
            return list(population)[:k]

    monkeypatch.setattr(random_module.random, "Random", Stuck)
    ctx = SearchContext(space=Space(6, 2), objective="kl", score=None, score_many=lambda rs: [0.0] * len(rs), score_on=None, windows=1,
                        window_tokens=8, streams=None, seed=0)
    with pytest.raises(DepthcurseError, match=re.escape("random's draws did not end within its bound of 2 steps (1 of 3 distinct removals found)")):
        RandomSets(RandomSettings(sets=3)).run(ctx)
    monkeypatch.setattr(evo_module.random, "Random", Stuck)
    ctx = SearchContext(space=Space(6, 2), objective="kl", score=None, score_many=None, windows=1, window_tokens=8, streams=None, seed=0,
                        score_on=lambda r, ids, last: 0.0)
    with pytest.raises(DepthcurseError, match=re.escape("evo's first population did not end within its bound of 2 steps (1 of 4 distinct removals found)")):
        Evo(EvoSettings(initially_generated=4, offspring=2)).run(ctx)
    model = tiny_llama(300, layers=6, seed=1)
    windows = torch.randint(3, 300, (2, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(DepthcurseError, match=re.escape("swm's procedure did not end within its bound of 2 steps (window 1-4)")):
        swm_procedure(model, windows, SwmSearchSettings(threshold=-0.99))
    with pytest.raises(DepthcurseError, match=re.escape("laco's procedure did not end within its bound of 2 steps (layer 1)")):
        laco_procedure(model, windows, LacoSearchSettings(merge_layers=2, threshold=0.9999, highest=5))


@pytest.mark.searching
def test_a_resamples_stage_windows_are_the_windows_it_drew():
    """EvoPress's stages on a resample: stage window 0 and 2 of the draws [5, 2, 2, 7] are calibration
    windows 5 and 2, not 0 and 2 (issue 80)."""
    from depthcurse.select.stability import Resampled

    asked = []

    class Scorer:
        def score_on_many(self, removals, windows, last, objective):
            asked.append((list(removals), list(windows), last, objective))
            return [0.25] * len(removals)

    assert Resampled(Scorer(), [5, 2, 2, 7]).score_on_many([(1, 2)], [0, 2, 3], 9, "kl") == [0.25]
    assert asked == [([(1, 2)], [5, 2, 7], 9, "kl")]


@pytest.mark.searching
def test_the_pass_timing_of_a_model_the_stepper_cannot_run_shares_its_forward_with_the_head():
    """GPT-2 (no stepper): one forward's seconds shared over its blocks and its head by parameters, by a
    clock the test controls: 12 s over 3 blocks and head_blocks(model) blocks' worth of head (issue 80)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from depthcurse.select.estimate import head_blocks, pass_timing

    model = GPT2LMHeadModel(GPT2Config(vocab_size=900, n_embd=32, n_layer=3, n_head=4, n_positions=64)).eval()
    ticks = iter([0.0, 12.0])
    timing = pass_timing(model, torch.randint(0, 900, (2, 8)), 2, clock=lambda: next(ticks))
    per_block = 12.0 / (3 + head_blocks(model))
    assert timing.block == pytest.approx(per_block) and timing.head == pytest.approx(per_block * head_blocks(model)) and head_blocks(model) > 1


@pytest.mark.searching
def test_masked_scores_count_only_the_scored_predictions_by_hand(six, tiny_tokenizer, text):
    """A mask (the model's own continuations: only a draft's predictions): each window's mean over its
    scored predictions, by hand on 2 x 4; the scorer's per-window scores and an EvoPress stage's (a
    window cut to 7 tokens) the masked means of the plain forward's per-prediction figures; a stage
    whose only window is cut before its first scored prediction counts every prediction."""
    from depthcurse.select.scoring import masked_means
    from depthcurse.select.windows import text_windows

    values = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    assert masked_means(values, torch.tensor([[0.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])) == [2.5, 5.0]
    assert masked_means(values, None) == [2.5, 6.5]
    windows = text_windows(tiny_tokenizer, text, SelectConfig(k=2, calibration=(text,), calib_windows=4, eval_windows=2, seq_len=16)).calibration
    mask = torch.zeros(4, 15)
    mask[:, 8:] = 1.0
    mask[1, 3] = 1.0
    scorer = CalibrationScorer(six.model, windows, 2, {}, lambda: None, mask=mask)
    with torch.no_grad():
        ref = torch.log_softmax(six.model(input_ids=windows).logits[:, :-1].float(), -1)
        with removed_layers(six.model, (2,)):
            logp = torch.log_softmax(six.model(input_ids=windows).logits[:, :-1].float(), -1)
    loss = -logp.gather(-1, windows[:, 1:, None])[..., 0]
    agree = (logp.argmax(-1) == ref.argmax(-1)).float()
    losses, kls, agreements = scorer.per_window([(2,)])[0]
    assert losses == pytest.approx(((loss * mask).sum(1) / mask.sum(1)).tolist(), rel=1e-5)
    assert agreements == pytest.approx(((agree * mask).sum(1) / mask.sum(1)).tolist(), abs=1e-6)
    assert scorer.unpruned_windows()[0] == pytest.approx(((-ref.gather(-1, windows[:, 1:, None])[..., 0] * mask).sum(1) / mask.sum(1)).tolist(), rel=1e-5)
    pieces = torch.cat([loss[3] * mask[3], loss[1, :6] * mask[1, :6]]).sum() / torch.cat([mask[3], mask[1, :6]]).sum()
    assert scorer.score_on_many([(2,)], [3, 1], 7, "ppl") == [pytest.approx(pieces.item(), rel=1e-5)]
    assert scorer.score_on_many([(2,)], [1], 7, "acceptance") == [pytest.approx(1 - agree[1, 3].item(), abs=1e-6)]  # one scored prediction before the cut
    assert scorer.score_on_many([(2,)], [0], 7, "acceptance") == [pytest.approx(1 - agree[0, :6].mean().item(), abs=1e-6)]  # none: every one
