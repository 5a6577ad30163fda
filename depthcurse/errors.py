"""The one exception type the CLI turns into a single line and a non-zero exit."""


class DepthcurseError(Exception):
    """Bad input or an unusable environment, described for the user in one line.

    Library code raises this for anything the user can fix (unknown model, bad layer
    index, empty data...). The CLI prints ``error: <message>`` and exits 1; ``--debug``
    shows the traceback instead.
    """


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none)."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def one_line(exc: BaseException) -> str:
    """`Type: first line of the message`, for an unexpected error shown in one line. A type named
    like `error` (struct's, socket's) gets its module, so the line never reads `error: error:`."""
    name = type(exc).__name__
    if name.islower():
        name = f"{type(exc).__module__}.{name}"
    text = str(exc).strip()
    return f"{name}: {first_line(exc)}" if text else name
