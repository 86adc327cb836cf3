"""``python -m mixprec.doctor FILE...``: the doctor's command line on its own."""

from mixprec.doctor.cli import main

__all__: list[str] = []

raise SystemExit(main())
