"""The command line's one typer app, its consoles, the options several commands share, and the
helpers every command uses: progress bars, one-line errors, loading a model under a spinner."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from depthcurse import heap  # ctypes alone: nothing at start-up
from depthcurse.forecast import shown  # the standard library's alone: nothing at start-up

app = typer.Typer(
    help="Which layers of a language model actually do anything? Layer-pruning sweeps and depth diagnostics.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


class TableConsole(Console):
    """rich's console, except that written to a file or a pipe (a cluster's log), a table is printed
    as wide as its widest cells need instead of cut to 80 columns, where every cell read `…`."""

    def print(self, *objects, **kwargs) -> None:
        widest = 0
        if not self.is_terminal:
            widest = max((self.measure(o, options=self.options.update_width(100_000)).maximum for o in objects if isinstance(o, Table)), default=0)
        if widest <= self.width:
            return super().print(*objects, **kwargs)
        width, self.width = self.width, widest  # rich caps print's own width= at the console's
        try:
            super().print(*objects, **kwargs)
        finally:
            self.width = width


console = TableConsole()
err_console = TableConsole(stderr=True)

ModelArg = typer.Argument(..., help="Hub id (meta-llama/Llama-2-7b-hf), local folder, .gguf file, or offline alias (smollm2-135m).")
DtypeOpt = typer.Option("auto", "--dtype", help="auto (the checkpoint's dtype on a GPU; on a CPU a bf16 checkpoint in bf16 where the CPU computes it natively, else fp32: the header and the record say which), bf16, fp16 or fp32.")
DeviceOpt = typer.Option("auto", "--device", help="auto, cpu or cuda (cuda spreads a large model over all GPUs).")
TrustOpt = typer.Option(False, "--trust-remote-code", help="Run the model repository's own Python code. Off unless you ask.")
RevisionOpt = typer.Option(None, "--revision", help="Hub revision (branch, tag or commit).", show_default="the default branch")


@app.callback()
def _main(debug: bool = typer.Option(False, "--debug", help="Show full tracebacks and library logs.")) -> None:
    logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    heap.keep_freed_memory()  # before any tensor: the vocabulary's work faulted in fresh pages (heap.py)
    if not debug:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        from depthcurse.tasks.harness import quiet_lm_eval  # lazy: start-up (module docstring)

        quiet_lm_eval()


# What every --task says of the suites it takes (prune, heal, select): the same words, so none forgets one.
SUITES_HELP = ("a suite: commonsense (ARC-e, ARC-c, BoolQ, HellaSwag, PIQA, WinoGrande, OpenBookQA), probes (the capability probes: arithmetic, "
               "brackets, copying, recall, each a ladder of rungs scored by greedy exact match) or a list (arc_easy,piqa; commonsense,probes): "
               "each task, their average and the share of the unpruned model's kept")


def say(label: str, text: str, style: str = "yellow") -> None:
    """`label: text` on stderr; the text is printed as it is (no rich markup, no :emoji: codes),
    since it holds paths, option values and messages from other libraries."""
    err_console.print(Text.assemble((f"{label}:", style), " ", text), highlight=False, soft_wrap=True)


def verdicts(lines: list[str]) -> None:
    """A comparison's verdicts (ties, what it cannot tell, what did not run), a line each after its
    table on stdout, where a reader looks for the result: not folded into the table's caption."""
    for line in lines:
        console.print(Text(f"- {line}"), soft_wrap=True, highlight=False)


def renamed(command: str, old: str, old_value, new_value, default):
    """The value of an option given by its older name (`cli.vocabulary.RENAMED`), said in a note, or
    the new name's, or `default` where neither was given; both names at once is one line, whatever
    their values (each option's own default is None: given or not is never read from its value)."""
    from depthcurse.cli.vocabulary import RENAMED, renamed_note
    from depthcurse.errors import DepthcurseError

    new = RENAMED[command, old]
    if old_value is None:
        return default if new_value is None else new_value
    if new_value is not None:
        raise DepthcurseError(f"{old} and {new} are one setting: give {new} alone")
    say("note", renamed_note(old, new))
    return old_value


def interrupted(kept: str) -> None:
    """The line every command prints when stopped: what it kept, and how to go on."""
    err_console.print(Text(f"interrupted: {kept}; rerun the same command to continue"), soft_wrap=True)


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", Path(text).name if os.path.exists(text) else text.split("/")[-1]).strip("-").lower() or "model"


def progress_bar(*extra_columns, **kwargs) -> Progress:
    """The bar every long command shows: spinner, description, bar, done/total, extra columns, times.
    Off a terminal (a log file, a pipe), where a live bar shows nothing until it stops, a line per
    finished step instead (`LineProgress`)."""
    kind = Progress if console.is_terminal else LineProgress
    return kind(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), *extra_columns,
                TimeElapsedColumn(), ForecastColumn(), console=console, **kwargs)


class ForecastColumn(TimeRemainingColumn):
    """The forecast of the work running now (`forecast.shown`: the median step so far times the steps
    left, with the range the quickest and slowest step give), where one was made; rich's own estimate
    before it."""

    def render(self, task):
        left = task.fields.get("forecast")
        return Text(left, style="progress.remaining") if left and not task.finished else super().render(task)


def show_forecast(progress: Progress, text: str) -> None:
    """A forecast's running estimate on the bar of the work under way: the last bar added that has
    not finished (the inner loop of nested work), kept in its `forecast` field; nothing once the work
    ended (its last step leaves nothing to forecast, and the bar has finished)."""
    running = [task for task in progress.tasks if not task.finished]
    if running and text:
        progress.update(running[-1].id, forecast=text)


class LineProgress(Progress):
    """A progress bar that draws nothing and writes one line to stderr each time a task finishes a
    step (at most one every `every_s` seconds, and always its last): what a command redirected to a
    file says while it works. stdout keeps only the results."""

    every_s = 5.0

    def __init__(self, *columns, **kwargs):
        super().__init__(*columns, **{**kwargs, "disable": True})
        self._said: dict = {}

    def update(self, task_id, **kwargs) -> None:
        super().update(task_id, **kwargs)
        self._say(task_id)

    def advance(self, task_id, advance: float = 1) -> None:
        super().advance(task_id, advance)
        self._say(task_id)

    def _say(self, task_id) -> None:
        import time  # lazy: start-up

        task = self._tasks[task_id]
        done, (last_done, last_t) = int(task.completed), self._said.get(task_id, (0, 0.0))
        finished = task.total is not None and done >= task.total
        if done <= last_done or (not finished and time.monotonic() - last_t < self.every_s):
            return
        self._said[task_id] = (done, time.monotonic())
        elapsed = int(task.elapsed or 0)
        total = f"/{int(task.total):,}" if task.total is not None else ""
        left = f", {task.fields['forecast']}" if task.fields.get("forecast") and not finished else ""
        err_console.print(Text(f"{task.description}: {done:,}{total} ({elapsed // 60}:{elapsed % 60:02d} elapsed{left})"), highlight=False, soft_wrap=True)


@contextlib.contextmanager
def showing(progress: Progress):
    """Show `progress` while the body runs. An error erases it, so that the error is the one line
    printed; an interruption keeps it (it says how far the work came). Every forecast made meanwhile
    shows its running estimate on the bar (`show_forecast`)."""
    progress.start()
    try:
        with shown(lambda text: show_forecast(progress, text)):
            yield progress
    except Exception:
        progress.live.transient = True
        progress.live.stop()  # not progress.stop(): off a terminal that adds a blank line to stdout
        raise
    except BaseException:
        progress.stop()
        raise
    progress.stop()


def once(say):
    """`say`, made to run on its first call only."""
    said = []

    def once() -> None:
        if not said:
            said.append(True)
            say()

    return once


def decoders_only(command: str) -> str:
    """What a command that reads a decoder's next-token predictions says of an encoder (not prune's
    advice to use --task squad, an option it does not have)."""
    return f"{command} reads a decoder's next-token predictions: give a decoder (Llama, Qwen, Mistral, SmolLM2...)"


def load(model: str, **options):
    """`load_model` under a spinner; a trained alias (minilm-l6-squad) is fine-tuned first if it is not made yet."""
    from depthcurse.loading import load_model  # lazy: start-up
    from depthcurse.qa import make_trained_alias

    with console.status(f"loading {model}..."):
        make_trained_alias(model)
        return load_model(model, **options)


def model_line(loaded) -> str:
    from depthcurse.surgery import num_layers  # lazy: start-up

    line = f"[bold]{loaded.name}[/] ({type(loaded.model).__name__}, {num_layers(loaded.model)} layers, {str(loaded.dtype).removeprefix('torch.')}, {loaded.device})"
    # on a CPU, auto's dtype depends on the processor: the header says so, as the record does
    return f"{line} · {loaded.dtype_why}" if loaded.dtype_why.startswith("auto:") and loaded.device.type == "cpu" else line


def join_ranks(device: str, parallel: str = "requests"):
    """This process's place: alone, or one rank of a torchrun launch (where only rank 0 talks)."""
    from depthcurse.runtime import World, join_torchrun, launched_by_torchrun, pick_device  # lazy: start-up

    if not launched_by_torchrun():
        return World()
    world, _ = join_torchrun(pick_device(device), parallel)
    console.quiet = err_console.quiet = not world.main  # only rank 0 talks; another rank says only an error of its own (fail)
    return world


RANK_0_GRACE_S = 60.0  # the most another rank waits for rank 0 to say an error every rank met (a busy machine starts ranks seconds apart)
RANK_0_POLL_S = 0.1


def rank_0_said_path() -> Path | None:
    """Where rank 0 of this launch leaves word that it said an error: a file every rank on this machine
    sees, named by torchrun's run id and its agent's process (the ranks' parent: one launch, never an
    earlier one of the same id); None outside torchrun."""
    launch = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("MASTER_PORT")
    if not launch or "RANK" not in os.environ:
        return None
    import tempfile

    return Path(tempfile.gettempdir()) / f"depthcurse-launch-{re.sub(r'[^A-Za-z0-9_.-]', '_', launch)}-{os.getppid()}" / "rank0-said"


def fail(text: str, clock=None, sleep=None) -> None:
    """`error: text` and exit 1. Under torchrun only rank 0 talks: bad input fails every rank at
    once, rank 0 says why, and torchrun stops the others when it exits. Rank 0 leaves word that it
    said it (`rank_0_said_path`); another rank waits for that word, or for torchrun to stop it, and
    leaves without a word, however far behind rank 0 the machine's load put it. Still running with no
    word from rank 0 after `RANK_0_GRACE_S`, it says its error with its rank: a failure of its own
    (a variant that ran out of memory on its GPU), which rank 0 cannot know. (`clock` and `sleep`:
    the time a test holds.)"""
    import time  # lazy: only a failure needs it

    clock, sleep = clock or time.monotonic, sleep or time.sleep
    rank = int(os.environ.get("RANK", "0"))
    said = rank_0_said_path()
    if rank != 0:
        # torchrun ends the other ranks (SIGTERM) when rank 0 exits with its error: then this one
        # has nothing to add, and leaves without a word (no KeyboardInterrupt traceback).
        signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(1))
        waited_from = clock()
        while clock() - waited_from < RANK_0_GRACE_S:
            if said is not None and said.exists():
                sys.exit(1)  # rank 0 said it
            sleep(RANK_0_POLL_S)
        err_console.quiet = False
        text = f"rank {rank}: {text}"
    elif said is not None:
        try:
            said.parent.mkdir(parents=True, exist_ok=True)
            said.write_text(text)
        except OSError:
            pass  # the others then wait out their grace, or torchrun stops them
    say("error", text, "bold red")
    sys.exit(1)


def measure_angular(loaded, out_dir: Path, *, data: str, tokens: int, seq_len: int | None, position: str, **options):
    """The angular pass (angular-distance's, and prune --block's and --greedy's), with a header
    line and a progress bar, and a warning when the text ran out."""
    from depthcurse.angular import measure_loaded  # lazy: start-up
    from depthcurse.loading import window_length

    seq_len = window_length(loaded.model, seq_len)  # a bad one is refused before anything is printed
    header = f"{model_line(loaded)} · angular distance on {data}, {position} token · results in {out_dir}"
    progress = progress_bar()
    bar = progress.add_task("tokens", total=None)
    with showing(progress):
        result, tokenised, label = measure_loaded(loaded, data, tokens=tokens, seq_len=seq_len, position=position,
                                                  on_batch=lambda done, total: progress.update(bar, completed=done, total=total),
                                                  on_start=lambda: progress.console.print(header), **options)
    if tokenised.exhausted:
        say("warning", f"{label} holds only {tokenised.tokens} tokens of {len(tokenised.sequences)} documents at --seq-len {seq_len} (asked for --tokens {tokens}): used all of them")
    return result


def push(folder: Path, repo: str, private: bool) -> None:
    """`--push-to-hub` of drop and heal: the folder uploaded under a spinner."""
    from depthcurse.hub import push_folder  # lazy: start-up

    with console.status(f"uploading {folder} to the hub repository {repo}..."):
        url = push_folder(folder, repo, private=private)
    console.print(f"pushed {folder} to {url}")


def in_turns(measure, first: str = "timing, in turns") -> dict:
    """`measure(on_step)`, the two models' turns shown on a progress bar (`first`: what it says before the first turn)."""
    progress = progress_bar()
    bar = progress.add_task(first, total=None)
    with showing(progress):
        return measure(lambda name, done, total: progress.update(bar, completed=done, total=total, description=f"turns timed (the {name} model's last)"))


def show_speed(record: dict, written: Path) -> None:
    """A speed record's table, where it was written, and one line per ratio that is not a finding."""
    from depthcurse.speed import distrusted, speed_table  # lazy: start-up

    console.print(speed_table(record))
    console.print(f"wrote {written}" + (f" and the speed table into {record['card']}" if record.get("card") else ""))
    for line in distrusted(record):
        say("warning", f"not a finding, {line}" + ("; the model card was left as it was" if "card" in record else ""))


def time_checkpoint(checkpoint: Path, out: Path, *, device: str, dtype: str, trust_remote_code: bool = False, cfg=None) -> dict:
    """`speed` of a checkpoint made by drop or heal against its source (`speed.speed_checkpoint`), on a bar, and shown."""
    from depthcurse import speed as speeds  # lazy: start-up

    record = in_turns(lambda on_step: speeds.speed_checkpoint(checkpoint, out, cfg or speeds.SpeedConfig(), device=device, dtype=dtype,
                                                              trust_remote_code=trust_remote_code, on_step=on_step),
                      first=f"loading {checkpoint} and the model it came from")
    show_speed(record, Path(out) / speeds.SPEED_JSON)
    return record
