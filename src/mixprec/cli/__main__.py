"""``python -m mixprec.cli``."""

from mixprec.cli.app import main

raise SystemExit(main())
