"""depth-use and the depth map over training seeds (issue 73, item 3): each run's figures worked by
hand on a made-up record (five layers, so that a split at n // 2 = 2 and one at 3 give other numbers),
runs grouped by architecture and text (a model measured twice counts once), the means' t intervals
and Welch's differences against the first architecture by hand, and `report` end to end on tiny
models of two seeds and two depths. The tests on made-up records are marked `statistics`: `make mutate`
runs them against every mutant of `depth/over_seeds.py`."""

from __future__ import annotations

import json
import math

import pytest

from helpers import tiny_llama

from depthcurse.depth.over_seeds import (architecture, differences_table, map_figures, map_over_seeds, repeated, seeds_table, seeds_verdicts,
                                         use_figures, use_over_seeds)
from depthcurse.stats import mean_interval, welch_interval

nan = float("nan")


def _record(norm="pre", source="a", shift=0.0, phase=3, tuned=True, data="wiki", layers=5):
    """A depth-use record of five layers: attention norms 0.1..0.5 (+ shift), MLP norms 1..5, the
    influence rows' means 0.9, 0.8, 0.3, 0.2 (the last row none), output KLs 4, 3, 2, 1, 0.5."""
    rows = [{"layer": i, "attn_norm": 0.1 * (i + 1) + shift, "mlp_norm": float(i + 1), "lens_kl": 10.0 - i, "tuned_kl": 5.0 - i} for i in range(layers)]
    if not tuned:
        for r in rows:
            del r["tuned_kl"]
    row_means, more = [0.9, 0.8, 0.3, 0.2] + [0.1] * (layers - 5), [0] * (layers - 5)  # a deeper model: its extra layers add little
    influence = [[None] * (i + 1) + [row_means[i] + shift] * (layers - 1 - i) for i in range(layers - 1)] + [[None] * layers]
    use = {"n_layers": layers, "windows": 2, "settled": [1, 1, 3, 4, 1] + more, "tuned_settled": [4, 1, 1, 1, 3] + more if tuned else None,
           "influence": influence, "output_change": [4.0, 3.0, 2.0, 1.0, 0.5] + [0.5] * len(more)}
    record = {"run": {"model": source, "source": source, "architecture": {"norm": norm, "num_hidden_layers": layers, "hidden_size": 8},
                      "data": data, "windows": 2, "seq_len": 16},
              "use": use, "layers": rows, "phase_transition": phase}
    if tuned:
        record["tuned_lens"] = {"settings": {"steps": 20}}
    return record


@pytest.mark.statistics
def test_one_runs_figures_by_hand():
    """Halves at 5 // 2 = 2: attention (0.1 + 0.2) / 2 and (0.3 + 0.4 + 0.5) / 3; influence rows 0.9, 0.8
    | 0.3, 0.2 (row 4 has no later layer); settled 1, 1, 3, 4, 1 of 10 reach half at layer 2, the
    tuned 4, 1, 1, 1, 3 at layer 1; the lenses at layer n/2 - 1 = 1."""
    figures = use_figures(_record())
    assert figures == pytest.approx({"phase": 3, "half_settled": 2, "tuned_half_settled": 1, "attn_first": 0.15, "attn_second": 0.4,
                                     "mlp_first": 1.5, "mlp_second": 4.0, "influence_first": 0.85, "influence_second": 0.25,
                                     "skip_kl_first": 3.5, "skip_kl_second": 3.5 / 3, "lens_kl_middle": 9.0, "tuned_kl_middle": 4.0})
    plain = use_figures(_record(tuned=False, phase=None))
    assert plain["tuned_half_settled"] is None and plain["tuned_kl_middle"] is None and plain["phase"] is None
    bare = _record()
    bare["use"]["influence"] = bare["use"]["output_change"] = None
    assert use_figures(bare)["influence_first"] is None and use_figures(bare)["skip_kl_second"] is None
    nans = _record()  # an influence row in memory holds NaN where a JSON one holds null
    nans["use"]["influence"] = [[nan if v is None else v for v in row] for row in nans["use"]["influence"]]
    assert use_figures(nans)["influence_second"] == pytest.approx(0.25)


@pytest.mark.statistics
def test_a_maps_figures_by_hand_on_a_three_by_four_grid():
    """Shallow layer 2's row peaks at deep layer 2 (relative depth 3/4, R^2 0.8); the deep last layer's
    column peaks at 0.6 (shallow layer 1)."""
    r2 = [[0.9, 0.2, 0.1, 0.0], [0.3, 0.7, 0.5, 0.6], [0.1, 0.4, 0.8, 0.5]]
    record = {"r2": r2, "deep_layers": 4, "relative_depth": {"mean_abs_difference": 0.12, "spearman": 1.0}}
    assert map_figures(record) == pytest.approx({"depth_gap": 0.12, "order": 1.0, "last_reach": 0.75, "last_r2": 0.8, "deep_last_r2": 0.6})


@pytest.mark.statistics
def test_runs_group_by_architecture_and_text_and_a_model_measured_twice_counts_once():
    records = [_record("pre", "p1"), _record("lns", "l1", shift=0.2, phase=2), _record("pre", "p2", shift=0.03, phase=4),
               _record("lns", "l2", shift=0.21, phase=2), _record("pre", "p1"), _record("lns", "l3", shift=0.22, phase=1),
               _record("pre", "p3", data="code"), _record("pre", "p4", layers=6)]
    names = [f"run{i}" for i in range(len(records))]
    summary = use_over_seeds(records, names)
    groups = summary["groups"]
    assert [g["label"] for g in groups] == ["pre, 5 layers", "lns, 5 layers", "pre, 5 layers #2", "pre, 6 layers"]
    assert [g["runs"] for g in groups] == [["run0", "run2"], ["run1", "run3", "run5"], ["run6"], ["run7"]]  # run4 is run0's model again
    phase = groups[1]["summary"]["phase"]
    assert phase["values"] == [2, 2, 1] and phase["mean"] == pytest.approx(5 / 3) and phase["interval"] == pytest.approx(mean_interval([2, 2, 1]))
    assert groups[2]["summary"]["phase"]["interval"] is None  # one run: no interval
    attn = groups[1]["summary"]["attn_first"]
    assert attn["mean"] == pytest.approx(0.15 + 0.21)  # shifts 0.2, 0.21, 0.22
    told = {(d["group"], d["figure"]): d for d in summary["differences"]}
    d = told[("lns, 5 layers", "phase")]
    assert d["against"] == "pre, 5 layers" and d["difference"] == pytest.approx(5 / 3 - 3.5)
    assert d["interval"] == pytest.approx(welch_interval([2, 2, 1], [3, 4])) and d["apart"] is False and d["verdict"] == "cannot tell"
    assert told[("pre, 5 layers #2", "phase")]["interval"] is None  # one run against two: Welch needs two a side
    assert told[("lns, 5 layers", "attn_first")]["apart"] is True  # 0.2-0.22 shifts against 0 and 0.03
    assert told[("lns, 5 layers", "attn_first")]["verdict"] == "more"  # above 0: the word the interval gives
    assert repeated(summary) and not repeated(use_over_seeds(records[:2], names[:2]))


@pytest.mark.statistics
def test_a_record_from_before_architectures_were_kept_stands_alone():
    old, new = _record(source="x"), _record(source="y")
    del old["run"]["architecture"]
    groups = use_over_seeds([old, new, _record(source="z")], ["o", "n", "z"])["groups"]
    assert [g["runs"] for g in groups] == [["o"], ["n", "z"]] and groups[0]["label"] == "x"


@pytest.mark.statistics
def test_the_tables_and_verdicts_say_what_they_measured():
    records = [_record("pre", "p1"), _record("pre", "p2", shift=0.03, phase=4), _record("lns", "l1", shift=0.2, phase=2),
               _record("lns", "l2", shift=0.21, phase=2)]
    summary = use_over_seeds(records, ["p1", "p2", "l1", "l2"])
    from depthcurse.report import markdown_table

    seeds = markdown_table(seeds_table(summary, "depth-use"))
    assert "pre, 5 layers (2 runs)" in seeds and "lns, 5 layers (2 runs)" in seeds and "Student's t at runs - 1 df" in seeds
    assert "| phase transition (layer) | 3.5 [-2.9, 9.9] | 2.0 (every run) |" in seeds  # 3.5 -+ 12.706 * 0.5; 2, 2: no spread
    differences = markdown_table(differences_table(summary))
    assert "lns, 5 layers - pre, 5 layers" in differences and "Welch's 95% interval" in differences
    iv = welch_interval([0.35, 0.36], [0.15, 0.18])
    assert f"| attention \\|\\|a\\|\\|/\\|\\|h\\|\\|, first half | {0.355 - 0.165:+.3f} [{iv[0]:+.3f}, {iv[1]:+.3f}] more |" in differences
    phase = welch_interval([2, 2], [3, 4])
    assert f"| phase transition (layer) | -1.5 [{phase[0]:+.1f}, {phase[1]:+.1f}] cannot tell |" in differences
    assert "| MLP \\|\\|m\\|\\|/\\|\\|h\\|\\|, first half | +0.000 (every run) |" in differences
    (line,) = seeds_verdicts(summary)
    assert line.startswith(f"lns, 5 layers against pre, 5 layers: attention ||a||/||h||, first half more +0.19 [{iv[0]:+.3g}, {iv[1]:+.3g}]; ")
    assert line.count("; ") == 3  # the attention's and the influence's halves, all shifted alike
    assert "; the same in every run of each, and different" not in line and "constant" not in line  # the phase's 2, 2 against 3, 4: an interval, and 0 in it
    assert line.endswith("(1 of 13 cannot tell at these seeds, 8 equal in every run)")  # the phase cannot tell; the rest tie


@pytest.mark.statistics
def test_depth_map_runs_group_by_both_architectures():
    def record(source, gap):
        arch = lambda n: {"norm": "pre", "num_hidden_layers": n}  # noqa: E731
        return {"run": {"shallow": {"source": source, "architecture": arch(3)}, "deep": {"source": source + "d", "architecture": arch(4)},
                        "data": "wiki", "seq_len": 16},
                "fit_windows": 4, "held_out_windows": 2, "deep_layers": 4, "r2": [[0.9, 0.2, 0.1, 0.0], [0.3, 0.7, 0.5, 0.6], [0.1, 0.4, 0.8, 0.5]],
                "relative_depth": {"mean_abs_difference": gap, "spearman": 1.0}}

    summary = map_over_seeds([record("a", 0.1), record("b", 0.2), record("a", 0.1), record("c", 0.3)], ["a", "b", "a again", "c"])
    (group,) = summary["groups"]
    assert group["label"] == "pre, 3 layers -> pre, 4 layers" and group["runs"] == ["a", "b", "c"]
    assert group["summary"]["depth_gap"]["mean"] == pytest.approx(0.2) and group["summary"]["depth_gap"]["interval"] == pytest.approx(mean_interval([0.1, 0.2, 0.3]))
    assert summary["differences"] == []


@pytest.mark.statistics
def test_architecture_drops_names_and_dtypes_and_two_seeds_share_it():
    a, b = tiny_llama(300, layers=3, seed=1), tiny_llama(300, layers=3, seed=2)
    assert architecture(a) == architecture(b) and architecture(a)["num_hidden_layers"] == 3
    assert not any(k.startswith("_") or k in ("transformers_version", "torch_dtype", "dtype") for k in architecture(a))
    assert architecture(tiny_llama(300, layers=4, seed=1)) != architecture(a) and architecture(object()) == {}


def test_report_puts_seeds_of_one_architecture_side_by_side(run_cli, tmp_path, tiny_tokenizer, text_file):
    """Two seeds of a 3-layer tiny Llama and one of 4 layers through depth-use, and a depth map of each
    3-layer seed onto the 4-layer model: the page holds the means over seeds and the differences."""
    dirs = {}
    for name, layers, seed in (("a1", 3, 1), ("a2", 3, 2), ("b1", 4, 1)):
        dirs[name] = tmp_path / name
        tiny_llama(len(tiny_tokenizer), layers=layers, seed=seed).save_pretrained(dirs[name])
        tiny_tokenizer.save_pretrained(dirs[name])
    for name in dirs:
        code, _, err = run_cli("depth-use", dirs[name], "--data", text_file, "--windows", "2", "--seq-len", "16", "--out", tmp_path / f"du-{name}")
        assert code == 0, err
    for name in ("a1", "a2"):
        code, _, err = run_cli("depth-map", dirs[name], dirs["b1"], "--data", text_file, "--calib-windows", "3", "--eval-windows", "2", "--seq-len", "16",
                               "--out", tmp_path / f"map-{name}")
        assert code == 0, err
    record = json.loads((tmp_path / "du-a1" / "depth_use.json").read_text())
    assert record["run"]["architecture"]["num_hidden_layers"] == 3
    page = tmp_path / "page.md"
    code, _, err = run_cli("report", *(tmp_path / f"du-{n}" for n in dirs), tmp_path / "map-a1", tmp_path / "map-a2", "--out", page)
    assert code == 0, err
    text = page.read_text()
    assert "depth-use over seeds" in text and "llama, 3 layers (2 runs)" in text and "llama, 4 layers (1 run)" in text
    assert "llama, 4 layers - llama, 3 layers" in text and "## The depth map" in text
    assert "depth-map over seeds" in text and "llama, 3 layers -> llama, 4 layers (2 runs)" in text
    assert (tmp_path / "page_figures" / "depth_map_1.png").is_file()
    gaps = [json.loads((tmp_path / f"map-{n}" / "depth_map.json").read_text())["relative_depth"]["mean_abs_difference"] for n in ("a1", "a2")]
    lo, hi = mean_interval(gaps)
    assert f"{sum(gaps) / 2:.3f} [{lo:.3f}, {hi:.3f}]" in text
    assert not math.isnan(sum(gaps))


@pytest.mark.statistics
def test_a_shallow_record_has_no_second_half_influence_and_one_layer_no_middle():
    """Two layers: the influence rows stop at layer 0, so the second half (layer 1) has none; one
    layer: no layer n/2 - 1 to read the lenses at."""
    two = _record(layers=5)
    two["use"].update(n_layers=2, settled=[1, 1], tuned_settled=[1, 1], influence=[[None, 0.4], [None, None]], output_change=[1.0, 0.5])
    two["layers"] = two["layers"][:2]
    figures = use_figures(two)
    assert figures["influence_first"] == pytest.approx(0.4) and figures["influence_second"] is None and figures["lens_kl_middle"] == 10.0
    one = _record(layers=5)
    one["use"].update(n_layers=1, settled=[2], tuned_settled=[2], influence=[[None]], output_change=[1.0])
    one["layers"] = one["layers"][:1]
    figures = use_figures(one)
    assert figures["lens_kl_middle"] is None and figures["tuned_kl_middle"] is None and figures["skip_kl_first"] is None
    assert figures["skip_kl_second"] == 1.0 and figures["attn_second"] == pytest.approx(0.1)


@pytest.mark.statistics
def test_runs_measured_otherwise_are_other_groups_and_a_configs_key_order_is_not_a_difference():
    base = _record(source="a")
    other_steps = _record(source="b")
    other_steps["tuned_lens"]["settings"] = {"steps": 40}
    windows, length = _record(source="c"), _record(source="d")
    windows["run"]["windows"], length["run"]["seq_len"] = 4, 32
    reordered = _record(source="e")
    reordered["run"]["architecture"] = dict(reversed(list(reordered["run"]["architecture"].items())))
    groups = use_over_seeds([base, other_steps, windows, length, reordered], list("abcde"))["groups"]
    assert [g["runs"] for g in groups] == [["a", "e"], ["b"], ["c"], ["d"]]
    assert [g["label"] for g in groups] == ["pre, 5 layers", "pre, 5 layers #2", "pre, 5 layers #3", "pre, 5 layers #4"]


@pytest.mark.statistics
def test_labels_name_the_norm_its_init_and_the_depth():
    from depthcurse.depth.over_seeds import _label

    assert _label({"norm": "lns", "init_rule": "common", "num_hidden_layers": 4}) == "lns + common init, 4 layers"
    assert _label({"norm": "lns", "init_rule": "authors", "num_hidden_layers": 4}) == _label({"norm": "lns", "init_rule": "default", "num_hidden_layers": 4}) == "lns, 4 layers"
    assert _label({"model_type": "gpt2"}) == "gpt2" and _label({"hidden_size": 8}) == "model" and _label({"source": "x/y"}) == "x/y"
    assert _label({"source": "x", "norm": "pre"}) == "pre"


@pytest.mark.statistics
def test_depth_map_pairs_count_once_only_when_both_models_are_the_same():
    def record(shallow, deep, architecture=True):
        run = {"shallow": {"source": shallow}, "deep": {"source": deep}, "data": "wiki", "seq_len": 16}
        if architecture:
            run["shallow"]["architecture"], run["deep"]["architecture"] = {"norm": "pre", "num_hidden_layers": 3}, {"norm": "pre", "num_hidden_layers": 4}
        return {"run": run, "fit_windows": 4, "held_out_windows": 2, "deep_layers": 4, "r2": [[0.5, 0.9, 0.1, 0.0], [0.1, 0.2, 0.8, 0.6]],
                "relative_depth": {"mean_abs_difference": 0.1, "spearman": 1.0}}

    groups = map_over_seeds([record("a", "D"), record("b", "D"), record("a", "E"), record("a", "D")], ["aD", "bD", "aE", "aD again"])["groups"]
    assert [g["runs"] for g in groups] == [["aD", "bD", "aE"]]
    alone = map_over_seeds([record("a", "D", architecture=False), record("b", "D")], ["old", "new"])["groups"]
    assert [g["label"] for g in alone] == ["a -> D", "pre, 3 layers -> pre, 4 layers"]


@pytest.mark.statistics
def test_a_figure_only_some_runs_have_is_compared_only_where_both_groups_have_it():
    tuned = [_record("pre", "p1"), _record("pre", "p2", shift=0.03)]
    plain = [_record("lns", "l1", tuned=False), _record("lns", "l2", tuned=False, shift=0.1)]
    summary = use_over_seeds(tuned + plain, ["p1", "p2", "l1", "l2"])
    lns = summary["groups"][1]["summary"]
    assert lns["tuned_half_settled"] == {"values": [], "mean": None, "interval": None}
    figures = {d["figure"] for d in summary["differences"]}
    assert "tuned_half_settled" not in figures and "tuned_kl_middle" not in figures and "attn_first" in figures
    assert repeated(summary) and repeated(use_over_seeds(tuned, ["p1", "p2"])) and not repeated(use_over_seeds(tuned[:1], ["p1"]))
    from depthcurse.report import markdown_table

    seeds = markdown_table(seeds_table(summary, "depth-use"))
    assert "| half of the tokens settled, tuned lens (layer) | 1.0 (every run) | - |" in seeds
    one = markdown_table(seeds_table(use_over_seeds([tuned[0], plain[0]], ["p1", "l1"]), "depth-use"))
    assert "| phase transition (layer) | 3.0 | 3.0 |" in one and "(1 run)" in one  # one run: no interval, no plural


@pytest.mark.statistics
def test_the_tables_say_what_they_measured_column_by_column():
    summary = use_over_seeds([_record("pre", "p1"), _record("pre", "p2", shift=0.03), _record("lns", "l1", tuned=False), _record("lns", "l2", tuned=False)],
                             ["p1", "p2", "l1", "l2"])
    table = seeds_table(summary, "depth-use")
    assert table.title == "depth-use over seeds: each architecture's runs on the same text" and table.caption_justify == "left"
    assert table.caption == ("mean over runs (seeds), in brackets the 95% interval (Student's t at runs - 1 df; none from one run; (every run): "
                             "every run gave this value, no spread to give an interval of); the halves split the layers at n // 2")
    assert [(c.header, c.justify) for c in table.columns] == [("figure", "left"), ("pre, 5 layers (2 runs)", "right"), ("lns, 5 layers (2 runs)", "right")]
    assert table.row_count == len(summary["figures"])  # every figure: the pre runs have each
    table = differences_table(summary)
    assert table.title == "each architecture against pre, 5 layers: the difference of the means over seeds" and table.caption_justify == "left"
    assert table.caption == ("in brackets Welch's 95% interval (independent seeds, each group's own variance, Welch-Satterthwaite df); more / less "
                             "(later / earlier for a layer): the interval lies above / below 0; cannot tell: it holds 0, or a group has one run; "
                             "(every run): every run of both groups gave one value each, so there is no spread to give an interval of")
    assert [(c.header, c.justify) for c in table.columns] == [("figure", "left"), ("lns, 5 layers - pre, 5 layers", "right")]
    assert table.row_count == len(summary["figures"]) - 2  # the tuned lens's two figures: the lns runs have none
    three = use_over_seeds([_record("pre", "p1"), _record("pre", "p2", shift=0.03), _record("lns", "l1", tuned=False), _record("lns", "l2", tuned=False),
                            _record("dyt", "d1"), _record("dyt", "d2", shift=0.1)], ["p1", "p2", "l1", "l2", "d1", "d2"])
    from depthcurse.report import markdown_table

    text = markdown_table(differences_table(three))
    assert "| half of the tokens settled, tuned lens (layer) | - | +0.0 (every run) |" in text  # lns: none to compare; dyt: a tie
    lns, dyt = welch_interval([0.85, 0.85], [0.85, 0.88]), welch_interval([0.85, 0.95], [0.85, 0.88])  # row means 0.9 and 0.8, shifted
    assert (f"| influence on later layers, first half | -0.015 [{lns[0]:+.3f}, {lns[1]:+.3f}] cannot tell "
            f"| +0.035 [{dyt[0]:+.3f}, {dyt[1]:+.3f}] cannot tell |") in text


@pytest.mark.statistics
def test_figures_the_same_in_every_run_of_each_group_are_said_so_not_given_an_interval():
    """Phase 3 in both runs of one group and 2 in both of the other: Welch's interval has no width (no
    spread to estimate), so the difference is said as the same in every run, neither apart nor a tie."""
    summary = use_over_seeds([_record("pre", "p1"), _record("pre", "p2", shift=0.03), _record("lns", "l1", phase=2), _record("lns", "l2", phase=2, shift=0.2)],
                             ["p1", "p2", "l1", "l2"])
    from depthcurse.report import markdown_table

    assert "| phase transition (layer) | -1.0 (every run) |" in markdown_table(differences_table(summary))
    (line,) = seeds_verdicts(summary)
    assert "; the same in every run of each, and different: phase transition (layer) -1 (" in line
    assert line.endswith("(4 of 13 cannot tell at these seeds, 8 equal in every run)")  # the shifted four; the rest tie
    phase = next(d for d in summary["differences"] if d["figure"] == "phase")
    assert phase["interval"] == [-1.0, -1.0] and phase["apart"] is True  # the record keeps the arithmetic; the words do not claim it


@pytest.mark.statistics
def test_a_maps_bounded_figures_keep_their_intervals_inside_their_range():
    """Spearman's rho 0.48 and 0.94 over two seeds: t(1) = 12.706 gives 0.71 -+ 2.92, cut to [-1, 1]; a
    relative depth to [0, 1]; an R^2 above 1 to 1. The map's table says what relative depth is, not halves."""
    def record(source, rho, reach_row):
        return {"run": {"shallow": {"source": source, "architecture": {"num_hidden_layers": 2}}, "deep": {"source": source + "d", "architecture": {"num_hidden_layers": 4}},
                        "data": "wiki", "seq_len": 16},
                "fit_windows": 4, "held_out_windows": 2, "deep_layers": 4, "r2": [[0.5, 0.2, 0.1, 0.0], reach_row],
                "relative_depth": {"mean_abs_difference": 0.1, "spearman": rho}}

    summary = map_over_seeds([record("a", 0.48, [0.99, 0.2, 0.1, 0.0]), record("b", 0.94, [0.1, 0.2, 0.3, 0.98])], ["a", "b"])
    got = summary["groups"][0]["summary"]
    assert got["order"]["mean"] == pytest.approx(0.71) and got["order"]["interval"] == [-1.0, 1.0]
    assert got["last_reach"]["interval"] == [0.0, 1.0] and got["last_r2"]["interval"] == pytest.approx([0.985 - 12.7062 * 0.005, 1.0], abs=1e-4)
    assert got["depth_gap"]["interval"] == [0.1, 0.1]  # unbounded figures as they are
    caption = seeds_table(summary, "depth-map").caption
    assert caption.endswith("relative depth: (layer + 1) / layers (stream / layers by their definitions); the score: the map's deciding one; "
                            "a correlation's, a relative depth's and an R^2's interval cut at the ends of its range")


@pytest.mark.statistics
def test_maps_of_two_definitions_or_two_scores_are_not_set_side_by_side():
    from depthcurse.errors import DepthcurseError

    def record(source, **extra):
        return {"run": {"shallow": {"source": source, "architecture": {"num_hidden_layers": 2}}, "deep": {"source": source + "d", "architecture": {"num_hidden_layers": 4}},
                        "data": "wiki", "seq_len": 16}, "fit_windows": 4, "held_out_windows": 2, "deep_layers": 4, "r2": [[0.5, 0.2, 0.1, 0.0], [0.1, 0.2, 0.3, 0.9]],
                "relative_depth": {"mean_abs_difference": 0.1, "spearman": 0.5}, **extra}

    dims = {"scores": {"r2_dims": {"mean": [[0.4, 0.2, 0.1, 0.0], [0.1, 0.2, 0.3, 0.8]], "interval": [[None] * 4] * 2}}, "score": "r2_dims"}
    with pytest.raises(DepthcurseError, match=r"^maps of two scores: a decided by r2, b by r2_dims; not set side by side \(rerun one with --score\)$"):
        map_over_seeds([record("a"), record("b", **dims)], ["a", "b"])
    with pytest.raises(DepthcurseError, match=r"^maps of two definitions: a by the depthcurse definitions, b by the csordas ones"):
        map_over_seeds([record("a"), record("b", definitions={"name": "csordas"})], ["a", "b"])
    got = map_over_seeds([record("a", **dims), record("b", **dims)], ["a", "b"])["groups"][0]["summary"]
    assert got["last_r2"]["values"] == [0.8, 0.8] and [f["label"] for f in map_over_seeds([record("a", **dims)], ["a"])["figures"]][3] == "shallow last layer's best per-dimension R^2"


@pytest.mark.statistics
def test_summarise_runs_is_report_s_summary_from_per_run_figures_alone():
    """Two groups' per-run figures as a finding stores them: the same summary `use_over_seeds` makes
    of the records, group labels and run counts included; a map's by its score's figures."""
    records = [_record("pre", "p1"), _record("pre", "p2", shift=0.03, phase=4), _record("lns", "l1", shift=0.2, phase=2), _record("lns", "l2", shift=0.21, phase=2)]
    from depthcurse.depth.over_seeds import summarise_runs, use_figures

    made = use_over_seeds(records, ["p1", "p2", "l1", "l2"])
    stored = summarise_runs({"pre, 5 layers": [use_figures(r) for r in records[:2]], "lns, 5 layers": [use_figures(r) for r in records[2:]]})
    assert stored["differences"] == made["differences"] and [g["summary"] for g in stored["groups"]] == [g["summary"] for g in made["groups"]]
    assert [g["runs"] for g in stored["groups"]] == [["pre, 5 layers #1", "pre, 5 layers #2"], ["lns, 5 layers #1", "lns, 5 layers #2"]]
    assert stored["note"] == made["note"] == "the halves split the layers at n // 2"
    maps = summarise_runs({"a": [{"depth_gap": 0.1, "order": 0.5, "last_reach": 0.2, "last_r2": 0.9, "deep_last_r2": 0.8}] * 2}, kind="map", score="relative_error")
    assert [f["label"] for f in maps["figures"]][3:] == ["shallow last layer's lowest relative error", "deep last layer's relative error from the best shallow layer"]
    assert maps["note"].startswith("relative depth: (layer + 1) / layers (stream / layers by their definitions)")


@pytest.mark.statistics
def test_a_relative_error_maps_figures_take_its_lowest_and_streams_from_the_embedding():
    """Their map (`--as csordas`): streams entering each layer, 0 the embedding, lower is better. A 3 x 4
    grid: the last shallow stream's lowest error is at deep stream 1 (relative depth 1 / 3, not 2 / 3),
    and the deep last stream's lowest over the shallow ones."""
    from depthcurse.depth.over_seeds import map_figures

    record = {"streams": "entering", "deep_layers": 3, "score": "relative_error", "relative_depth": {"mean_abs_difference": 0.25, "spearman": 0.5},
              "scores": {"relative_error": {"mean": [[0.2, 0.5, 0.6, 0.9], [0.4, 0.3, 0.5, 0.7], [0.6, 0.35, 0.4, 0.45]], "interval": None}}}
    assert map_figures(record) == {"depth_gap": 0.25, "order": 0.5, "last_reach": pytest.approx(1 / 3), "last_r2": 0.35, "deep_last_r2": 0.45}
    record["streams"] = "after"
    assert map_figures(record)["last_reach"] == pytest.approx(2 / 3)
