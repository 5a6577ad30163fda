"""`forecast`: what long work will take, from its own first step, on a clock the test holds."""

from __future__ import annotations

import pytest

from depthcurse.forecast import Forecast, duration, following


@pytest.mark.statistics
def test_a_forecast_is_the_first_steps_time_times_the_steps_to_run_said_once_with_the_budget_it_passes():
    """On a clock the test holds: 4 steps, the first 2 s: about 8 s, said once, and over a 5 s budget
    with how to shrink it; a resumed run (from step 2) forecasts its 2 steps left; one step says
    nothing; the summary keeps the forecast beside the time taken. depth-use says each part's
    forecast before the rest of it runs, and keeps them in its record (issue 81)."""
    said = []
    clock = iter([0.0, 2.0, 9.0]).__next__  # start, the first step, the summary: the second step reads no clock
    f = Forecast("the steps", 4, say=said.append, clock=clock, budget_seconds=5, shrink="fewer steps").start()
    f.step_done(0)
    f.step_done(1)
    assert said == ["the steps: 4 steps to run, the first took 2.00 s here: about 8 seconds in all, over the budget of 5 seconds: fewer steps"]
    assert f.summary() == {"steps": 4, "forecast_seconds": 8.0, "seconds": 9.0}
    said.clear()
    resumed = Forecast("the steps", 4, say=said.append, clock=iter([0.0, 3.0]).__next__).start()
    resumed.step_done(2)
    assert said == ["the steps: 2 steps to run, the first took 3.00 s here: about 6 seconds in all"]
    one = Forecast("one", 1, say=said.append, clock=iter([0.0, 1.0]).__next__).start()
    one.step_done(0)
    assert len(said) == 1 and one.estimate == 1.0
    assert Forecast("none", 3).summary() == {"steps": 3, "forecast_seconds": None, "seconds": None}


@pytest.mark.statistics
def test_a_progress_callback_forecasts_from_the_first_step_it_hears_and_durations_at_each_units_edge():
    """prune reports (done, total) before each step: the first call starts the clock, the call that
    says one more is done forecasts the rest (a resumed sweep's first report may start past 0)."""
    said = []
    heard = following("the variants", said.append, clock=iter([10.0, 13.0]).__next__)
    heard(2, 6)  # resumed: 2 done before, 4 to run
    heard(2, 6)  # the same report again: nothing
    forecast = heard(3, 6)
    assert said == ["the variants: 4 steps to run, the first took 3.00 s here: about 12 seconds in all"] and forecast.estimate == 12.0
    heard(4, 6)
    assert len(said) == 1
    assert [duration(s) for s in (89, 90, 5399, 5400, 5580)] == ["89 seconds", "2 minutes", "90 minutes", "1.5 hours", "1.6 hours"]


@pytest.mark.statistics
def test_a_forecast_on_the_budget_is_within_it_and_keeps_three_decimals():
    said = []
    f = Forecast("x", 3, say=said.append, clock=iter([10.0, 12.12345, 19.87654]).__next__, budget_seconds=(12.12345 - 10.0) * 3).start()
    f.step_done(0)
    assert said == ["x: 3 steps to run, the first took 2.12 s here: about 6 seconds in all"]  # at the budget, not over: no shrink said
    assert f.summary() == {"steps": 3, "forecast_seconds": 6.37, "seconds": 9.877}
    said.clear()
    over = Forecast("y", 2, say=said.append, clock=iter([0.0, 5.0]).__next__, budget_seconds=4).start()
    over.step_done(0)
    assert said == ["y: 2 steps to run, the first took 5.00 s here: about 10 seconds in all, over the budget of 4 seconds"]  # nothing to shrink by
