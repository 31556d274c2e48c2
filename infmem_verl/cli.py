"""Bad input at a command line ends in one line on stderr and exit status 2, never a traceback.

Every entry point (``main``, ``eval``, ``distill``, ``sft``, ``data_prep.build``, the dataset
command line, ``inspect``, ``export``) turns the project's input-error families into that line:
configuration (:class:`~infmem_verl.agent.errors.ConfigError`), data files
(:class:`~data_prep.io.DataError`, :class:`~infmem_verl.data.identity.DuplicateIdError`), files
that cannot be opened, whatever families the entry point adds (its own error class), and for
the Hydra mains Hydra's own (:func:`run_hydra`: an unknown recipe, a bad override). Each message
already names the file, line or key and what was expected. Any other exception is a fault of
the program and keeps its traceback.

``--traceback`` (taken out of the arguments before they are parsed) or ``INFMEM_TRACEBACK=1``
shows the traceback of an input error too.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import traceback
from typing import Callable, Iterator, Sequence, TypeVar

from data_prep.io import DataError
from infmem_verl.agent.errors import ConfigError
from infmem_verl.data.identity import DuplicateIdError

EXIT_INPUT = 2  # the exit status of bad input (argparse's, for its own usage errors)
TRACEBACK_ENV = "INFMEM_TRACEBACK"
TRACEBACK_FLAG = "--traceback"
# Files that cannot be opened as asked are input errors too: the message names the file.
_FILE_ERRORS = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)
INPUT_ERRORS: tuple[type[BaseException], ...] = (ConfigError, DataError, DuplicateIdError, *_FILE_ERRORS)

T = TypeVar("T")


def take_traceback_flag(argv: list[str]) -> None:
    """Remove ``--traceback`` from ``argv`` (in place) and turn tracebacks of input errors on."""
    while TRACEBACK_FLAG in argv:
        argv.remove(TRACEBACK_FLAG)
        os.environ[TRACEBACK_ENV] = "1"


def error_line(err: BaseException) -> str:
    """The one line that reports ``err``: its message (a message of several lines, such as every
    failed pre-flight check or Hydra's, joined with "; "), or for a file error the file and why."""
    if isinstance(err, OSError) and err.filename is not None:
        return f"{err.filename}: {err.strerror or type(err).__name__}"
    parts: list[str] = []
    for line in (line.strip() for line in str(err).splitlines()):
        if line and parts and parts[-1].endswith((":", ".")):  # a heading or a sentence: its line goes on
            parts[-1] += f" {line}"
        elif line:
            parts.append(line)
    return "; ".join(parts) or type(err).__name__


def hydra_error_line(err: BaseException) -> str:
    """Hydra's message in one line: its config search path left out, a list of options inline."""
    text = str(err).split("Config search path:")[0]
    head, listed, options = text.partition("Available options in")
    if not listed:
        return error_line(Exception(text))
    group, _, names = options.partition(":")
    return f"{error_line(Exception(head))}; available options in{group}: {', '.join(names.split())}"


def report_input_error(prog: str, err: BaseException, line: str | None = None) -> int:
    """Print ``err`` for the user (its traceback first when asked) and return :data:`EXIT_INPUT`."""
    if os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
        traceback.print_exception(err)
    print(f"[{prog}] {line or error_line(err)}", file=sys.stderr, flush=True)
    return EXIT_INPUT


@contextlib.contextmanager
def exit_on_input_error(prog: str, errors: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
    """For a Hydra task function (it returns nothing): input errors are reported in one line and
    end the process with :data:`EXIT_INPUT`. Its ``__main__`` calls :func:`take_traceback_flag`."""
    try:
        yield
    except INPUT_ERRORS + errors as err:
        raise SystemExit(report_input_error(prog, err)) from None


def run_hydra(main: Callable[[], None], prog: str) -> None:
    """Run a Hydra main from its ``__main__``: a bad override, an unknown config group option or a
    key missing from the config is one line and exit status 2, like every other input error.

    Hydra itself would print such an error over several lines and exit with status 1; with
    ``HYDRA_FULL_ERROR=1`` it raises instead, and so does any fault of the run, with its whole
    traceback.
    """
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    take_traceback_flag(sys.argv)
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    try:
        main()
    except (HydraException, OmegaConfBaseException) as err:
        raise SystemExit(report_input_error(prog, err, hydra_error_line(err))) from None


def entry_point(prog: str, errors: tuple[type[BaseException], ...] = ()) -> Callable[[Callable[..., T]], Callable[..., T | int]]:
    """Decorate ``main(argv)``: input errors (:data:`INPUT_ERRORS` and ``errors``) are reported in
    one line and ``main`` returns :data:`EXIT_INPUT`; ``--traceback`` is taken out of ``argv``."""
    caught = INPUT_ERRORS + errors

    def wrap(main: Callable[..., T]) -> Callable[..., T | int]:
        @functools.wraps(main)
        def run(argv: Sequence[str] | None = None) -> T | int:
            args = list(sys.argv[1:] if argv is None else argv)
            take_traceback_flag(args)
            try:
                return main(args)
            except caught as err:
                return report_input_error(prog, err)

        return run

    return wrap
