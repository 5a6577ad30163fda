"""The one exception type the CLI turns into a single line and a non-zero exit."""


class DepthcurseError(Exception):
    """Bad input or an unusable environment, described for the user in one line.

    Library code raises this for anything the user can fix (unknown model, bad layer
    index, empty data...). The CLI prints ``error: <message>`` and exits 1; ``--debug``
    shows the traceback instead.
    """
