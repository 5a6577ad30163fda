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
from depthcurse.select.grid import _shares, jaccard, text_windows
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
    assert again["cells"] == record["cells"] and again["held_out"] == record["held_out"]
    from rich.console import Console
    console = Console(record=True, width=400)
    console.print(select_table(record))
    assert "judged on held-out windows" in console.export_text()
    with pytest.raises(DepthcurseError, match="select run"):
        run_select(loaded, SelectConfig(k=1, calibration=tuple(two_texts), calib_windows=3, eval_windows=4, seq_len=16), tmp_path / "grid")


def test_the_shares_are_a_two_way_decomposition_worked_out_by_hand():
    # rows (calibration) differ by 2, columns (search) by 0: all of the spread goes with the calibration
    y = {("a", "x"): 1.0, ("a", "y"): 1.0, ("b", "x"): 3.0, ("b", "y"): 3.0}
    assert _shares(y, ["a", "b"], ["x", "y"]) == {"calibration": 1.0, "search": 0.0, "rest": 0.0}
    y = {("a", "x"): 1.0, ("a", "y"): 2.0, ("b", "x"): 1.0, ("b", "y"): 4.0}  # grand 2; rows 1.5, 2.5; columns 1, 3
    shares = _shares(y, ["a", "b"], ["x", "y"])  # total 6: rows 2 x 0.5 = 1, columns 2 x 2 = 4, rest 1
    assert shares == pytest.approx({"calibration": 1 / 6, "search": 4 / 6, "rest": 1 / 6})


def test_select_on_the_command_line_and_its_bad_input(run_cli, tiny_model_dir, two_texts, tmp_path):
    code, stdout, err = run_cli("select", str(tiny_model_dir), "--k", "1", "--calibration", ",".join(two_texts), "--search", "greedy,bi", "--calib-windows", "2",
                                "--eval-windows", "3", "--seq-len", "16", "--out", str(tmp_path / "cli"))
    assert code == 0, err
    assert all((tmp_path / "cli" / f).is_file() for f in ("select.json", "select.csv", "select.png"))
    code, _, err = run_cli("report", str(tmp_path / "cli"), "--out", str(tmp_path / "page.md"))
    assert code == 0, err
    page = (tmp_path / "page.md").read_text()
    assert "## Calibration against search" in page and "select_0.png" in page
    for args, said in ((("--search", "magic"), "--search magic: use greedy"), (("--k", "0"), "--k must be at least 1"),
                       (("--objective", "acc"), "--objective acc: use ppl, kl"), (("--eval-windows", "1"), "--eval-windows must be at least 2")):
        assert_one_line_error(*run_cli("select", str(tiny_model_dir), "--calibration", two_texts[0], *args, "--out", str(tmp_path / "bad")), said)


def test_scoring_from_the_kept_streams_equals_the_models_own_forward(tiny_model_dir, two_texts):
    """The fast path (the unpruned streams kept, a removal run from its first removed block) gives
    the plain path's losses and KLs (the model's own forward with the layers removed)."""
    from depthcurse.select.grid import Scorer

    loaded = load_model(str(tiny_model_dir))
    cfg = SelectConfig(k=2, calibration=(two_texts[0],), calib_windows=3, eval_windows=2, seq_len=16, batch_size=2)
    texts = text_windows(loaded.tokenizer, two_texts[0], cfg)
    fast = Scorer(loaded.model, texts, cfg, {}, lambda: None)
    plain = Scorer(loaded.model, texts, cfg, {}, lambda: None)
    plain.streams = None
    assert fast.streams is not None
    for removed in ((0,), (2,), (1, 3), (0, 2, 3)):
        (fl, fk), (pl, pk) = fast._measured(removed), plain._measured(removed)
        assert fl == pytest.approx(pl, rel=1e-5, abs=1e-6) and fk == pytest.approx(pk, rel=1e-4, abs=1e-6)
    # and both are KL(unpruned || pruned) per window, worked out here by torch's kl_div
    with torch.no_grad():
        unpruned = torch.log_softmax(loaded.model(input_ids=texts.calibration).logits[:, :-1].float(), -1)
        with removed_layers(loaded.model, (1, 3)):
            pruned = torch.log_softmax(loaded.model(input_ids=texts.calibration).logits[:, :-1].float(), -1)
    by_hand = torch.nn.functional.kl_div(pruned, unpruned, log_target=True, reduction="none").sum(-1).mean(1).tolist()
    assert fast._measured((1, 3))[1] == pytest.approx(by_hand, rel=1e-4, abs=1e-6)
