"""The single-point bugs the audits planted, one at a time: issue 64's twelve in the statistics and
the probes (a-l), and issue 72's nine where the searches and merges branch (m-u). Each must make a
test fail (CAUGHT), or the tests have gone blind to it; a hang fails too, by the loop's bound or the
suite's per-test time limit.

    python benchmarks/project/planted_bugs.py            # all of them, about 6 minutes on 2 cores
    python benchmarks/project/planted_bugs.py a c k      # some, by their letter

Each plant is one textual replacement in one file, put back whatever happens; the tests named
beside it run against it. `make mutate` is the broader habit (every mutant of the statistics core);
this keeps the bugs a reader of the issue would think of first.
"""

import subprocess, sys, pathlib
ROOT = pathlib.Path(__file__).resolve().parents[2]
PLANTS = [
 ("a overlap pairs a cell with itself", "depthcurse/select/statistics.py", "for b in names[i + 1:]:", "for b in names[i:]:", ["tests/test_statistics.py", "tests/test_reported_numbers.py"]),
 ("b held-out windows overlap calibration", "depthcurse/select/windows.py", "windows[order[cfg.calib_windows:want]]", "windows[order[cfg.calib_windows - 1:want - 1]]", ["tests/test_select.py::test_held_out_windows_are_never_calibration_windows"]),
 ("c bootstrap not paired across cells", "depthcurse/select/statistics.py", "drawn = resample(lambda picks: shares(table[..., picks].mean(-1))", "drawn = resample(lambda picks: shares(np.stack([table[i][..., np.roll(picks, i, axis=0)].mean(-1) for i in range(len(table))]))", ["tests/test_statistics.py", "tests/test_reported_numbers.py"]),
 ("d decided by with overlapping intervals", "depthcurse/stats/decomposition.py", "if row[0] > column[1]:", "if row[1] > column[1]:", ["tests/test_statistics.py"]),
 ("e calibration SS weighted by the wrong count", "depthcurse/stats/decomposition.py", "ss_rows = c * ", "ss_rows = r * ", ["tests/test_statistics.py"]),
 ("f greedy ranks by ppl in a KL cell", "depthcurse/select/grid.py", "else [d[objective] for d in scorer.score_many(removals)]", "else [d[\"ppl\"] for d in scorer.score_many(removals)]", ["tests/test_select.py::test_each_cell_is_its_search_by_hand_and_the_grid_resumes"]),
 ("g probes' shots from another rung", "depthcurse/tasks/probes.py", "shots = [probe.make(rng) for _ in range(SHOTS)]", "shots = [PROBES['probe_add_1d'].make(rng) for _ in range(SHOTS)]", ["tests/test_probes.py"]),
 ("h massive activation median over the wrong axis", "depthcurse/angular/capture.py", "stats[\"median\"][k] = x.abs().median().double()", "stats[\"median\"][k] = x.abs().median(-1).values.median().double()", ["tests/test_identity.py"]),
 ("i objective() returning a non-module passes", "depthcurse/heal/method.py", "if hook == \"objective\" and out is not None and not isinstance(out, nn.Module):", "if False:", ["tests/test_method_contract.py"]),
 ("j a context hook yielding another object passes", "depthcurse/heal/method.py", "if got is not self.model:", "if False:", ["tests/test_method_contract.py"]),
 ("k the healed model's retained against the pruned", "depthcurse/heal/shares.py", "retained(results[name], results[\"unpruned\"] if name != \"unpruned\" else None)", "retained(results[name], results[\"pruned\" if name == \"healed\" else \"unpruned\"] if name != \"unpruned\" else None)", ["tests/test_heal.py"]),
 ("l the noise of a loss gap without its 1/sqrt(n)", "depthcurse/heal/shares.py", "        if math.isfinite(spread.se):\n            return spread", "        if math.isfinite(spread.se):\n            return Spread(spread.se * math.sqrt(len(groups['pruned'][0])), spread.df)", ["tests/test_heal.py"]),
 ("m a context hook yielding a copy of the model passes", "depthcurse/heal/method.py", "if got is not self.model:", "if got is None:", ["tests/test_method_contract.py"]),
 ("n evo's generations rounded, not cut as awk's int()", "depthcurse/select/searches/evo.py", "return int(k * (n - k) / 1.5)", "return round(k * (n - k) / 1.5)", ["tests/test_search.py::test_evo_keeps_evopress_defaults_and_scales_its_stages_to_the_calibration_text"]),
 ("o evo.seed ignored", "depthcurse/select/searches/evo.py", "rng = random.Random(ctx.seed if s.seed is None else s.seed)", "rng = random.Random(ctx.seed)", ["tests/test_search.py::test_a_searchs_own_seed_setting_is_the_seed_its_draws_follow"]),
 ("p random.seed ignored", "depthcurse/select/searches/random_sets.py", "rng = random.Random(f\"random:{ctx.seed if self.settings.seed is None else self.settings.seed}\")", "rng = random.Random(f\"random:{ctx.seed}\")", ["tests/test_search.py::test_a_searchs_own_seed_setting_is_the_seed_its_draws_follow"]),
 ("q evo's cut last window one token too many", "depthcurse/select/searches/evo.py", "last = num_tokens - used", "last = num_tokens - used + 1", ["tests/test_search.py::test_evo_with_a_population_of_two_and_a_cut_last_window_makes_evopress_candidates"]),
 ("r random sub-blocks: the MLP branches of the attention's blocks", "depthcurse/select/searches/random_sets.py", "removal = canonical([f\"a{i}\" for i in rng.sample(range(space.n), space.k)] + [f\"m{i}\" for i in rng.sample(range(space.n), space.k)],", "removal = canonical([f\"{t}{i}\" for i in rng.sample(range(space.n), space.k) for t in \"am\"],", ["tests/test_search.py::test_random_sub_block_draws_choose_the_attention_and_mlp_branches_apart"]),
 ("s laco steps by interval and by 1 swapped", "depthcurse/select/searches/laco.py", "            lay -= s.interval  # the notebook", "            lay -= 1 if s.interval != 1 else s.interval  # the notebook", ["tests/test_merging.py::test_lacos_procedure_steps_by_its_interval_after_a_kept_merge_and_by_one_after_a_refused_one"]),
 ("t evo's children copied from the best parent", "depthcurse/select/searches/evo.py", "child = copy.deepcopy(rng.choice(population))", "child = copy.deepcopy(population[0 * len([rng.choice(population)])])", ["tests/test_search.py::test_evo_with_a_population_of_two_and_a_cut_last_window_makes_evopress_candidates"]),
 ("u swm merges the window with the layer whose step failed (it looped forever)", "depthcurse/select/searches/swm.py", "state = state.merge(blocks, low + 1, high, rule, s.biases)", "state = state.merge(blocks, low, high, rule, s.biases)", ["tests/test_merging.py::test_swms_procedure_is_the_scripts_loop"]),
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
