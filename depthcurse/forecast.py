"""What long work will take on this machine, said from the work's own first step (issue 81).

A command that repeats one step many times (the tuned lens's SGD steps, depth-use's batches of
windows, depth-map's rows of maps, speculate's prompts) times its first step and, before the rest
runs, says how many there are and about how long they take: the first step's time times the steps
left, plus what it took. That is a timed pass of the command's own code on this machine, busy or
not, which no table of speeds can be. Where a budget is given and the forecast passes it, the line
says so and how to shrink the work. The record keeps the forecast beside the time taken
(`summary`), so that how good the forecasts are is a measured figure (docs/benchmarks.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable


def duration(seconds: float) -> str:
    """Seconds in the unit a reader plans by: seconds up to 90, minutes up to 90, then hours."""
    return f"{seconds / 3600:.1f} hours" if seconds >= 5400 else (f"{seconds / 60:.0f} minutes" if seconds >= 90 else f"{seconds:.0f} seconds")


@dataclass
class Forecast:
    """`steps` steps of `what`: `step_done(i)` after step i (0-based) finishes; after the first that this
    process ran (a resumed run starts past 0), the forecast is said once through `say`."""

    what: str
    steps: int
    say: Callable[[str], None] = lambda text: None
    clock: Callable[[], float] = time.perf_counter
    budget_seconds: float | None = None
    shrink: str = ""  # how to make the work smaller, said where the forecast passes the budget
    started: float | None = field(default=None, init=False)
    estimate: float | None = field(default=None, init=False)

    def start(self) -> "Forecast":
        self.started = self.clock()
        return self

    def step_done(self, index: int) -> None:
        if self.started is None:
            self.start()
        if self.estimate is not None:
            return
        running = self.steps - index  # this process's steps: all of them, or those a resumed run has left
        first = self.clock() - self.started
        self.estimate = first * running
        if running <= 1:
            return
        line = f"{self.what}: {running} steps to run, the first took {first:.2f} s here: about {duration(self.estimate)} in all"
        if self.budget_seconds is not None and self.estimate > self.budget_seconds:
            line += f", over the budget of {duration(self.budget_seconds)}" + (f": {self.shrink}" if self.shrink else "")
        self.say(line)

    def summary(self) -> dict:
        """The forecast beside the time taken, both in seconds (None where no step finished)."""
        taken = None if self.started is None else round(self.clock() - self.started, 3)
        return {"steps": self.steps, "forecast_seconds": None if self.estimate is None else round(self.estimate, 3), "seconds": taken}


def following(what: str, say: Callable[[str], None], clock: Callable[[], float] = time.perf_counter) -> Callable[[int, int], Forecast]:
    """A progress callback `(done, total)` that forecasts from its first finished step: for work
    that reports its progress (prune's variants and batches) rather than being built around a
    `Forecast`. The callback returns the Forecast (None-free once the work reported its first step)."""
    state: dict = {}

    def heard(done: int, total: int) -> Forecast:
        if "forecast" not in state:
            state["forecast"] = Forecast(what, total - done, say=say, clock=clock).start()
            state["first"] = done
        elif done > state["first"]:
            state["forecast"].step_done(done - state["first"] - 1)
        return state["forecast"]

    return heard
