"""`depthcurse-torchrun`: torchrun for depthcurse commands, whose failure is the ranks' one line.

When a rank exits with an error, torchrun adds its own report to the rank's one line: a
traceback of its launcher and a table of the failed ranks (about 30 lines). This is torchrun
itself (`torch.distributed.run`, the same options) without that report:

    depthcurse-torchrun --nproc-per-node 8 prune meta-llama/Llama-2-7b-hf --task mmlu

runs `torchrun --nproc-per-node 8 -m depthcurse prune meta-llama/Llama-2-7b-hf --task mmlu` and
exits with the failed rank's exit code. With --debug torchrun's report stays.
"""

from __future__ import annotations

import logging
import sys

from depthcurse.cli import command_names


def torchrun_args(argv: list[str], commands: set[str]) -> tuple[list[str], bool]:
    """torchrun's arguments for `depthcurse-torchrun ARGV` (`-m depthcurse` put before the
    command, the first word of ARGV that names one), and whether --debug was asked for."""
    at = next((i for i, word in enumerate(argv) if word in commands), None)
    if at is None:
        raise ValueError(f"no depthcurse command among the arguments: give one of {', '.join(sorted(commands))}")
    launcher, command = argv[:at], argv[at:]
    debug = "--debug" in launcher or "--debug" in command
    launcher = [word for word in launcher if word != "--debug"]
    command = [word for word in command if word != "--debug"]
    return [*launcher, "-m", "depthcurse", *(["--debug"] if debug else []), *command], debug


def main(argv: list[str] | None = None) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        args, debug = torchrun_args(list(sys.argv[1:] if argv is None else argv), command_names())
    except ValueError as exc:
        print(f"usage: depthcurse-torchrun [torchrun options] COMMAND [options]: {exc}", file=sys.stderr)
        sys.exit(2)
    if not debug:
        # its notes as it stops the other ranks, and its line per failed rank
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(parse_args(args))
    except ChildFailedError as exc:
        if debug:
            raise
        _, failure = exc.get_first_failure()
        sys.exit(failure.exitcode if failure.exitcode > 0 else 1)


if __name__ == "__main__":
    main()
