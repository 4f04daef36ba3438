"""`qspec` command line: the Typer app, its commands, and the entry point's error contract.

Each command lives in its own module (parse, call one library function, render); the shared
options, consoles and checks in `qspec_cli.common`.
"""

from __future__ import annotations

import sys
import warnings
from typing import Annotated

import typer

from qspec_cli import bench, chat, common, convert, info, prefill, quality, summarize
from qspec_core.errors import disk_full_error, is_disk_full, user_errors

app = typer.Typer(
    help="qspec: chat with and summarize long documents, fast, on one GPU or a plain CPU.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
# in this order in `qspec --help`
for command in (
    summarize.summarize,
    chat.chat,
    prefill.prefill,
    info.info,
    convert.convert,
    quality.quality,
    bench.bench,
):
    app.command()(command)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Library warnings (the CPU kernel build, torch) as one plain line, not Python's
    `file:line: UserWarning:` with a source line under it."""
    common.warn(f"warning: {str(message).removeprefix('qspec: ')}")


def _version(value: bool) -> None:
    if value:
        import qspec_core

        print(f"qspec {qspec_core.__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool | None,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Print the version and exit."
        ),
    ] = None,
):
    """qspec: chat with and summarize long documents, fast, on one GPU or a plain CPU."""


def main(argv: list[str] | None = None) -> None:
    """Console entry point: user errors are one line on stderr and exit code 2."""
    warnings.showwarning = _show_warning
    if sys.stdout is None:  # (fd 1 closed: `>&-`) every result would be lost
        common.print_error(
            "standard output is closed: qspec writes its results there; redirect it to a file "
            "(or /dev/null)"
        )
        sys.exit(2)
    try:
        # standalone_mode=False: click's own errors (unknown option, bad value, missing
        # argument) reach us as exceptions instead of a multi-line box, and follow the same
        # contract; --help and --version come back as their exit code 0
        code = app(args=argv, prog_name="qspec", standalone_mode=False)
    except user_errors() as e:  # ours, and the kernels' settings errors (QSPEC_CPU_*)
        common.print_error(str(e))
        sys.exit(2)
    except OSError as e:  # a full disk wherever a write is not wrapped in `disk_space`
        if not is_disk_full(e):
            raise
        if e.filename is None:  # (standard output on a full device: no file to name)
            common.print_error(f"a write failed: {e.strerror}; free some space and run again")
        else:
            common.print_error(str(disk_full_error(e.filename, e)))
        sys.exit(2)
    except typer.TyperException as e:  # click's ClickException and its UsageErrors
        if type(e).__name__ == "NoArgsIsHelpError":  # bare `qspec`: the help is printed
            sys.exit(2)
        ctx = getattr(e, "ctx", None)
        hint = f" (see {ctx.command_path} --help)" if ctx is not None else ""
        common.print_error(e.format_message().rstrip(".") + hint)
        sys.exit(2)
    except typer.Abort:  # EOF at a prompt
        common.print_error("aborted")
        sys.exit(1)
    except KeyboardInterrupt:
        code = 130
    if code == 130:  # click turns Ctrl-C into exit code 130
        common.warn("interrupted")
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
