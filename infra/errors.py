"""Errors that the command line prints as one line."""


class InputError(ValueError):
    """Bad user input (a flag, a file, a folder): the CLI prints its message as one line."""


class BenchmarkUnavailable(RuntimeError):
    """A hub benchmark could not be loaded (no `datasets`, no hub); the message says the fix."""
