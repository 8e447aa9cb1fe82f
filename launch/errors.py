"""The error of a run that cannot start or continue as asked: the CLI prints its one line, no traceback."""


class RunError(RuntimeError):
    """A run that cannot start or continue as asked (existing run folder, missing checkpoint, ...)."""
