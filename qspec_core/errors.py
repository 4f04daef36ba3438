"""User-facing errors: the CLI prints them as one line and exits with code 2."""


class QspecError(Exception):
    """A problem the user can fix (bad input, missing model, offline registry, ...)."""


class UnsupportedModelError(QspecError):
    """The checkpoint uses an architecture or option this implementation does not run."""
