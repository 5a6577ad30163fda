"""The twelve single-point bugs issue 64's audit planted in the statistics and the probes, planted
again one at a time: each must make a test fail (CAUGHT), or the tests have gone blind to it.

    python benchmarks/planted_bugs.py            # all twelve, about 3 minutes on 2 cores
    python benchmarks/planted_bugs.py a c k      # some, by their letter

Each plant is one textual replacement in one file, put back whatever happens; the tests named
beside it run against it. `make mutate` is the broader habit (every mutant of the statistics core);
this keeps the bugs a reader of the issue would think of first.
"""

import subprocess, sys, pathlib
ROOT = pathlib.Path(__file__).resolve().parent.parent
PLANTS = [
 ("a overlap pairs a cell with itself", "depthcurse/select/statistics.py", "for b in names[i + 1:]:", "for b in names[i:]:", ["tests/test_statistics.py", "tests/test_reported_numbers.py"]),
 ("b held-out windows overlap calibration", "depthcurse/select/grid.py", "windows[order[cfg.calib_windows:want]]", "windows[order[cfg.calib_windows - 1:want - 1]]", ["tests/test_select.py::test_held_out_windows_are_never_calibration_windows"]),
 ("c bootstrap not paired across cells", "depthcurse/select/statistics.py", "drawn = resample(lambda picks: shares(table[..., picks].mean(-1))", "drawn = resample(lambda picks: shares(np.stack([table[i][..., np.roll(picks, i, axis=0)].mean(-1) for i in range(len(table))]))", ["tests/test_statistics.py", "tests/test_reported_numbers.py"]),
 ("d decided by with overlapping intervals", "depthcurse/stats/decomposition.py", "if row[0] > column[1]:", "if row[1] > column[1]:", ["tests/test_statistics.py"]),
 ("e calibration SS weighted by the wrong count", "depthcurse/stats/decomposition.py", "ss_rows = c * ", "ss_rows = r * ", ["tests/test_statistics.py"]),
 ("f greedy ranks by ppl in a KL cell", "depthcurse/select/grid.py", "def score_many(removals, o=objective, asked=asked):", "def score_many(removals, o=\"ppl\", asked=asked):", ["tests/test_select.py::test_each_cell_is_its_search_by_hand_and_the_grid_resumes"]),
 ("g probes' shots from another rung", "depthcurse/tasks/probes.py", "shots = [probe.make(rng) for _ in range(SHOTS)]", "shots = [PROBES['probe_add_1d'].make(rng) for _ in range(SHOTS)]", ["tests/test_probes.py"]),
 ("h massive activation median over the wrong axis", "depthcurse/angular/capture.py", "stats[\"median\"][k] = x.abs().median().double()", "stats[\"median\"][k] = x.abs().median(-1).values.median().double()", ["tests/test_identity.py"]),
 ("i objective() returning a non-module passes", "depthcurse/heal/method.py", "if hook == \"objective\" and out is not None and not isinstance(out, nn.Module):", "if False:", ["tests/test_method_contract.py"]),
 ("j a context hook yielding another object passes", "depthcurse/heal/method.py", "if got is not self.model:", "if False:", ["tests/test_method_contract.py"]),
 ("k the healed model's retained against the pruned", "depthcurse/heal/shares.py", "retained(results[name], results[\"unpruned\"] if name != \"unpruned\" else None)", "retained(results[name], results[\"pruned\" if name == \"healed\" else \"unpruned\"] if name != \"unpruned\" else None)", ["tests/test_heal.py"]),
 ("l the noise of a loss gap without its 1/sqrt(n)", "depthcurse/heal/shares.py", "        if math.isfinite(spread.se):\n            return spread", "        if math.isfinite(spread.se):\n            return Spread(spread.se * math.sqrt(len(groups['pruned'][0])), spread.df)", ["tests/test_heal.py"]),
]
only = sys.argv[1:]
missed = 0
for name, path, old, new, tests in PLANTS:
    if only and name[0] not in only:
        continue
    p = ROOT / path
    text = p.read_text()
    assert text.count(old) == 1, (name, text.count(old))
    p.write_text(text.replace(old, new))
    try:
        r = subprocess.run([str(ROOT / ".venv/bin/python"), "-m", "pytest", "-q", "-x", "-p", "no:xdist", "-p", "no:cacheprovider", *tests], cwd=ROOT, capture_output=True, text=True)
        last = [l for l in r.stdout.splitlines() if l.strip()][-1]
        print(f"{'CAUGHT' if r.returncode else 'MISSED'}  {name}: {last}", flush=True)
        missed += not r.returncode
    finally:
        p.write_text(text)
sys.exit(1 if missed else 0)
