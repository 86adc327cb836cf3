"""`mixprec doctor FILE_OR_DIR...`: lint training configs."""

from __future__ import annotations

from typing import Any

__all__ = ["add_parser"]


def add_parser(sub: Any) -> None:
    """Register the ``doctor`` subcommand."""
    from mixprec.doctor.cli import add_parser as add_doctor

    add_doctor(sub)
