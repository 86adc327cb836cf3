"""``python -m mixprec.doctor FILE...``: the same as ``mixprec doctor FILE...``."""

import sys

from mixprec.cli import main

__all__: list[str] = []

raise SystemExit(main(["doctor", *sys.argv[1:]]))
