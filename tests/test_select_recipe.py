"""`select`'s answer for a newcomer (issue 71): the recipe, the pick's stability over bootstrap
resamples of the calibration windows (against resamples done by hand, each a scorer on the drawn
windows), each search's cost estimate (its counts against the scorer's own, its timing under a
clock the test controls), and the one-line errors."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from helpers import assert_one_line_error
from test_search import six, text  # noqa: F401 (select's text and six-layer model, the same fixtures)

from depthcurse.loading import load_model
from depthcurse.select import SelectConfig
from depthcurse.select.estimate import PassTiming, mean_run, pass_timing, trie_passes
from depthcurse.select.recipe import recipe
from depthcurse.select.scoring import CalibrationScorer
from depthcurse.select.search import Space, build_searches, key
from depthcurse.select.searches.exact import walk_passes
from depthcurse.select.stability import draws, summary, verdict

# fast on tiny models: `make mutate` runs these against each mutant, but those through the command line (conftest marks them `cli`)
pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.instruments]


def _windows(tokenizer, text, windows=5):
    from depthcurse.select.windows import text_windows

    return text_windows(tokenizer, text, SelectConfig(k=2, calibration=(text,), calib_windows=windows, eval_windows=2, seq_len=16)).calibration


# --------------------------------------------------------------------------- the estimate's counts
def test_the_walk_count_for_any_removals_is_the_closed_form_for_every_k_set_and_the_scorers_own_count(six, tiny_tokenizer, text):
    for n, k in ((6, 2), (7, 3), (9, 4)):
        assert trie_passes(list(itertools.combinations(range(n), k)), n) == walk_passes(n, k)[0]
    windows = _windows(tiny_tokenizer, text)
    scorer = CalibrationScorer(six.model, windows, 2, {}, lambda: None)
    removals = [(0, 3), (0, 4), (1, 2), (2, 5), (4,)]  # shared prefixes, and a removal of another size
    scorer.score_many(removals)
    assert scorer.cost.summary(len(windows))["block_passes"] == trie_passes(removals, 6) == 12  # 0: 2 + 2, then 1 + 1; 1: 0 + 3; 2: 2 + 0; 4: 1


@pytest.mark.statistics
@pytest.mark.parametrize("granularity", ["layer", "sub-block", "branch"])
def test_a_random_removals_run_is_the_mean_over_every_removal(granularity):
    """mean_run against every removal of the space enumerated: whole blocks skip their removed ones,
    a zeroed branch's block still runs."""
    n, k = 6, 2
    space = Space(n, k, granularity)
    runs = []
    for removal in space.every():
        blocks = [int(u) if granularity == "layer" else int(u[1:]) for u in removal]
        runs.append(n - min(blocks) - (k if granularity == "layer" else 0))
    assert mean_run(n, k, granularity) == pytest.approx(sum(runs) / len(runs), rel=1e-12)


@pytest.mark.statistics
def test_each_search_expects_its_own_passes():
    space = Space(30, 4)
    built = build_searches(("exact", "greedy", "one-shot", "random", "evo", "last", "angular"),
                           {"random.sets": "50", "evo.generations": "10", "evo.offspring": "8"})
    assert built["exact"].passes(space, 1024) == (169_884.0, 27_405.0)
    assert built["one-shot"].passes(space, 1024) == (sum(29 - j for j in range(30)), 30.0)
    assert built["greedy"].passes(space, 1024)[1] == 30 + 29 + 28 + 27
    assert built["random"].passes(space, 1024) == pytest.approx((50 * mean_run(30, 4), 50.0))
    # evo on 1,024 tokens: every stage scaled by 1/32 (64, 64, 1,024 tokens); 64 first, then 10 x (8 at 64 + (2 + 1) at 1,024)
    heads = 64 * 64 / 1024 + 10 * (8 * 64 / 1024 + 3 * 1024 / 1024)
    assert built["evo"].passes(space, 1024) == pytest.approx((heads * mean_run(30, 4), heads))
    assert built["last"].passes(space, 1024) == (0.0, 0.0) and built["angular"].passes(space, 1024) == (30.0, 0.0)


def test_the_pass_timing_is_the_median_block_and_the_summed_heads_after_a_warm_up(six, tiny_tokenizer, text):
    """Under a clock the test controls: each reading 1 s later than the one before, except one slow
    block, so that a block reads 1 s and a head 1 s (the median ignores the slow one)."""
    ticks = iter(range(10_000))
    readings = []

    def clock():
        readings.append(next(ticks) * 1.0 + (50.0 if len(readings) == 3 else 0.0))
        return readings[-1]

    windows = _windows(tiny_tokenizer, text, windows=4)
    timing = pass_timing(six.model, windows, 2, clock=clock)
    # 2 batches x (6 blocks + 1 head), a start and an end reading each: 28 readings
    assert len(readings) == 28
    assert timing == PassTiming(block=2.0, head=2.0)  # each block summed over the 2 batches, 1 s each; the 2 heads summed
    assert PassTiming(0.5, 2.0).seconds(10, 3) == 11.0


# --------------------------------------------------------------------------- stability
@pytest.mark.statistics
def test_the_stability_summary_and_verdict_by_hand():
    """Full pick {1, 2}; reruns {1, 2}, {1, 3}, {2, 3}, {1, 2}: 1 and 2 in 3 of 4, 3 in 2 of 4; the
    whole pick twice (Wilson 2 of 4: 15.0%-85.0%); Jaccard 1, 1/3, 1/3, 1: mean 2/3."""
    s = summary((2, 1), [(1, 2), (1, 3), (3, 2), (1, 2)], "layer")
    assert s["frequency"] == {"1": 0.75, "2": 0.75, "3": 0.5} and s["same"] == 2 and s["mean_jaccard"] == pytest.approx(2 / 3)
    assert s["same_interval"] == pytest.approx([0.15003898915214947, 0.8499610108478506])
    assert verdict("wiki/greedy/kl", s) == ("wiki/greedy/kl: the pick 1,2: 1, 2 in 3 of 4; also 3 (2 of 4); the whole pick in 2 of 4 "
                                            "(15%-85%, Wilson 95%), mean Jaccard 0.67")
    every = summary((4, 5), [(4, 5)] * 3, "layer")
    assert verdict("x", every).startswith("x: the pick 4,5: 4, 5 in every rerun; the whole pick in 3 of 3 (44%-100%")


@pytest.mark.statistics
def test_resample_draws_are_seeded_with_replacement_and_do_not_depend_on_how_many():
    a, b = draws(8, 3, seed=5), draws(8, 5, seed=5)
    assert a == b[:3] and a != draws(8, 3, seed=6)
    assert all(len(d) == 8 and d == sorted(d) and 0 <= min(d) and max(d) < 8 for d in b)
    assert any(len(set(d)) < 8 for d in b)  # with replacement


def _greedy_by_hand(model, windows, k, objective):
    """Greedy on these windows, every removal scored by a scorer of its own (no reuse)."""
    scorer = CalibrationScorer(model, windows, 2, {}, lambda: None)
    removed = []
    for _ in range(k):
        candidates = [u for u in range(6) if u not in removed]
        scores = [scorer(tuple(sorted(removed + [u])))[objective] for u in candidates]
        removed.append(min(zip(scores, candidates))[1])
    return tuple(sorted(removed))


def test_resampled_picks_are_the_search_run_on_the_drawn_windows_by_hand(six_dir, tiny_tokenizer, text, tmp_path):
    from depthcurse.select import run_select
    from depthcurse.select.windows import text_windows

    loaded = load_model(str(six_dir))
    cfg = SelectConfig(k=2, calibration=(text,), objectives=("kl",), searches=("greedy",), calib_windows=5, eval_windows=2, seq_len=16,
                       batch_size=2, resamples=4, seed=11)
    record = run_select(loaded, cfg, tmp_path / "run")
    windows = text_windows(loaded.tokenizer, text, cfg).calibration
    picks = record["stability"][f"text/greedy/kl"]
    assert [p["windows"] for p in picks] == draws(5, 4, 11)
    by_hand = [_greedy_by_hand(loaded.model, windows[torch.tensor(d)], 2, "kl") for d in draws(5, 4, 11)]
    assert [tuple(p["layers"]) for p in picks] == by_hand
    full = tuple(record["cells"]["text/greedy/kl"]["layers"])
    assert full == _greedy_by_hand(loaded.model, windows, 2, "kl")
    units = set(full).union(*map(set, by_hand))
    assert record["stability_summary"]["text/greedy/kl"]["frequency"] == {str(u): sum(u in p for p in by_hand) / 4 for u in units}
    # a rerun with more resamples keeps the four and adds the fifth; the run is the same run
    more = run_select(loaded, replace(cfg, resamples=5), tmp_path / "run")
    assert more["stability"]["text/greedy/kl"][:4] == picks and len(more["stability"]["text/greedy/kl"]) == 5


def test_a_seeded_search_reruns_under_each_seed_as_that_seed_alone_chooses(six_dir, text, tmp_path):
    from depthcurse.select import run_select

    loaded = load_model(str(six_dir))
    base = dict(k=2, calibration=(text,), objectives=("kl",), calib_windows=4, eval_windows=2, seq_len=16, batch_size=2)
    record = run_select(loaded, SelectConfig(**base, searches=("random", "greedy"), search_args={"random.sets": "3"}, seeds=(7, 8)), tmp_path / "a")
    alone = run_select(loaded, SelectConfig(**base, searches=("random",), search_args={"random.sets": "3", "random.seed": "8"}), tmp_path / "b")
    seeded = record["stability"]["text/random/kl"]
    assert [p["seed"] for p in seeded] == [7, 8] and seeded[1]["layers"] == alone["cells"]["text/random/kl"]["layers"]
    assert "text/greedy/kl" not in record["stability"] or not record["stability"]["text/greedy/kl"]  # greedy has no seed to vary


# --------------------------------------------------------------------------- the recipe
@pytest.mark.statistics
def test_the_recipe_runs_exact_where_it_fits_the_budget_and_evo_where_not():
    space = Space(30, 3, timing=PassTiming(0.01, 0.1))  # 31,437 block and 4,060 head passes: 720 s
    assert recipe(space, 1024, 30.0).searches == ("greedy", "exact")
    slow = recipe(space, 1024, 10.0)
    assert slow.searches == ("greedy", "evo") and "about 12 minutes here, over --budget 10 minutes" in slow.why
    capped = recipe(space, 1024, 30.0, {"exact.max_sets": "4000"})
    assert capped.searches == ("greedy", "evo") and "more than exact.max_sets=4,000" in capped.why
    assert recipe(Space(30, 3), 1024, 30.0).searches == ("greedy", "evo")  # not timed: no estimate fits


def test_select_with_k_alone_prints_the_answer_first_then_the_next_commands(run_cli, six_dir, text, tmp_path):
    code, out, err = run_cli("select", six_dir, "--k", "2", "--calibration", text, "--calib-windows", "3", "--eval-windows", "3", "--seq-len", "16",
                             "--out", tmp_path / "r")
    assert code == 0, err
    first = out.index("answer (")
    answer = out[first:].splitlines()[0]
    assert "┏" not in out[:first] and out[:first].count("(LlamaForCausalLM, 6 layers") == 1  # the header alone before the answer
    assert answer.startswith("answer (text kl): remove layers ") and "(the exact optimum of 15 removals; found by exact" in answer
    assert "how sure: in 8 reruns on resampled windows" in answer
    said = " ".join(err.split())
    assert "the recipe: by kl, greedy and exact (exact fits: 15 removals" in said
    assert "text/exact/kl: expect 30 block passes and 15 head passes" in said
    record = json.loads((tmp_path / "r" / "select.json").read_text())
    layers = record["cells"]["text/exact/kl"]["layers"]
    assert f"next: depthcurse drop {six_dir} --layers {key(layers)} --out pruned/{six_dir.name}-without-{key(layers).replace(',', '-')} " in said
    assert f"next: depthcurse speculate {six_dir} --skip-from" in said and "pruned//" not in said  # the path's name under pruned/, not the path (issue 81)
    assert record["cells"]["text/exact/kl"]["estimate"]["block_passes"] == 30 and (tmp_path / "r" / "stability.png").exists()
    assert record["run"]["searches"] is None and record["recipe"]["objectives"] == ["kl"]


def test_the_new_settings_bad_input_is_one_line(run_cli, six_dir, text):
    base = ["select", six_dir, "--calibration", text, "--calib-windows", "3", "--eval-windows", "3", "--seq-len", "16"]
    for args, said in (
        (["--k", "1", "--resamples", "1"], "--resamples 1: one resample says nothing"),
        (["--k", "1", "--resamples", "-2"], "--resamples must be 0 or more, got -2"),
        (["--k", "1", "--search", "greedy", "--resamples", "100000", "--budget", "0.001"], "--resamples 100,000: the reruns of greedy may take up to "),
        (["--k", "1", "--seeds", "1,x"], "--seeds 1,x: give whole numbers"),
        (["--k", "1", "--seeds", "1234"], "--seeds 1234: each must be given once, and differ from --seed 1234"),
        (["--k", "1", "--budget", "0"], "--budget must be more than 0 minutes"),
        (["--k", "1", "--granularity", "sub-block"], "--granularity sub-block needs --search"),
    ):
        assert_one_line_error(*run_cli(*base, *args), said)


# --------------------------------------------------------------------------- what a new user met (issue 71, item 8)
OUTSIDE = '''
import sys

import numpy as np

from depthcurse.select import Search


class WrongSize(Search):
    name = "wrong-size"

    def run(self, ctx):
        ctx.score((0, 1, 2))
        return (0, 1)


class Exits(Search):
    name = "exits"

    def run(self, ctx):
        sys.exit(3)


class NoRun(Search):
    name = "no-run"


class Illegal(Search):
    name = "illegal"

    def run(self, ctx):
        ctx.score((0, 99))
        return (0, 1)


class NumpyPick(Search):
    name = "numpy-pick"

    def run(self, ctx):
        ctx.score(tuple(np.array([0, 2])))
        return tuple(np.array([0, 2]))
'''


def test_what_a_new_user_met_is_one_line_and_writes_nothing(run_cli, six_dir, text, tmp_path):
    plugin = tmp_path / "outside.py"
    plugin.write_text(OUTSIDE)
    base = ["select", six_dir, "--k", "2", "--calibration", text, "--calib-windows", "3", "--eval-windows", "3", "--seq-len", "16"]
    def one_line(code, out, err, said):  # a search's own fault shows once it runs: after the model's header line, nothing else
        assert code == 1 and "Traceback" not in out + err and "━" not in out + err and "┏" not in out
        assert err.count("\n") == 1 and said in " ".join(err.split()), err

    for i, (args, said) in enumerate((
        (["--search", f"{plugin}:WrongSize"], "--search wrong-size asked the scorer for 0,1,2, which is no removal of this grid: it removes 3 units, more than k = 2"),
        (["--search", f"{plugin}:Exits"], "--search exits: its run() called sys.exit(3): a search returns its removal"),
        (["--search", f"{plugin}:NoRun"], f"--search {plugin}:NoRun: NoRun has no run(ctx)"),
        (["--search", f"{plugin}:Illegal"], "--search illegal asked the scorer for 0,99, which is no removal of this grid: 99 is not a block index 0-5"),
        (["--search", "greedy", "--calibration", f"{text},auto,wiki"], "--calibration names wiki more than once"),
        (["--search", "exact", "--search-args", "max_sets=5,max_sets=6"], "--search-args 'max_sets=5,max_sets=6': max_sets is given twice (5 and 6): give it once"),
    )):
        out = tmp_path / f"out{i}"
        one_line(*run_cli(*base, *args, "--out", out), said)
        assert not out.exists() or not any(out.iterdir()), said  # nothing written
    # numpy integers are blocks: the search runs and its pick is kept as plain ints
    code, _, err = run_cli(*base, "--search", f"{plugin}:NumpyPick", "--out", tmp_path / "np")
    assert code == 0, err
    assert json.loads((tmp_path / "np" / "select.json").read_text())["cells"]["text/numpy-pick/ppl"]["layers"] == [0, 2]


def test_a_method_setting_given_twice_is_one_line_before_any_work(run_cli, six_dir, tmp_path):
    out = tmp_path / "healed"
    assert_one_line_error(*run_cli("heal", six_dir, "--layers", "2", "--methods", "laco", "--method-args", "as=code,as=paper", "--out", out),
                          "--method-args 'as=code,as=paper': as is given twice (code and paper): give it once")
    assert not out.exists()


def test_calibration_auto_is_said_and_recorded_as_the_text_it_is(run_cli, six_dir, tmp_path, monkeypatch):
    from depthcurse import assets

    monkeypatch.setattr(assets, "hub_reachable", lambda: False)
    code, _, err = run_cli("select", six_dir, "--k", "1", "--calibration", "auto", "--search", "last", "--calib-windows", "2", "--eval-windows", "2",
                           "--seq-len", "16", "--out", tmp_path / "auto")
    assert code == 0, err
    assert "--calibration auto is wiki here" in " ".join(err.split())
    assert json.loads((tmp_path / "auto" / "select.json").read_text())["run"]["calibration"] == ["wiki"]


def test_an_interrupt_before_anything_finished_says_nothing_was_written(run_cli, six_dir, text, tmp_path, monkeypatch):
    import depthcurse.select as select_package

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(select_package, "run_select", stopped)
    code, _, err = run_cli("select", six_dir, "--k", "1", "--calibration", text, "--search", "last", "--calib-windows", "2", "--eval-windows", "2",
                           "--seq-len", "16", "--out", tmp_path / "cut")
    said = " ".join(err.split())
    assert code == 130 and "nothing had finished, so nothing was written" in said and "every finished piece" not in said


def test_the_settings_listing_shows_every_registry_and_an_outside_search(run_cli, tmp_path):
    plugin = tmp_path / "mine.py"
    plugin.write_text('''
from dataclasses import dataclass

from depthcurse.select import Search


@dataclass
class MineSettings:
    depth: int = 3  # how deep it looks (its paper's default)


class Mine(Search):
    name = "mine"
    source = "my paper"
    Settings = MineSettings

    def run(self, ctx):
        return tuple(range(ctx.space.k))
''')
    code, out, err = run_cli("settings", "evo", "lora", f"{plugin}:Mine")
    assert code == 0, err
    said = " ".join(out.split())
    for piece in ("search evo", "evo.seed", "int | None", "method lora", "search mine", "my paper", "mine.depth", "how deep it looks (its paper's default)"):
        assert piece in said, piece
    code, out, _ = run_cli("settings")
    said = " ".join(out.split())
    assert all(f"search {n}" in said for n in ("exact", "greedy", "swift", "draft-verify")) and all(f"method {n}" in said for n in ("linear", "laco", "swm"))
    assert_one_line_error(*run_cli("settings", "nosuch"), "settings nosuch: no search or method of that name")


@pytest.mark.statistics
def test_each_pick_against_the_best_is_holm_adjusted_over_the_distinct_picks():
    """Three picks of one text and objective (the best, and two others, one of them chosen twice):
    the family is the two distinct others; the one with the smaller p-value is tested at 1 - 0.05 / 2,
    the other at 95%, each a t interval of its paired held-out difference from the best's."""
    from scipy import stats as sps

    from depthcurse.select.statistics import distances

    best, a, b = [3.0, 3.1, 2.9, 3.2, 3.0], [3.5, 3.3, 3.4, 3.6, 3.2], [3.1, 3.3, 2.9, 3.5, 3.0]
    record = {"run": {"k": 1, "n_layers": 4, "objectives": ["kl"], "calibration": ["t"]}, "labels": {"t": "t"},
              "cells": {"t/exact/kl": {"calibration": "t", "search": "exact", "objective": "kl", "layers": [1]},
                        "t/greedy/kl": {"calibration": "t", "search": "greedy", "objective": "kl", "layers": [2]},
                        "t/evo/kl": {"calibration": "t", "search": "evo", "objective": "kl", "layers": [2]},
                        "t/last/-": {"calibration": "t", "search": "last", "objective": "-", "layers": [3]}},
              "calibration_scores": {"t": {"1": [0, 0.1, 0, None], "2": [0, 0.2, 0, None], "3": [0, 0.3, 0, None], "0": [0, 0.4, 0, None]}},
              "held_out": {"t": {"": {"loss": [2.0] * 5}, "1": {"loss": best}, "2": {"loss": a}, "3": {"loss": b}}}}
    picks = distances(record)["t kl"]["picks"]
    diffs = {name: np.subtract(x, best) for name, x in (("a", a), ("b", b))}
    p = {name: 2 * sps.t.sf(abs(d.mean()) / (d.std(ddof=1) / np.sqrt(5)), 4) for name, d in diffs.items()}
    assert p["a"] < p["b"]
    for name, cell, level in (("a", "t/greedy/kl", 1 - 0.05 / 2), ("b", "t/last/-", 0.95)):
        d = diffs[name]
        half = sps.t.ppf(1 - (1 - level) / 2, 4) * d.std(ddof=1) / np.sqrt(5)
        assert picks[cell]["held_out_holm"]["t held-out loss"] == pytest.approx([d.mean() - half, d.mean() + half])
    assert picks["t/evo/kl"]["held_out_holm"] == picks["t/greedy/kl"]["held_out_holm"] and "held_out_holm" not in picks["t/exact/kl"]


@pytest.mark.statistics
def test_a_suites_interval_weighs_each_task_as_its_headline_does():
    """Three tasks of 4, 6 and 3 questions: the headline is the mean of the task means, and the
    interval of the difference from the unpruned model is that mean's, each task's variance over its
    own questions (Welch-Satterthwaite's df); pooling the 13 questions gives another interval."""
    from scipy import stats as sps

    from depthcurse.select.report import cell_scores

    mine = [[1, 1, 0, 1], [0, 1, 0, 0, 1, 1], [1, 0, 1]]
    base = [[1, 1, 1, 1], [1, 1, 0, 1, 1, 1], [1, 1, 1]]
    headline = lambda groups: float(np.mean([np.mean(g) for g in groups]))  # noqa: E731
    record = {"run": {"k": 1, "calibration": [], "task": "suite"}, "held_out": {}, "cells": {"t/greedy/kl": {"layers": [2]}},
              "task": {"": {"metric": "acc", "value": headline(base), "items": sum(base, []), "groups": base},
                       "2": {"metric": "acc", "value": headline(mine), "items": sum(mine, []), "groups": mine}}}
    value, low_high = cell_scores(record, "t/greedy/kl")["suite acc"]
    d = [np.subtract(m, b) for m, b in zip(mine, base)]
    parts = [g.var(ddof=1) / len(g) / 9 for g in d]
    df = sum(parts) ** 2 / sum(p ** 2 / (len(g) - 1) for p, g in zip(parts, d))
    half = sps.t.ppf(0.975, df) * np.sqrt(sum(parts))
    assert value == pytest.approx(headline(mine))
    assert low_high == pytest.approx([headline(mine) - half, headline(mine) + half])
    pooled = np.concatenate(d)
    assert half != pytest.approx(sps.t.ppf(0.975, 12) * pooled.std(ddof=1) / np.sqrt(13), rel=1e-3)


def test_held_out_documents_share_no_document_with_the_calibration(six_dir, tmp_path, tiny_tokenizer):
    """Forty documents, each a line naming itself: with --held-out documents no calibration window
    holds a word of a held-out window's documents (with windows, they share documents), and the
    record says which was used."""
    from depthcurse.select import run_select
    from depthcurse.select.windows import text_windows

    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"text": " ".join([f"doc{i:02d}"] * 12)}) for i in range(40)))
    cfg = SelectConfig(k=1, calibration=(str(path),), searches=("last",), calib_windows=3, eval_windows=3, seq_len=16, held_out="documents", seed=3)
    texts = text_windows(tiny_tokenizer, str(path), cfg)
    words = lambda w: set(tiny_tokenizer.decode(w.flatten()).split())  # noqa: E731
    calibration, held = words(texts.calibration), words(texts.held_out)
    assert {w for w in calibration if w.startswith("doc")} and not ({w for w in calibration if w.startswith("doc")} & held)
    mixed = text_windows(tiny_tokenizer, str(path), replace(cfg, held_out="windows"))
    assert {w for w in words(mixed.calibration) if w.startswith("doc")} & words(mixed.held_out)
    record = run_select(load_model(str(six_dir)), cfg, tmp_path / "run")
    assert record["held_out_from"].startswith("windows of other documents") and record["run"]["held_out"] == "documents"
    with pytest.raises(Exception, match="--held-out documents: .* is one document"):
        one = tmp_path / "one.txt"
        one.write_text("a single document " * 200)
        text_windows(tiny_tokenizer, str(one), replace(cfg, calibration=(str(one),)))


@pytest.mark.statistics
def test_the_verdicts_other_branches_and_the_draws_pinned():
    """A pick that never comes back, others in the units' order, more than four others cut; the draws
    of seed 3 pinned by value."""
    assert verdict("x", summary((1, 2), [(3, 4), (3, 4)], "layer")) == (
        "x: the pick 1,2: 1, 2 in no rerun; also 3 (2 of 2), 4 (2 of 2); the whole pick in 0 of 2 (0%-66%, Wilson 95%), mean Jaccard 0.00")
    many = verdict("x", summary((1, 2), [(3, 4), (5, 6), (7, 8), (1, 9)], "layer"))
    assert "1 in 1 of 4; 2 in no rerun; also 3 (1 of 4), 4 (1 of 4), 5 (1 of 4), 6 (1 of 4) ...;" in many and "mean Jaccard 0.08" in many
    assert draws(4, 2, seed=3) == [[0, 0, 1, 2], [1, 2, 3, 3]]
    s = summary(("m3", "a1"), [("a1", "m3"), ("a2", "m3")], "sub-block")
    assert s["full"] == "a1,m3" and s["frequency"] == {"a1": 0.5, "a2": 0.5, "m3": 1.0} and s["same"] == 1


@pytest.mark.statistics
def test_a_resample_reweighs_each_windows_scores_by_how_often_it_was_drawn():
    """Windows drawn 0, 0, 2 of three: a removal's loss is (l0 + l0 + l2) / 3; its stage minibatch
    (EvoPress) maps the resample's windows to the ones they are."""
    from depthcurse.select.stability import Resampled

    class Scorer:
        asked = []

        def per_window(self, removals):
            return [([1.0, 2.0, 4.0], [0.1, 0.2, 0.4], [1.0, 0.5, 0.0]) for _ in removals]

        def _scores(self, removal, loss, kl, agreement):
            return [loss, kl, 1.0 - agreement, None]

        def score_on_many(self, removals, windows, last, objective):
            self.asked.append((windows, last, objective))
            return [0.0] * len(removals)

    view = Resampled(Scorer(), [0, 0, 2])
    assert view.score_many([(3,)], "ppl") == [pytest.approx(6.0 / 3)]
    assert view.score_many([(3,), (4,)], "kl") == [pytest.approx(0.6 / 3)] * 2
    assert view.score_many([(3,)], "acceptance") == [pytest.approx(1 - 2.0 / 3)]
    view.score_on_many([(3,)], [2, 0], 5, "kl")
    assert Scorer.asked == [([2, 0], 5, "kl")]


@pytest.mark.searching
def test_the_recipe_and_the_estimates_edges_by_hand():
    """exact runs at its estimate exactly on the budget and at exactly exact.max_sets, not a second
    or a removal past either (and says which it was over); the estimate's rounding; the durations at
    each unit's edge; the prefix walk's count with the empty removal at the root (6 block passes on 4
    blocks: 4, then 2 after removing block 1)."""
    from depthcurse.forecast import duration
    from depthcurse.select.estimate import PassTiming, trie_passes
    from depthcurse.select.searches.exact import walk_passes

    blocks, _ = walk_passes(6, 2)
    on_budget = Space(6, 2, timing=PassTiming(block=1.0, head=0.0))
    fits = recipe(on_budget, 64, blocks / 60)
    assert fits.searches == ("greedy", "exact") and fits.summary() == {"searches": ["greedy", "exact"], "why": fits.why}
    assert fits.why == f"exact fits: 15 removals, about {duration(blocks)} here (--budget {blocks / 60:g} minutes)"
    over = recipe(Space(6, 2, timing=PassTiming(block=1.0 + 1e-9, head=0.0)), 64, blocks / 60)
    assert over.searches == ("greedy", "evo") and over.why == (f"exact does not fit (15 removals, about {duration(blocks)} here, over --budget "
                                                               f"{blocks / 60:g} minutes): evo instead")
    assert recipe(on_budget, 64, 60.0, {"exact.max_sets": "15"}).searches == ("greedy", "exact")
    assert recipe(on_budget, 64, 60.0, {"exact.max_sets": "14"}).why == "exact does not fit (15 removals, more than exact.max_sets=14): evo instead"
    assert PassTiming(block=0.5, head=2.0).estimate(3.26, 1.04) == {"block_passes": 3.3, "head_passes": 1.0, "seconds": 3.7}
    assert [duration(s) for s in (89, 90, 5399, 5400, 7200)] == ["89 seconds", "2 minutes", "90 minutes", "1.5 hours", "2.0 hours"]
    assert trie_passes([(), (1,)], 4) == 6.0 and trie_passes([(1,), (1, 3)], 4) == (4 - 2) + (3 - 2) + (4 - 4)
