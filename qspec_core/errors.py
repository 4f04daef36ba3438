"""User-facing errors: the CLI prints them as one line and exits with code 2."""


class QspecError(Exception):
    """A problem the user can fix (bad input, missing model, offline registry, ...)."""


class UnsupportedModelError(QspecError):
    """The checkpoint uses an architecture or option this implementation does not run."""


def user_errors() -> tuple[type[Exception], ...]:
    """What the CLI reports as one `error:` line (exit code 2): ours, and the kernels' own
    settings errors (the kernels import nothing from here)."""
    from kernels.cpu.build import BuildSettingError

    return (QspecError, BuildSettingError)
