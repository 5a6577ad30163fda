"""`depthcurse select` on a tiny model: each cell's choice is what its search gives when run by hand
(greedy's and one-shot's removals scored here by plain forwards, Block Influence from the hidden
states), every choice judged on the same held-out windows, the overlap and the decomposition
worked out here, and an interrupted grid resumed to the same record.
"""

from __future__ import annotations

import json

import pytest
import torch

from helpers import assert_one_line_error

from depthcurse.errors import DepthcurseError
from depthcurse.loading import load_model
from depthcurse.select import SelectConfig, run_select, select_table
from depthcurse.select.config import source_labels
from depthcurse.select.windows import text_windows
from depthcurse.select.search import Space, SearchContext
from depthcurse.select.searches.greedy import Greedy
from depthcurse.select.searches.one_shot import OneShot
from depthcurse.select.statistics import jaccard
from depthcurse.surgery import removed_layers

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture()
def two_texts(tmp_path):
    from conftest import CORPUS

    paths = []
    for name, shift in (("one", 0), ("two", 3)):
        path = tmp_path / f"{name}.txt"
        path.write_text("\n\n".join(f"{name}{i} {CORPUS[(i + shift) % len(CORPUS)]} {CORPUS[(i * 5 + 1) % len(CORPUS)]}" for i in range(60)))
        paths.append(str(path))
    return paths


def _loss(model, windows):
    with torch.no_grad():
        logits = model(input_ids=windows).logits[:, :-1]
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten(), reduction="none").view(len(windows), -1).mean(1).mean().item()


@pytest.mark.searching
def test_the_reference_scores_kl_agreement_and_loss_by_hand():
    """Unpruned p = (1/2, 1/4, 1/4), model q = (1/4, 1/2, 1/4) at one position; p = q = (0.1, 0.2, 0.7)
    at another: KL(p || q) = ln 2 / 2 - ln 2 / 4 = ln 2 / 4 = 0.1733 and 0; the top-1 tokens 0 and 1
    differ, then agree (2); the next tokens 2 and 0 cost -ln q: ln 4 and -ln 0.1. Worked out once
    (`Reference.of`), p log p is -1.0397 and -0.8018 (the other formula's per-removal exp, kept
    before, gives the same to 1e-6)."""
    import math

    from depthcurse.select.scoring import Reference, window_scores

    p = torch.tensor([[[0.5, 0.25, 0.25], [0.1, 0.2, 0.7]]]).log()
    q = torch.tensor([[[0.25, 0.5, 0.25], [0.1, 0.2, 0.7]]]).log()
    reference = Reference.of(p)
    assert reference.top1.tolist() == [[0, 2]]
    assert reference.self_term[0].tolist() == pytest.approx([-1.5 * math.log(2), 0.1 * math.log(0.1) + 0.2 * math.log(0.2) + 0.7 * math.log(0.7)], abs=1e-6)
    losses, kl, agreement = window_scores(q, torch.tensor([[5, 2, 0]]), reference)
    assert kl[0].tolist() == pytest.approx([math.log(2) / 4, 0.0], abs=1e-6) and kl.min() >= 0  # the second is clamped at 0, not a rounding below it
    assert agreement.tolist() == [[0.0, 1.0]] and losses[0].tolist() == pytest.approx([math.log(4), -math.log(0.1)], abs=1e-6)
    assert kl[0].tolist() == pytest.approx((p.exp() * (p - q)).sum(-1)[0].tolist(), abs=1e-6)
    assert reference[0, :1].top1.tolist() == [0] and reference[0, 1:].self_term.tolist() == pytest.approx([reference.self_term[0, 1].item()])


@pytest.mark.searching
def test_the_top1_of_a_tie_is_its_first_token_as_argmax_says():
    """`top1_of` (`max`'s indices, faster than `argmax` on a CPU) breaks a tie as argmax does: the first
    token: 1 in the first row, where a last-of-a-tie rule gives 2; the wide rows (a tie of three, one
    with a larger value before it) take the vectorised path."""
    from depthcurse.select.scoring import top1_of

    logp = torch.tensor([[0.1, 0.3, 0.3, 0.2, 0.0], [0.0, 0.0, 0.0, 0.0, 0.5]])
    assert top1_of(logp).tolist() == [1, 4]
    wide = torch.zeros(3, 49152)
    wide[:, [7, 30000, 49151]] = 1.0
    wide[1, 5] = 2.0
    assert top1_of(wide).tolist() == [7, 5, 7] == wide.argmax(-1).tolist()


@pytest.mark.searching
@pytest.mark.parametrize("rows", [1, 5, 64, None])
def test_the_head_scored_a_chunk_of_positions_at_a_time_gives_the_whole_batchs_figures(rows):
    """`head_scores` runs the head on `rows` positions at a time (a chunk that ends inside a window, one
    that spans two windows, all at once, and by default the whole batch in one): every position's loss, KL and agreement equal those of the
    whole batch's log-probs at once (`window_scores`), the window's last position left out as there, and
    a head that scales its logits (as Gemma's soft-cap does) is applied to each chunk alike."""
    from depthcurse.select.scoring import Reference, head_scores, window_scores

    gen = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(8, 50, bias=False)
    logits_of = lambda h: torch.tanh(head(h) / 3.0) * 3.0  # noqa: E731
    h, ids = torch.randn(3, 7, 8, generator=gen), torch.randint(0, 50, (3, 7), generator=gen)
    reference = Reference.of(torch.log_softmax(torch.randn(3, 6, 50, generator=gen), -1))
    with torch.no_grad():
        whole = window_scores(torch.log_softmax(logits_of(h)[:, :-1], -1), ids, reference)
        chunked = head_scores(logits_of, h, ids, reference, rows=rows)
        assert [tuple(c.shape) for c in chunked] == [(3, 6)] * 3
        for a, b in zip(whole, chunked):
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
        assert head_scores(logits_of, h, ids, None, rows=rows)[1:] == (None, None)
        assert torch.equal(head_scores(logits_of, h, ids, None, rows=rows)[0], chunked[0])


@pytest.mark.searching
def test_each_cell_is_its_search_by_hand_and_the_grid_resumes(tiny_model_dir, two_texts, tmp_path):
    loaded = load_model(str(tiny_model_dir))
    model = loaded.model
    cfg = SelectConfig(k=2, calibration=tuple(two_texts), objectives=("ppl", "kl"), searches=("greedy", "one-shot", "bi"), calib_windows=3,
                       eval_windows=4, seq_len=16, batch_size=2)
    record = run_select(loaded, cfg, tmp_path / "grid")
    n = len(model.model.layers)
    assert len(record["cells"]) == 2 * (2 + 2 + 1)
    for source in two_texts:
        windows = text_windows(loaded.tokenizer, source, cfg).calibration
        def cost(removed):
            with removed_layers(model, tuple(sorted(removed))):
                return _loss(model, windows)
        first = min(range(n), key=lambda u: (round(cost((u,)), 6), u))
        second = min((u for u in range(n) if u != first), key=lambda u: (round(cost((first, u)), 6), u))
        label = source.rsplit("/", 1)[-1].removesuffix(".txt")
        assert record["cells"][f"{label}/greedy/ppl"]["layers"] == sorted([first, second])
        ranked = sorted(range(n), key=lambda u: (round(cost((u,)), 6), u))
        assert record["cells"][f"{label}/one-shot/ppl"]["layers"] == sorted(ranked[:2])
        with torch.no_grad():
            reference = torch.log_softmax(model(input_ids=windows).logits[:, :-1].float(), -1)

        def kl(removed):  # KL(unpruned || pruned), every position's, by torch's kl_div
            with removed_layers(model, tuple(sorted(removed))), torch.no_grad():
                logp = torch.log_softmax(model(input_ids=windows).logits[:, :-1].float(), -1)
            return torch.nn.functional.kl_div(logp, reference, log_target=True, reduction="none").sum(-1).mean().item()
        first = min(range(n), key=lambda u: (round(kl((u,)), 7), u))
        second = min((u for u in range(n) if u != first), key=lambda u: (round(kl((first, u)), 7), u))
        assert record["cells"][f"{label}/greedy/kl"]["layers"] == sorted([first, second])  # by KL, not by the loss
        with torch.no_grad():
            hidden = model(input_ids=windows, output_hidden_states=True).hidden_states
        # Block Influence of block l: 1 - cos(input, output) over every token (the last block's output is before the final norm: hooks)
        outs = []
        handle = model.model.layers[-1].register_forward_hook(lambda m, a, o: outs.append(o[0] if isinstance(o, tuple) else o))
        with torch.no_grad():
            model(input_ids=windows)
        handle.remove()
        states = [*hidden[:-1], outs[0]]
        bi = [1 - torch.nn.functional.cosine_similarity(states[l].flatten(0, 1).double(), states[l + 1].flatten(0, 1).double(), dim=-1).mean().item() for l in range(n)]
        assert record["cells"][f"{label}/bi"]["layers"] == sorted(sorted(range(n), key=lambda l: (bi[l], l))[:2])
    # every choice judged on both texts' held-out windows, the unpruned model's too
    sets = {",".join(map(str, c["layers"])) for c in record["cells"].values()}
    for source in two_texts:
        assert set(record["held_out"][source]) == sets | {""}
        held = text_windows(loaded.tokenizer, source, cfg).held_out
        some = next(iter(sets))
        with removed_layers(model, tuple(int(i) for i in some.split(","))):
            assert sum(record["held_out"][source][some]["loss"]) / 4 == pytest.approx(_loss(model, held), rel=1e-5)
    names = record["overlap"]["cells"]
    a, b = names[0], names[1]
    assert record["overlap"]["matrix"][0][1] == jaccard(record["cells"][a]["layers"], record["cells"][b]["layers"])
    # the decomposition of each held-out measurement: shares add to 1, each with an interval
    for name, d in record["decomposition"].items():
        assert sum(d["shares"].values()) == pytest.approx(1.0) and "decided_by" in d
    # resumed: an interrupted grid (its cells partly there) ends with the same record
    saved = json.loads((tmp_path / "grid" / "select.json").read_text())
    partial = {**saved, "cells": dict(list(saved["cells"].items())[:3]), "held_out": {}, "decomposition": {}}
    (tmp_path / "again").mkdir()
    (tmp_path / "again" / "select.json").write_text(json.dumps(partial))
    again = run_select(loaded, cfg, tmp_path / "again")
    choices = lambda r: {n: c["layers"] for n, c in r["cells"].items()}  # noqa: E731 (a re-run cell's seconds and cost are its own)
    assert choices(again) == choices(record) and again["held_out"] == record["held_out"]
    from rich.console import Console
    console = Console(record=True, width=400)
    console.print(select_table(record))
    assert "judged on held-out windows" in console.export_text()
    with pytest.raises(DepthcurseError, match="select run"):
        run_select(loaded, SelectConfig(k=1, calibration=tuple(two_texts), calib_windows=3, eval_windows=4, seq_len=16), tmp_path / "grid")


@pytest.mark.statistics
def test_greedy_and_one_shot_rank_by_the_cells_objective_worked_out_by_hand():
    """Four layers whose removals' loss and KL disagree: by loss greedy takes 0 then 1 (0.1, then 0.3
    beside 0.4 and 0.9), one-shot 0 and 2; by KL greedy takes 3 then 2 (0.05, then 0.10), one-shot 3 and 1."""
    table = {(0,): (0.1, 0.9), (1,): (0.3, 0.2), (2,): (0.2, 0.6), (3,): (0.5, 0.05),
             (0, 1): (0.3, 1.0), (0, 2): (0.4, 1.0), (0, 3): (0.9, 1.0), (1, 2): (0.8, 0.5), (1, 3): (0.7, 0.3), (2, 3): (0.6, 0.1)}

    def run(search, objective, k=2):
        def score_many(removals):
            return [table[tuple(sorted(r))][0 if objective == "ppl" else 1] for r in removals]
        ctx = SearchContext(space=Space(4, k), objective=objective, score=lambda r: score_many([r])[0], score_many=score_many, score_on=None,
                            windows=1, window_tokens=1, streams=None)
        return list(search.run(ctx))

    assert run(Greedy(), "ppl") == [0, 1] and run(Greedy(), "kl") == [2, 3]
    assert run(OneShot(), "ppl") == [0, 2] and run(OneShot(), "kl") == [1, 3]
    assert run(Greedy(), "kl", k=1) == [3]


@pytest.mark.searching
def test_calibration_texts_of_one_name_in_two_folders_keep_apart(tmp_path, two_texts):
    """Two files called lee.txt in two folders are two texts: their labels (and so their cells) differ,
    and a text named twice is refused."""
    a, b = tmp_path / "a" / "lee.txt", tmp_path / "b" / "lee.txt"
    for path in (a, b):
        path.parent.mkdir()
        path.write_text("x")
    assert source_labels([str(a), str(b), "wiki"]) == {str(a): "a/lee", str(b): "b/lee", "wiki": "wiki"}
    assert source_labels([str(a), two_texts[0]]) == {str(a): "lee", two_texts[0]: "one"}
    with pytest.raises(DepthcurseError, match="--calibration names .* more than once"):
        SelectConfig(k=1, calibration=(str(a), str(tmp_path / "a" / ".." / "a" / "lee.txt"))).checked()


@pytest.mark.searching
def test_held_out_windows_are_never_calibration_windows(tiny_tokenizer, two_texts):
    cfg = SelectConfig(k=1, calibration=(two_texts[0],), calib_windows=5, eval_windows=7, seq_len=16)
    texts = text_windows(tiny_tokenizer, two_texts[0], cfg)
    assert texts.calibration.shape == (5, 16) and texts.held_out.shape == (7, 16)
    every = torch.cat([texts.calibration, texts.held_out])
    assert len({tuple(w.tolist()) for w in every}) == 12  # twelve different windows, none in both parts


def test_select_on_the_command_line_and_its_bad_input(run_cli, tiny_model_dir, two_texts, tmp_path):
    code, stdout, err = run_cli("select", str(tiny_model_dir), "--k", "1", "--calibration", ",".join(two_texts), "--search", "greedy,bi", "--calib-windows", "2",
                                "--eval-windows", "3", "--seq-len", "16", "--out", str(tmp_path / "cli"))
    assert code == 0, err
    assert "note: --eval-windows 3: fewer than 8 held-out windows are too few to resample" in " ".join(err.split())  # said before the work
    assert all((tmp_path / "cli" / f).is_file() for f in ("select.json", "select.csv", "select.png"))
    code, _, err = run_cli("report", str(tmp_path / "cli"), "--out", str(tmp_path / "page.md"))
    assert code == 0, err
    page = (tmp_path / "page.md").read_text()
    assert "## Calibration against search" in page and "select_0.png" in page
    said = " ".join(stdout.split())
    # the verdicts, a line each after the table: the overlap, and no decision from 3 windows
    assert "- overlap of the choices (mean Jaccard): the same text by different searches" in said
    assert "cannot tell (3 held-out items are too few to resample" in said and "decided by the" not in said
    for args, said in ((("--search", "magic"), "--search magic: use angular, bi, draft-verify, evo, exact, greedy"), (("--k", "0"), "--k must be at least 1"),
                       (("--objective", "acc"), "--objective acc: use ppl, kl"), (("--eval-windows", "1"), "--eval-windows must be at least 2"),
                       (("--search", "greedy,greedy"), "--search names greedy more than once"),
                       (("--objective", "ppl,ppl"), "--objective names ppl more than once"),
                       (("--search", "angular,bi", "--objective", "kl"), "--objective kl: no search of --search angular,bi reads an objective"),
                       (("--limit", "5"), "--limit applies to --task, which is not given"),
                       (("--seq-len", "100000"), "--seq-len 100000 is longer than LlamaForCausalLM accepts"),
                       (("--calibration", "c4"), "--calibration c4: C4 comes from the hub")):
        args = ("--k", "1", *args) if args[0] == "--calibration" else ("--k", "1", "--calibration", two_texts[0], *args)
        assert_one_line_error(*run_cli("select", str(tiny_model_dir), *args, "--out", str(tmp_path / "bad")), said)
    code, _, err = run_cli("select", str(tiny_model_dir), "--calibration", f"{two_texts[0]},{two_texts[0]}", "--out", str(tmp_path / "bad"))
    assert code == 1 and "--calibration names" in err and "more than once" in err


@pytest.mark.searching
def test_scoring_from_the_kept_streams_equals_the_models_own_forward(tiny_model_dir, two_texts):
    """The fast path (the unpruned streams kept, a removal run from its first removed block, many
    removals by the prefix walk) gives the plain path's losses and KLs (the model's own forward with
    the layers removed)."""
    from depthcurse.select.scoring import CalibrationScorer

    loaded = load_model(str(tiny_model_dir))
    cfg = SelectConfig(k=2, calibration=(two_texts[0],), calib_windows=3, eval_windows=2, seq_len=16, batch_size=2)
    texts = text_windows(loaded.tokenizer, two_texts[0], cfg)
    fast = CalibrationScorer(loaded.model, texts.calibration, 2, {}, lambda: None)
    plain = CalibrationScorer(loaded.model, texts.calibration, 2, {}, lambda: None)
    plain.stepper = None
    plain.batches = plain._unpruned()
    assert fast.stepper is not None
    removals = [(0,), (2,), (1, 3), (0, 2, 3)]
    for removal, f, p in zip(removals, fast.score_many(removals), plain.score_many(removals)):
        assert f["ppl"] == pytest.approx(p["ppl"], rel=1e-5) and f["kl"] == pytest.approx(p["kl"], rel=1e-4, abs=1e-6), removal
    for removal in removals:  # some windows: the subset path, from the kept streams, against the plain one
        assert fast.score_on(removal, [2, 0], 9, "kl") == pytest.approx(plain.score_on(removal, [2, 0], 9, "kl"), rel=1e-4, abs=1e-7)
    # and both are KL(unpruned || pruned) per window, worked out here by torch's kl_div
    with torch.no_grad():
        unpruned = torch.log_softmax(loaded.model(input_ids=texts.calibration).logits[:, :-1].float(), -1)
        with removed_layers(loaded.model, (1, 3)):
            pruned = torch.log_softmax(loaded.model(input_ids=texts.calibration).logits[:, :-1].float(), -1)
    by_hand = torch.nn.functional.kl_div(pruned, unpruned, log_target=True, reduction="none").sum(-1)
    assert fast((1, 3))["kl"] == pytest.approx(by_hand.mean().item(), rel=1e-4, abs=1e-6)
    # a stage's minibatch: windows 2 and 0, the last cut to 9 tokens (8 predictions): the mean over those 15 + 8 predictions
    assert fast.score_on((1, 3), [2, 0], 9, "kl") == pytest.approx(torch.cat([by_hand[2], by_hand[0, :8]]).mean().item(), rel=1e-4)


@pytest.mark.searching
def test_an_interrupted_select_says_where_it_stopped_and_resumes(run_cli, tiny_model_dir, two_texts, tmp_path, monkeypatch):
    """Ctrl-C or SIGTERM (which the CLI turns into the same) during the grid: the finished pieces are
    in select.json, the one line says what it was doing and that a rerun continues, and the rerun
    ends with the record an uninterrupted run makes."""
    import depthcurse.select as select_package

    args = ["select", str(tiny_model_dir), "--k", "1", "--calibration", ",".join(two_texts), "--search", "greedy,bi", "--calib-windows", "2",
            "--eval-windows", "3", "--seq-len", "16"]
    real = select_package.run_select

    def stopped_at_the_second_step(loaded, cfg, out, *, on_phase, on_step, **rest):
        def step(label, done, total):
            on_step(label, done, total)
            if done == 1:
                raise KeyboardInterrupt
        return real(loaded, cfg, out, on_phase=on_phase, on_step=step, **rest)

    monkeypatch.setattr(select_package, "run_select", stopped_at_the_second_step)
    code, _, err = run_cli(*args, "--out", tmp_path / "cut")
    said = " ".join(err.split())
    assert code == 130 and "interrupted while choosing on one" in said and "(2 of 2)" in said and "rerun the same command to continue" in said
    kept = json.loads((tmp_path / "cut" / "select.json").read_text())
    assert list(kept["cells"]) == ["one/greedy/ppl"]  # the first cell finished before the stop, and is kept
    monkeypatch.setattr(select_package, "run_select", real)
    assert run_cli(*args, "--out", tmp_path / "cut")[0] == 0
    assert run_cli(*args, "--out", tmp_path / "whole")[0] == 0
    resumed, whole = (json.loads((tmp_path / f / "select.json").read_text()) for f in ("cut", "whole"))
    choices = lambda r: {n: c["layers"] for n, c in r["cells"].items()}  # noqa: E731 (each cell's seconds and cost are its run's)
    assert choices(resumed) == choices(whole) and resumed["held_out"] == whole["held_out"] and resumed["decomposition"] == whole["decomposition"]


def test_select_stops_on_sigterm_and_keeps_what_it_finished(tiny_model_dir, two_texts, tmp_path):
    """A scheduler's SIGTERM, sent once select.json holds a finished cell: the run ends (exit 130, the
    one line), not at the end of its work. The wait below guards against a hang; it times nothing."""
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "term"
    proc = subprocess.Popen([sys.executable, "-m", "depthcurse", "select", str(tiny_model_dir), "--k", "1", "--calibration", ",".join(two_texts),
                             "--search", "greedy,bi", "--calib-windows", "2", "--eval-windows", "3", "--seq-len", "16", "--task", "probes", "--limit", "2",
                             "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    def finished_a_cell() -> bool:  # the first write holds calibration scores alone: wait for a cell, as the docstring says
        try:
            return bool(json.loads((out / "select.json").read_text())["cells"])
        except (OSError, ValueError, KeyError):  # not written yet (the write is atomic: never half a file)
            return False

    try:
        while not finished_a_cell() and proc.poll() is None:
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "interrupted while" in err and "rerun the same command to continue" in err, err
    assert json.loads((out / "select.json").read_text())["cells"]

