"""The `depthcurse` command line: parse, call the library, print. No measurement logic here.

One typer app (`cli.shared`, with what every command uses), on which `COMMANDS` here puts the
commands of a module per family: `prune` (prune, plot, report), `heal`, `models` (drop,
speed, finetune-qa, assets), `inspect` (angular-distance, depth-use, depth-map), `train` (lns-train, lns-report), `select`, `speculate`, `settings`. Each
command imports the library inside itself: the library loads torch and transformers (several
seconds), which `depthcurse --help` and a mistyped option should not wait for.
"""

from __future__ import annotations

import inspect as _inspect
import os
import signal
import sys

from depthcurse.cli import heal, inspect, models, prune, select, settings, speculate, train
from depthcurse.cli.shared import app, err_console, fail
from depthcurse.errors import DepthcurseError, one_line
from depthcurse.io import removing_empty_on_failure

# Every command, in the order --help lists them: the sweep, what follows it, what shows results,
# training, and the helpers.
COMMANDS = (("prune", prune.prune), ("heal", heal.heal), ("drop", models.drop), ("speed", models.speed), ("angular-distance", inspect.angular_distance), ("depth-use", inspect.depth_use), ("depth-map", inspect.depth_map),
            ("report", prune.report), ("plot", prune.plot), ("lns-train", train.lns_train), ("lns-report", train.lns_report),
            ("finetune-qa", models.finetune_qa), ("assets", models.assets), ("select", select.select), ("speculate", speculate.speculate),
            ("settings", settings.settings))

def unwrapped(doc: str | None) -> str | None:
    """A docstring as help: each paragraph one line, for the terminal to wrap at its own width (the
    docstring's own line breaks fell mid-sentence in `--help`)."""
    if not doc:
        return doc
    return "\n\n".join(" ".join(p.split()) for p in _inspect.cleandoc(doc).split("\n\n"))


for name, command in COMMANDS:
    app.command(name, help=unwrapped(command.__doc__))(command)


def command_names() -> set[str]:
    """The names of depthcurse's commands (prune, angular-distance, ...)."""
    return {c.name or c.callback.__name__.replace("_", "-") for c in app.registered_commands}


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt


def main() -> None:
    """Console entry point: user errors become one line and exit 1; --debug shows tracebacks."""
    debug = "--debug" in sys.argv[1:]
    # A scheduler's preemption (SIGTERM) ends a sweep like Ctrl-C: finished variants are kept and reported.
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    if not debug:
        # tqdm reads this when it is first imported; lm-eval and transformers draw their own bars
        # inside ours otherwise.
        os.environ.setdefault("TQDM_DISABLE", "1")
    try:
        with removing_empty_on_failure():  # a failed command leaves no empty results folder behind
            app()
    except DepthcurseError as exc:
        if debug:
            raise
        fail(str(exc))
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)
    except Exception as exc:  # an unexpected failure still gets one line unless --debug
        if debug:
            raise
        fail(f"{one_line(exc)} (rerun with --debug for the traceback)")


if __name__ == "__main__":
    main()
