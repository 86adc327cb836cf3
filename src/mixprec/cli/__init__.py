"""The `mixprec` command line: a thin shell over library calls, one module per command.

`app` builds the parser and runs `main`; `common` holds what commands share;
`exits` is the one mapping from errors to exit codes; `interrupt` makes the
first Ctrl-C a request to stop at a safe point.
"""

from mixprec.cli.app import build_parser, main
from mixprec.cli.common import UsageError
from mixprec.cli.interrupt import INTERRUPTED

__all__ = ["INTERRUPTED", "UsageError", "build_parser", "main"]
