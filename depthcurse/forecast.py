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

import contextlib
import contextvars
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence, TypeVar

Step = TypeVar("Step")
REVISE = 1.5  # a later forecast is said where it is this many times the last one said, or that share of it


def duration(seconds: float) -> str:
    """Seconds in the unit a reader plans by: seconds up to 90, minutes up to 90, then hours."""
    return f"{seconds / 3600:.1f} hours" if seconds >= 5400 else (f"{seconds / 60:.0f} minutes" if seconds >= 90 else f"{seconds:.0f} seconds")


# Where every forecast's running estimate goes after each step while a command shows its progress
# (`shown`): one hook for every loop, so that no long command's progress line lacks it.
_SHOWN: contextvars.ContextVar = contextvars.ContextVar("depthcurse_forecast_shown", default=None)


@contextlib.contextmanager
def shown(show: Callable[[str], None]) -> Iterator[None]:
    """While the body runs, each forecast's running estimate (`Forecast.left`) goes to `show` after
    every step: the progress line's "about 3 minutes left (2 to 4 minutes)"."""
    token = _SHOWN.set(show)
    try:
        yield
    finally:
        _SHOWN.reset(token)


def took_up(what: str, done: int, of: int, where=None) -> str:
    """The line a resumed run says of what it took up instead of running again."""
    return f"{what}: took up the {done} of {of} finished before" + (f" (kept in {where})" if where is not None else "") + ", not run again"


@dataclass
class Forecast:
    """The steps of `what`, counted from the plan its loop runs (`over`: the loop iterates the forecast,
    so the two cannot disagree); after the first step this process ran (a resumed run starts past 0),
    the forecast is said once through `say`."""

    what: str
    say: Callable[[str], None] = lambda text: None
    clock: Callable[[], float] = time.perf_counter
    budget_seconds: float | None = None
    shrink: str = ""  # how to make the work smaller, said where the forecast passes the budget
    steps: int | None = field(default=None, init=False)  # the plan's length, set by `over` (or `planned`)
    started: float | None = field(default=None, init=False)
    estimate: float | None = field(default=None, init=False)  # the first forecast, from the first step
    revisions: list = field(default_factory=list, init=False)  # each later forecast said: after how many steps, the seconds in all
    times: list = field(default_factory=list, init=False)  # each step's seconds, this process's
    last: float | None = field(default=None, init=False)

    def planned(self, steps: int) -> "Forecast":
        """Counts `steps` steps from now: for work that reports its plan's length itself (`following`)."""
        self.steps = steps
        self.started = self.clock()
        return self

    def over(self, plan: Sequence[Step], first: int = 0, kept_in=None) -> Iterator[tuple[int, Step]]:
        """(index, step) of each of the plan's steps from `first` on, each counted done when the loop
        asks for the next; where `first` steps were kept by an interrupted run, the line says they
        were taken up (`took_up`)."""
        self.planned(len(plan))
        if first:
            self.say(took_up(self.what, first, len(plan), kept_in))
        for index in range(first, len(plan)):
            yield index, plan[index]
            self.step_done(index)

    def step_done(self, index: int) -> None:
        now = self.clock()
        self.times.append(now - (self.started if self.last is None else self.last))
        self.last = now
        if self.estimate is None:
            self._first(index)
        else:
            self._revise(index, now)
        show = _SHOWN.get()
        if show is not None:
            show(self.left(index))

    def _remaining(self, left: int) -> tuple[float, float, float]:
        """Seconds for `left` more steps at the median, the quickest and the slowest step so far."""
        return statistics.median(self.times) * left, min(self.times) * left, max(self.times) * left

    def left(self, index: int) -> str:
        """The running estimate after step `index`: the steps left at the median step so far, with the
        range the quickest and slowest step so far give ("" once none is left)."""
        left = self.steps - index - 1
        if left <= 0:
            return ""
        typical, quickest, slowest = self._remaining(left)
        if len(self.times) == 1:
            return f"about {duration(typical)} left (from the first step)"
        return f"about {duration(typical)} left ({duration(quickest)} to {duration(slowest)})"

    def _first(self, index: int) -> None:
        running = self.steps - index  # this process's steps: all of them, or those a resumed run has left
        self.estimate = self.times[0] * running
        if running <= 1:
            return
        line = f"{self.what}: {running} steps to run, the first took {self.times[0]:.2f} s here: about {duration(self.estimate)} in all"
        if self.budget_seconds is not None and self.estimate > self.budget_seconds:
            line += f", over the budget of {duration(self.budget_seconds)}" + (f": {self.shrink}" if self.shrink else "")
        self.say(line)

    def _revise(self, index: int, now: float) -> None:
        """The forecast again from the steps so far (their median, each step's time so far), said where
        it has moved past `REVISE` times the one said last: a machine whose load moves, or steps that
        are not alike, are followed, not extrapolated from the first step alone."""
        left = self.steps - index - 1
        if left <= 0:
            return
        typical, quickest, slowest = self._remaining(left)
        total = now - self.started + typical
        said = self.revisions[-1]["forecast_seconds"] if self.revisions else self.estimate
        if said / REVISE <= total <= said * REVISE:
            return
        self.revisions.append({"after_steps": len(self.times), "forecast_seconds": round(total, 3)})
        self.say(f"{self.what}: {len(self.times)} steps took {duration(now - self.started)}; about {duration(typical)} left "
                 f"({duration(quickest)} to {duration(slowest)} at the quickest and slowest step so far): the forecast "
                 f"moved from {duration(said)} to {duration(total)} in all")

    def summary(self) -> dict:
        """The forecast beside the time taken, both in seconds (None where no step finished)."""
        taken = None if self.started is None else round(self.clock() - self.started, 3)
        return {"steps": self.steps, "forecast_seconds": None if self.estimate is None else round(self.estimate, 3), "seconds": taken,
                "revisions": self.revisions}


def following(what: str, say: Callable[[str], None], clock: Callable[[], float] = time.perf_counter) -> Callable[[int, int], Forecast]:
    """A progress callback `(done, total)` that forecasts from its first finished step: for work
    that reports its progress (prune's variants and batches) rather than being built around a
    `Forecast`. The callback returns the Forecast (None-free once the work reported its first step)."""
    state: dict = {}

    def heard(done: int, total: int) -> Forecast:
        if "forecast" not in state:
            state["forecast"] = Forecast(what, say=say, clock=clock).planned(total - done)
            state["first"] = done
        elif done > state["first"]:
            state["forecast"].step_done(done - state["first"] - 1)
        return state["forecast"]

    return heard
