"""The single-point bugs the audits planted, one at a time: issue 64's twelve in the statistics and
the probes (a-l), issue 72's nine where the searches and merges branch (m-u), and issue 88's in what
issues 79-82 added (88a-88z: kept state, forecasts, tables and verdicts, estimates, options, continuations, words). Each must make a
test fail (CAUGHT), or the tests have gone blind to it; a hang fails too, by the loop's bound or the
suite's per-test time limit.

    python benchmarks/project/planted_bugs.py            # all of them, about 6 minutes on 2 cores
    python benchmarks/project/planted_bugs.py a c k 88d  # some, by their name's first word

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
 ("88a depth-use's kept batches without the definitions", "depthcurse/depth/measure.py", "identity = call_identity(measure_depth_use, locals())", "identity = call_identity(measure_depth_use, locals(), leave_out={'definitions'})", ["tests/test_kept_state.py::test_each_depth_instrument_keeps_its_whole_calls_identity_and_a_rerun_of_another_takes_nothing_up"]),
 ("88b the lens's kept state without its windows", "depthcurse/depth/tuned_lens.py", 'leave_out={"stepper"})', 'leave_out={"stepper", "windows"})', ["tests/test_kept_state.py::test_each_depth_instrument_keeps_its_whole_calls_identity_and_a_rerun_of_another_takes_nothing_up"]),
 ("88c depth-map's kept rows without the map's settings", "depthcurse/depth/depth_map.py", "identity = call_identity(depth_map, locals())", "identity = call_identity(depth_map, {**locals(), 'settings': MapSettings()})", ["tests/test_kept_state.py::test_each_depth_instrument_keeps_its_whole_calls_identity_and_a_rerun_of_another_takes_nothing_up"]),
 ("88d a resumed lens restarts its round of windows", "depthcurse/depth/tuned_lens.py", 'first, order, last, before = kept["step"], kept["order"], kept["last"], kept["seconds"]', 'first, order, last, before = kept["step"], [], kept["last"], kept["seconds"]', ["tests/test_depth_use.py::test_an_interrupted_lens_measurement_and_map_resume_to_an_uninterrupted_runs_figures"]),
 ("88e a resumed lens's seconds without the time before the interruption", "depthcurse/depth/tuned_lens.py", '"seconds": round(before + clock() - started, 3)}', '"seconds": round(clock() - started, 3)}', ["tests/test_depth_use.py::test_an_interrupted_lens_measurement_and_map_resume_to_an_uninterrupted_runs_figures"]),
 ("88f a lens without the embedding's translator cannot be read back", "depthcurse/depth/tuned_lens.py", 'embedding=any(k.startswith("0.") for k in state)', "embedding=True", ["tests/test_depth_use.py::test_a_lens_file_reads_back_and_one_from_another_model_is_one_line"]),
 ("88g a forecast one step short of its plan", "depthcurse/forecast.py", "self.planned(len(plan))", "self.planned(len(plan) - 1)", ["tests/test_forecast.py"]),
 ("88h heal's training one step short of its plan", "depthcurse/heal/loop.py", ".over(range(end), progress.step", ".over(range(end - 1), progress.step", ["tests/test_forecast.py::test_each_long_commands_forecast_counts_the_steps_its_loop_runs"]),
 ("88i the same relative depth read one layer on", "depthcurse/depth/map_report.py", "- (0 if entering else 1))", "- (0 if entering else 0))", ["tests/test_depth_use.py"]),
 ("88j the dominance verdict inverted", "depthcurse/depth/map_report.py", "dominated = [i for i, s in enumerate(shares) if s >= at]", "dominated = [i for i, s in enumerate(shares) if s < at]", ["tests/test_depth_use.py"]),
 ("88k the deep model's last layer read from the shallow row", "depthcurse/depth/map_report.py", "pick(row[-1] for row in matrix)", "pick(matrix[-1])", ["tests/test_depth_use.py"]),
 ("88l their stream after a layer named one layer on", "depthcurse/depth/map_report.py", 'else f"after {index - 1}"', 'else f"after {index}"', ["tests/test_depth_use.py"]),
 ("88m the memory estimate without the lens's training", "depthcurse/depth/report.py", "lens_settings.micro_batch if tuned else 0)", "0)", ["tests/test_depth_use.py::test_depth_use_says_its_memory_estimate_and_counts_the_lens_training_in_it"]),
 ("88n the refusal never names a batch of 1", "depthcurse/depth/memory.py", "for b in range(batch - 1, 0, -1)", "for b in range(batch - 1, 1, -1)", ["tests/test_depth_use.py::test_the_memory_estimate_by_hand_and_a_run_that_would_not_fit_is_one_line_naming_the_batch_that_does"]),
 ("88o the lens's refusal says any micro-batch after trying one", "depthcurse/depth/memory.py", "{lens_micro_batch} windows a micro-batch, does not fit", "at any micro-batch, does not fit", ["tests/test_depth_use.py::test_the_memory_estimate_by_hand_and_a_run_that_would_not_fit_is_one_line_naming_the_batch_that_does"]),
 ("88p --draft-tokens equal to --max-new-tokens neither capped nor said", "depthcurse/speculate/run.py", "if self.draft_tokens > self.max_new_tokens - 1:", "if self.draft_tokens > self.max_new_tokens:", ["tests/test_speculate.py::test_the_draft_length_is_capped_where_it_meets_the_new_tokens_and_said_only_to_who_gave_it"]),
 ("88q --skip-from a run of another revision accepted", "depthcurse/select/picks.py", 'theirs = (run.get("source", run.get("model")), run.get("revision"))', 'theirs = (run.get("source", run.get("model")), described.get("revision"))', ["tests/test_speculate.py::test_a_draft_length_past_what_a_round_can_use_is_capped_and_said_and_another_models_pick_is_refused"]),
 ("88r --also-skip-from another model's pick accepted", "depthcurse/cli/speculate.py", 'read = [checked_pick(pick, loaded.describe(), n, "--also-skip-from") for pick in read]', "read = [tuple(pick[0]) for pick in read]", ["tests/test_speculate.py::test_a_draft_length_past_what_a_round_can_use_is_capped_and_said_and_another_models_pick_is_refused"]),
 ("88s a draft twice in --also-skip measured twice", "depthcurse/speculate/run.py", "or list(self.also).count(other) > 1:", "or False:", ["tests/test_speculate.py::test_other_self_drafts_run_on_the_same_prompts_and_are_set_against_the_first"]),
 ("88t an older option name's value dropped", "depthcurse/cli/shared.py", '    say("note", renamed_note(old, new))\n    return old_value', '    say("note", renamed_note(old, new))\n    return default', ["tests/test_cli.py::test_an_old_option_name_still_works_and_says_the_new_one"]),
 ("88u the old heal --data alone refused", "depthcurse/cli/heal.py", 'data = renamed("heal", "--data", data, calibration, "auto")', 'data = renamed("heal", "--data", data, calibration or "auto", "auto")', ["tests/test_cli.py"]),
 ("88v old and new names together taken where the new is at its default", "depthcurse/cli/shared.py", "    if new_value is not None:\n        raise", "    if new_value is not None and new_value != default:\n        raise", ["tests/test_cli.py::test_a_renamed_options_value_is_the_old_names_the_new_names_or_the_default_and_both_are_one_line"]),
 ("88w a default draft length said capped to who never gave one", "depthcurse/cli/speculate.py", "capped = cfg.capped(draft_tokens) if draft_tokens is not None else None", "capped = cfg.capped(draft_tokens or SpeculateConfig.draft_tokens)", ["tests/test_speculate.py::test_the_draft_length_is_capped_where_it_meets_the_new_tokens_and_said_only_to_who_gave_it"]),
 ("88x select's unpruned loss over every prediction of a continuation", "depthcurse/select/scoring.py", "masked_means(window_scores(logp, ids.cpu(), None)[0], mask)))", "masked_means(window_scores(logp, ids.cpu(), None)[0], None)))", ["tests/test_continuations.py"]),
 ("88y the continuations' pool without spares", "depthcurse/select/continuations.py", "return suite(2 * -(-wanted // len(KINDS)))", "return suite(-(-wanted // len(KINDS)))", ["tests/test_continuations.py"]),
 ("88z a break-even cell beside timings not trusted", "depthcurse/speculate/report.py", "if trusted else \"not said: timings not trusted\",", "if True else \"not said: timings not trusted\",", ["tests/test_speculate.py::test_timings_on_an_unsteady_machine_are_said_untrusted_and_the_verdicts_speak_of_acceptance_alone"]),
]
only = sys.argv[1:]
missed = 0
for name, path, old, new, tests in PLANTS:
    if only and name.split()[0] not in only:
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
