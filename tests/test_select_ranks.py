"""select across processes: under `torchrun --nproc-per-node 2 -m depthcurse select` on the CPU
(gloo) the removals a search scores at once (`exact`'s sets, a `greedy` step's candidates, an `evo`
stage's offspring, `random`'s draws) and the chosen sets judged held out are shared over the ranks
and every score gathered on every rank, so the two ranks choose exactly what one process chooses,
score for score; only rank 0 writes and talks.

The one-process reference runs in this process with one thread, as each torchrun child does: the
same removals through the same code give the same bits.
"""

from __future__ import annotations

import json

import pytest

from helpers import torchrun
from depthcurse.select.scoring import contiguous_shares

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_two_ranks_choose_what_one_process_chooses_score_for_score(run_cli, six_dir, text_file, tmp_path):
    common = ["select", six_dir, "--k", "2", "--calibration", text_file, "--objective", "kl,ppl", "--search", "exact,greedy,evo,random,last,angular",
              "--calib-windows", "4", "--eval-windows", "4", "--seq-len", "16", "--batch-size", "2",
              "--search-args", "evo.generations=3,evo.offspring=4,evo.initially_generated=6,random.sets=5"]
    code, out, err = run_cli(*map(str, common), "--out", str(tmp_path / "one"))
    assert code == 0, err
    two = torchrun("-m", "depthcurse", *common, "--out", tmp_path / "two")
    assert two.returncode == 0, two.stderr[-3000:]
    one, both = (json.loads((tmp_path / d / "select.json").read_text()) for d in ("one", "two"))
    assert one["run"] == both["run"]
    assert both["calibration_scores"] == one["calibration_scores"]  # every removal scored, to the bit
    assert both["held_out"] == one["held_out"]
    assert {n: c["layers"] for n, c in both["cells"].items()} == {n: c["layers"] for n, c in one["cells"].items()}
    assert both["distances"] == one["distances"] and both["decomposition"] == one["decomposition"]
    for name, cell in one["cells"].items():
        if "cost" not in cell:
            continue
        shared = both["cells"][name]["cost"]
        for what in ("sets_scored", "subset_scores", "tokens_scored", "naive_block_passes", "head_passes", "removals_asked"):
            assert shared[what] == cell["cost"][what], (name, what)
        # the ranks' blocks, added: evo's stages exactly one process's; a rank's share of the prefix
        # walk may run again a prefix the rank before it ran
        if "/evo/" in name:
            assert shared["block_passes"] == cell["cost"]["block_passes"], name
        else:
            assert cell["cost"]["block_passes"] <= shared["block_passes"] <= 1.5 * cell["cost"]["block_passes"], name
    assert (two.stdout + two.stderr).count("written: ") == 1  # only rank 0 talks and writes


@pytest.mark.searching
def test_contiguous_shares_cut_in_order_as_evenly_as_the_costs_allow():
    assert contiguous_shares([1] * 7, 1) == [(0, 7)]
    assert contiguous_shares([1] * 7, 2) == [(0, 4), (4, 7)]  # the fourth item's middle is the half: the first rank's
    assert contiguous_shares([1] * 6, 3) == [(0, 2), (2, 4), (4, 6)]
    # a costly head: the first rank takes it alone, the rest share the cheap tail
    assert contiguous_shares([9, 1, 1, 1, 1, 1, 1, 1, 1, 1], 2) == [(0, 1), (1, 10)]
    assert contiguous_shares([5, 4, 3, 2, 1], 3) == [(0, 1), (1, 2), (2, 5)]  # 5, 4, 6: the 3's middle (10.5) lies past 10
    assert contiguous_shares([1, 1], 4) == [(0, 1), (1, 1), (1, 2), (2, 2)]  # fewer items than ranks: some get none
    assert contiguous_shares([], 2) == [(0, 0), (0, 0)]
    for costs in ([3, 1, 4, 1, 5, 9, 2, 6], [1] * 13, [2, 7]):
        for ranks in (1, 2, 3, 5):
            bounds = contiguous_shares(costs, ranks)
            assert bounds[0][0] == 0 and bounds[-1][1] == len(costs) and all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
