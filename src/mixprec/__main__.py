"""`python -m mixprec` runs the command line."""

from mixprec.cli import main

raise SystemExit(main())
