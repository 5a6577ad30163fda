"""`forecast`: what long work will take, from its own first step, on a clock the test holds."""

from __future__ import annotations

import itertools

import pytest

from depthcurse.forecast import Forecast, duration, following, shown, took_up


@pytest.mark.statistics
def test_a_forecast_is_the_first_steps_time_times_the_steps_to_run_said_once_with_the_budget_it_passes():
    """On a clock the test holds: 4 steps, the first 2 s: about 8 s, said once, and over a 5 s budget
    with how to shrink it; a resumed run (from step 2) forecasts its 2 steps left; one step says
    nothing; the summary keeps the forecast beside the time taken. depth-use says each part's
    forecast before the rest of it runs, and keeps them in its record (issue 81)."""
    said = []
    clock = iter([0.0, 2.0, 4.5, 9.0]).__next__  # start, the first step, the second (within the forecast: nothing more said), the summary
    f = Forecast("the steps", say=said.append, clock=clock, budget_seconds=5, shrink="fewer steps")
    steps = f.over("abcd")
    next(steps), next(steps), next(steps)  # two steps done: the first said the forecast
    assert said == ["the steps: 4 steps to run, the first took 2.00 s here: about 8 seconds in all, over the budget of 5 seconds: fewer steps"]
    assert f.summary() == {"steps": 4, "forecast_seconds": 8.0, "seconds": 9.0, "revisions": []}
    said.clear()
    resumed = Forecast("the steps", say=said.append, clock=iter([0.0, 3.0, 6.0]).__next__)
    assert list(resumed.over("abcd", 2, kept_in="here")) == [(2, "c"), (3, "d")]
    assert said == ["the steps: took up the 2 of 4 finished before (kept in here), not run again",
                    "the steps: 2 steps to run, the first took 3.00 s here: about 6 seconds in all"]
    said.clear()
    one = Forecast("one", say=said.append, clock=iter([0.0, 1.0]).__next__)
    assert list(one.over([7])) == [(0, 7)] and said == [] and one.estimate == 1.0 and one.steps == 1
    assert Forecast("none").summary() == {"steps": None, "forecast_seconds": None, "seconds": None, "revisions": []}
    assert took_up("the rows", 3, 5) == "the rows: took up the 3 of 5 finished before, not run again"


@pytest.mark.statistics
def test_a_forecast_follows_the_work_and_says_a_moved_one_with_its_range():
    """5 steps on a held clock: the first 1 s (5 s said); the second 10 s: the median of the two (5.5 s)
    times the 3 left, after 11 s, is 27.5 s in all, past 1.5 times the 5 said: said again, with the
    range of the quickest and slowest step; the third (10 s) and fourth (1 s) keep it within 1.5 times
    27.5: nothing more said (issue 90: a forecast that follows a machine whose load moves)."""
    said = []
    f = Forecast("the rows", say=said.append, clock=iter([0.0, 1.0, 11.0, 21.0, 22.0, 23.0, 24.0]).__next__)
    assert [i for i, _ in f.over(range(5))] == [0, 1, 2, 3, 4]
    assert said == ["the rows: 5 steps to run, the first took 1.00 s here: about 5 seconds in all",
                    "the rows: 2 steps took 11 seconds; about 16 seconds left (3 seconds to 30 seconds at the quickest and slowest step so far): "
                    "the forecast moved from 5 seconds to 28 seconds in all"]
    assert f.summary() == {"steps": 5, "forecast_seconds": 5.0, "seconds": 24.0, "revisions": [{"after_steps": 2, "forecast_seconds": 27.5}]}
    quicker = []  # a forecast that moves down is said too: 10 s, then 1 s steps
    g = Forecast("the rows", say=quicker.append, clock=iter([0.0, 10.0, 11.0, 12.0, 13.0]).__next__)
    list(g.over(range(4)))
    assert [r["after_steps"] for r in g.revisions] == [2, 3] and quicker[-1].endswith("moved from 22 seconds to 13 seconds in all")


@pytest.mark.statistics
def test_the_running_estimate_is_the_median_step_times_the_steps_left_with_the_quickest_and_slowest():
    """While `shown`, each step ends with the running estimate: 5 steps of 1, 3 and 8 s on a held clock:
    after the first, 4 x 1 s; after the second, the median 2 s x 3 left, 3 to 9; after the third, the
    median 3 s x 2 left (the mean would give 8 s), 2 to 16; after the last, nothing left. Outside
    `shown` nothing is shown (issue 90: a forecast in the progress line that follows the work)."""
    lines = []
    f = Forecast("the rows", clock=iter([0.0, 1.0, 4.0, 12.0, 13.0, 14.0]).__next__)
    with shown(lines.append):
        list(f.over(range(5)))
    assert lines == ["about 4 seconds left (from the first step)", "about 6 seconds left (3 seconds to 9 seconds)",
                     "about 6 seconds left (2 seconds to 16 seconds)", "about 2 seconds left (1 seconds to 8 seconds)", ""]
    g = Forecast("the rows", clock=iter([0.0, 1.0, 2.0]).__next__)
    list(g.over(range(2)))
    assert len(lines) == 5 and g.left(1) == "" and g.left(0) == "about 1 seconds left (1 seconds to 1 seconds)"  # outside `shown`: nothing shown


def test_a_progress_line_shows_the_forecast_of_the_work_under_way(capsys):
    """The bar every command shows (off a terminal: a line per step) carries the running estimate of the
    innermost unfinished task, which `showing` wires to every forecast made inside it."""
    from depthcurse.cli.shared import ForecastColumn, LineProgress, progress_bar, show_forecast, showing

    progress = progress_bar()
    assert isinstance(progress, LineProgress) and any(isinstance(c, ForecastColumn) for c in progress.columns)
    outer = progress.add_task("methods", total=2)
    inner = progress.add_task("batches", total=3)
    with showing(progress):
        for _ in Forecast("the batches", clock=iter([0.0, 2.0, 4.0, 6.0]).__next__).over(range(3)):
            progress.advance(inner)
    err = capsys.readouterr().err
    assert "batches: 1/3 (0:00 elapsed)\nbatches: 3/3 (0:00 elapsed)\n" in err  # the first step's line before its forecast; the last without one
    assert ForecastColumn().render(progress.tasks[inner]).plain == "0:00:00" and "forecast" not in progress.tasks[outer].fields
    rows = progress.add_task("rows", total=3, completed=1)
    show_forecast(progress, "about 4 seconds left (from the first step)")  # the newest bar under way takes the estimate
    show_forecast(progress, "")  # a forecast that ended leaves the bars as they are
    progress.advance(rows)
    assert progress.tasks[rows].fields["forecast"] == "about 4 seconds left (from the first step)" and "forecast" not in progress.tasks[outer].fields
    assert capsys.readouterr().err == "rows: 1/3 (0:00 elapsed, about 4 seconds left (from the first step))\n"  # the next line within 5 s: not said
    assert ForecastColumn().render(progress.tasks[rows]).plain == "about 4 seconds left (from the first step)"
    assert ForecastColumn().render(progress.tasks[outer]).plain == "-:--:--"  # no forecast: rich's own estimate (none yet)


@pytest.mark.statistics
def test_a_progress_callback_forecasts_from_the_first_step_it_hears_and_durations_at_each_units_edge():
    """prune reports (done, total) before each step: the first call starts the clock, the call that
    says one more is done forecasts the rest (a resumed sweep's first report may start past 0)."""
    said = []
    heard = following("the variants", said.append, clock=iter([10.0, 13.0, 16.5]).__next__)
    heard(2, 6)  # resumed: 2 done before, 4 to run
    heard(2, 6)  # the same report again: nothing
    forecast = heard(3, 6)
    assert said == ["the variants: 4 steps to run, the first took 3.00 s here: about 12 seconds in all"] and forecast.estimate == 12.0
    heard(4, 6)  # the second step 3.5 s: 13 s in all by the median, within 1.5 times 12: nothing more said
    assert len(said) == 1 and forecast.revisions == []
    assert [duration(s) for s in (89, 90, 5399, 5400, 5580)] == ["89 seconds", "2 minutes", "90 minutes", "1.5 hours", "1.6 hours"]


@pytest.mark.statistics
def test_a_forecast_on_the_budget_is_within_it_and_keeps_three_decimals():
    said = []
    f = Forecast("x", say=said.append, clock=iter([10.0, 12.12345, 19.87654]).__next__, budget_seconds=(12.12345 - 10.0) * 3)
    steps = f.over(range(3))
    next(steps), next(steps)  # the first step's end is when the loop asks for the second
    assert said == ["x: 3 steps to run, the first took 2.12 s here: about 6 seconds in all"]  # at the budget, not over: no shrink said
    assert f.summary() == {"steps": 3, "forecast_seconds": 6.37, "seconds": 9.877, "revisions": []}
    said.clear()
    over = Forecast("y", say=said.append, clock=iter([0.0, 5.0]).__next__, budget_seconds=4)
    steps = over.over(range(2))
    next(steps), next(steps)
    assert said == ["y: 2 steps to run, the first took 5.00 s here: about 10 seconds in all, over the budget of 4 seconds"]  # nothing to shrink by


# ---------------------------------------------------------------- every long command's forecast against its loop


@pytest.mark.instruments
@pytest.mark.usefixtures("one_torch_thread")  # mutmut forks the process that ran it: a forked thread pool is a deadlock
@pytest.mark.parametrize("steps", [1, 2, 3])
def test_each_long_commands_forecast_counts_the_steps_its_loop_runs(steps, bos_model_dir, docs_file, tmp_path):
    """The tuned lens's steps, depth-use's batches, depth-map's rows, heal's training steps and
    speculate's prompts, each run at 1, 2 and 3 steps: the steps its loop ran (heard by `on_step`, or
    `on_progress`) are the steps its forecast kept, and the line said names them where more than
    one is left (issue 88: a forecast one row or one step short passed every test)."""
    import torch
    from helpers import heal_config, tiny_llama

    from depthcurse.depth.depth_map import depth_map
    from depthcurse.depth.measure import measure_depth_use, stepper_of
    from depthcurse.depth.tuned_lens import LensSettings, train_tuned_lens
    from depthcurse.heal import heal
    from depthcurse.loading import load_model
    from depthcurse.speculate import SpeculateConfig, run_speculate

    def counted(label):
        ran, said = [], []
        return ran, said, (lambda text, done, total: ran.append(done) if text.startswith(label) else None)

    def agree(forecast, ran, said, what):
        assert forecast.steps == len(ran) == steps, (what, forecast.steps, ran)
        assert [line.split(", the first")[0] for line in said] == ([] if steps == 1 else [f"{forecast.what}: {steps} steps to run"]), (what, said)

    model = tiny_llama(300, layers=steps, seed=1).eval()
    ids = torch.randint(3, 300, (2 * steps, 8), generator=torch.Generator().manual_seed(0))
    ran, said, on_step = counted("training the tuned lens")
    from depthcurse.forecast import Forecast

    steady = lambda: itertools.count(0.0, 1.0).__next__  # noqa: E731  every step 1 s on the test's clock: no revision for a loaded machine to say
    lens_forecast = Forecast("the tuned lens's steps", say=said.append, clock=steady())
    train_tuned_lens(model, stepper_of(model), ids, LensSettings(steps=steps, tokens_per_step=8, micro_batch=1), on_step=on_step, forecast=lens_forecast)
    agree(lens_forecast, ran, said, "the lens")
    ran, said, on_step = counted("the whole model's pass")
    batches = Forecast("the measurement's batches of windows", say=said.append, clock=steady())
    measure_depth_use(model, ids, batch_size=2, influence=False, on_step=on_step, forecast=batches)
    agree(batches, ran, said, "depth-use's batches")
    ran, said, on_step = counted("maps from shallow layer")
    record = depth_map(model, tiny_llama(300, layers=2, seed=2).eval(), ids, ids[:2], batch_size=2, on_step=on_step, on_note=said.append)
    assert record["forecast"]["steps"] == len(ran) == steps and len([s for s in said if "steps to run" in s]) == (steps > 1)

    said, progress = [], []
    cfg = heal_config(layers=(1,), method="lora", data=str(docs_file), steps=steps, batch_size=2, seq_len=16, eval_windows=2, lora_rank=2)
    record = heal(load_model(str(bos_model_dir)), cfg, tmp_path / "heal", on_progress=progress.append, on_note=said.append)
    assert record["training"]["forecast"]["steps"] == len(progress) == steps
    assert len([s for s in said if s.startswith("the training steps: ") and "steps to run" in s]) == (steps > 1)

    loaded = load_model(str(bos_model_dir))
    (tmp_path / "prompts.txt").write_text("\n\n".join(f"the {i} quick brown fox" for i in range(steps)) + "\n")
    ran, said = [], []
    cfg = SpeculateConfig(skip=(1,), prompts=str(tmp_path / "prompts.txt"), max_new_tokens=3, baselines=()).checked()
    record = run_speculate(loaded, cfg, tmp_path / "spec", on_step=lambda text, done, total: ran.append(done), on_note=said.append)
    assert record["forecast"]["steps"] == len(ran) == steps and len([s for s in said if "steps to run" in s]) == (steps > 1)


@pytest.mark.instruments
@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("method", ["linear", "linear-cosine", "linearpatch"])
def test_every_heal_phase_says_its_steps_and_forecast_and_a_rerun_what_it_took_up(method, bos_model_dir, docs_file, tmp_path):
    """heal speaks in every phase: the method's own loop (the linear maps' calibration batches, the
    cosine map's epochs, the patch's batches) in the phase line with its count and a forecast after its
    first step, then the three models' measurements, one plan counted by the loop that measures them;
    the record keeps each forecast. Stopped after the unpruned model was measured, the rerun says it
    took that up and forecasts the two left (issue 90: heal's first minutes said nothing but its name)."""
    from helpers import heal_config

    from depthcurse.heal import heal
    from depthcurse.heal import loop as heal_loop
    from depthcurse.loading import load_model

    phases, said = [], []
    cfg = heal_config(layers=(1,), method=method, data=str(docs_file), steps=1, batch_size=2, micro_batch=1, seq_len=16, eval_windows=2,
                      calib_tokens=48, method_args={"epochs": 3})
    record = heal(load_model(str(bos_model_dir)), cfg, tmp_path / "a", on_phase=phases.append, on_note=said.append)
    own = {"linear": "the linear maps' calibration batches", "linear-cosine": "the cosine map's epochs",
           "linearpatch": "the patch after layer 1: calibration batches"}[method]
    counted = [p for p in phases if p.startswith(own + " (")]
    total = int(counted[-1].split("/")[-1].rstrip(")"))
    assert total >= 3 and counted[-1] == f"{own} ({total}/{total})", phases
    assert [p for p in phases if p.startswith("measuring")] == ["measuring the unpruned model (1 of 3)", "measuring the pruned model (2 of 3)",
                                                                 "measuring the healed model, the saved checkpoint (3 of 3)"]
    assert any(line.startswith(f"{own}: ") and "steps to run" in line for line in said), said
    assert any(line.startswith("the models' measurements (unpruned, pruned, healed): 3 steps to run") for line in said), said
    assert record["forecasts"]["the models' measurements"]["steps"] == 3 and record["forecasts"][own]["steps"] >= 2

    measured = []
    real = heal_loop.measure

    def stop_after_one(*args, **kwargs):
        if measured:
            raise KeyboardInterrupt
        measured.append(True)
        return real(*args, **kwargs)

    heal_loop.measure = stop_after_one
    try:
        with pytest.raises(KeyboardInterrupt):
            heal(load_model(str(bos_model_dir)), cfg, tmp_path / "b")
    finally:
        heal_loop.measure = real
    from depthcurse.heal import kept_summary

    assert kept_summary(tmp_path / "b") == f"the method's fitted state (method.pt), no training step, the unpruned model measured kept in {tmp_path / 'b'}"
    said.clear()
    again = heal(load_model(str(bos_model_dir)), cfg, tmp_path / "b", on_note=said.append)
    assert f"the models' measurements (unpruned, pruned, healed): took up the 1 of 3 finished before (kept in {tmp_path / 'b' / 'heal.json'}), not run again" in said
    assert again["forecasts"]["the models' measurements"]["steps"] == 3 and own not in again["forecasts"]  # the method's fit was read back, not made
    assert again["results"]["unpruned"]["held_out"] == record["results"]["unpruned"]["held_out"]
