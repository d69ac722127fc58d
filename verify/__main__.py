"""``python -m verify``: prove the whole catalogue of identities and print the report.

Usage::

    python -m verify                      # every identity at every level, as a table
    python -m verify --only 'copy-*'      # a subset (glob, substring, or section:ANCHOR; commas)
    python -m verify --levels exact,float32
    python -m verify --json               # machine-readable (schema linop-verify-report/1)
    python -m verify --list               # the catalogue: names, sections, statements
    mpiexec -n 4 python -m verify --mpi   # the distributed checks (takes --only too)

Exit status: 0 when every check passes, 1 when any check fails or errors, 2 on a usage error
(including a pattern that selects nothing, with ``--mpi`` too, or levels that apply to none of
the selection), 130 when interrupted (Ctrl-C: one line saying how far it got, no traceback),
141 when the reader of stdout left early (``| head -1``: no traceback either).
"""

from __future__ import annotations

import argparse
import sys

from linop.progress import Progress

from .catalogue import Entry
from .report import LEVELS, format_table, run, to_json

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m verify",
        description="Prove linop's catalogue of identities (docs/theory.md) exactly, size-free, "
        "symbolically and numerically.",
        epilog="Exit status: 0 when everything passes, 1 when a check fails, 2 on a usage error, "
        "130 when interrupted (Ctrl-C).",
    )
    parser.add_argument(
        "--only",
        metavar="PATTERN",
        help="identities to check: a glob (copy-*), a "
        "substring of the name, or section:ANCHOR (a section of docs/theory.md, e.g. "
        "section:halo-exchange); several separated by commas",
    )
    parser.add_argument(
        "--levels",
        metavar="LIST",
        default=",".join(LEVELS),
        help=f"comma-separated levels to run (default: all of {','.join(LEVELS)})",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    parser.add_argument("--list", action="store_true", help="list the selected identities and exit")
    parser.add_argument("--verbose", "-v", action="store_true", help="show each identity's statement")
    parser.add_argument("--no-progress", action="store_true", help="do not report progress on stderr")
    parser.add_argument(
        "--mpi",
        action="store_true",
        help="run the distributed part instead: each identity's operators under MPI against the "
        "numpy interpreter, and the adjoint test with inner products summed over ranks "
        "(launch with mpiexec -n K)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``python -m verify`` with the command-line arguments ``argv``: print the report.

    The command line is this function and ``sys.exit`` of its result, so a caller in the same
    process (the tests) sees what the shell sees.

    Parameters
    ----------
    argv
        The arguments, without the program name; None: ``sys.argv[1:]``.

    Returns
    -------
    int
        The exit status: 0 when every check passes, 1 when a check fails or errors, 2 on a usage
        error found after parsing (levels unknown or applying to none of the selection, a
        pattern that selects nothing), 130 when interrupted; with ``--mpi``, the status of
        :func:`verify.distributed.main`.

    Raises
    ------
    SystemExit
        From argparse: status 2 on a usage error it finds (an unknown option, a missing value,
        ``--mpi`` with an option it does not take), 0 after ``--help``.
    """
    parser = _parser()
    args = parser.parse_args(argv)
    if args.mpi:
        ignored = [
            flag
            for flag, given in (
                ("--json", args.json),
                ("--list", args.list),
                ("--levels", args.levels != parser.get_default("levels")),
                ("--verbose", args.verbose),
            )
            if given
        ]
        if ignored:
            parser.error(
                f"--mpi runs its own checks and takes only --only (and --no-progress), not {', '.join(ignored)}"
            )
        from . import distributed, identities

        if args.only and not identities.select(args.only):  # a typo must not pass having checked nothing
            print(f"python -m verify --mpi: no identity matches {args.only!r}", file=sys.stderr)
            return 2
        return distributed.main([args.only] if args.only else [])
    from . import identities

    levels = tuple(dict.fromkeys(level.strip() for level in args.levels.split(",") if level.strip()))
    unknown = [level for level in levels if level not in LEVELS]
    if unknown or not levels:
        parser.print_usage(sys.stderr)
        print(
            f"python -m verify: unknown level {unknown[0] if unknown else ''!r}; choose from "
            f"{', '.join(LEVELS)}",
            file=sys.stderr,
        )
        return 2
    entries = identities.select(args.only)
    if not entries:
        print(f"python -m verify: no identity matches {args.only!r}", file=sys.stderr)
        return 2
    if args.list:
        width = max(len(e.name) for e in entries)
        section_width = max(len(e.section) for e in entries)
        for e in entries:
            print(f"{e.name:<{width}}  {e.section:<{section_width}}  {e.kind:<7}  {e.statement}")
        return 0
    # a live line on a terminal, a line every few seconds otherwise, once the run has taken 2 s
    progress = Progress(
        "python -m verify", len(entries), "identities checked", progress=False if args.no_progress else None
    )

    def checking(done: int, total: int, entry: Entry, seconds: float) -> None:
        progress.update(done, entry.name)

    try:
        report = run(entries, levels, checking)
    except KeyboardInterrupt:  # Ctrl-C: a line saying so, not a traceback; status 130 (128 + SIGINT)
        progress.clear()
        where = "" if args.no_progress else f" after {progress.done}/{len(entries)} identities"
        print(f"python -m verify: interrupted{where}; no result to report", file=sys.stderr)
        return 130
    progress.clear()
    if not report.results:
        print(
            f"python -m verify: none of the levels {', '.join(levels)} applies to the selected identities",
            file=sys.stderr,
        )
        return 2
    print(to_json(report, levels=levels) if args.json else format_table(report, verbose=args.verbose))
    return 0 if report.passed else 1


def _exit(status: int) -> None:
    """``sys.exit(status)`` after flushing stdout; a reader that left early (``python -m verify
    --list | head -1``) ends the output quietly, with the status a process killed by SIGPIPE
    has (141), not a ``BrokenPipeError`` traceback."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        status = 141
    if status == 141:
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
    sys.exit(status)


def command_line() -> None:
    """The command line: :func:`main` on ``sys.argv``, its status the process's."""
    try:
        status = main()
    except BrokenPipeError:
        status = 141
    _exit(status)


if __name__ == "__main__":
    command_line()
