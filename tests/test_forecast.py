"""`forecast`: what long work will take, from its own first step, on a clock the test holds."""

from __future__ import annotations

import pytest

from depthcurse.forecast import Forecast, duration, following, took_up


@pytest.mark.statistics
def test_a_forecast_is_the_first_steps_time_times_the_steps_to_run_said_once_with_the_budget_it_passes():
    """On a clock the test holds: 4 steps, the first 2 s: about 8 s, said once, and over a 5 s budget
    with how to shrink it; a resumed run (from step 2) forecasts its 2 steps left; one step says
    nothing; the summary keeps the forecast beside the time taken. depth-use says each part's
    forecast before the rest of it runs, and keeps them in its record (issue 81)."""
    said = []
    clock = iter([0.0, 2.0, 9.0]).__next__  # start, the first step, the summary: the second step reads no clock
    f = Forecast("the steps", say=said.append, clock=clock, budget_seconds=5, shrink="fewer steps")
    assert [i for i, _ in zip(range(2), f.over("abcd"))] == [0, 1]  # two steps done: the first said the forecast
    assert said == ["the steps: 4 steps to run, the first took 2.00 s here: about 8 seconds in all, over the budget of 5 seconds: fewer steps"]
    assert f.summary() == {"steps": 4, "forecast_seconds": 8.0, "seconds": 9.0}
    said.clear()
    resumed = Forecast("the steps", say=said.append, clock=iter([0.0, 3.0, 4.0]).__next__)
    assert list(resumed.over("abcd", 2, kept_in="here")) == [(2, "c"), (3, "d")]
    assert said == ["the steps: took up the 2 of 4 finished before (kept in here), not run again",
                    "the steps: 2 steps to run, the first took 3.00 s here: about 6 seconds in all"]
    said.clear()
    one = Forecast("one", say=said.append, clock=iter([0.0, 1.0]).__next__)
    assert list(one.over([7])) == [(0, 7)] and said == [] and one.estimate == 1.0 and one.steps == 1
    assert Forecast("none").summary() == {"steps": None, "forecast_seconds": None, "seconds": None}
    assert took_up("the rows", 3, 5) == "the rows: took up the 3 of 5 finished before, not run again"


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
    f = Forecast("x", say=said.append, clock=iter([10.0, 12.12345, 19.87654]).__next__, budget_seconds=(12.12345 - 10.0) * 3)
    steps = f.over(range(3))
    next(steps), next(steps)  # the first step's end is when the loop asks for the second
    assert said == ["x: 3 steps to run, the first took 2.12 s here: about 6 seconds in all"]  # at the budget, not over: no shrink said
    assert f.summary() == {"steps": 3, "forecast_seconds": 6.37, "seconds": 9.877}
    said.clear()
    over = Forecast("y", say=said.append, clock=iter([0.0, 5.0]).__next__, budget_seconds=4)
    steps = over.over(range(2))
    next(steps), next(steps)
    assert said == ["y: 2 steps to run, the first took 5.00 s here: about 10 seconds in all, over the budget of 4 seconds"]  # nothing to shrink by
