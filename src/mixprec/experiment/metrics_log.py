"""``metrics.jsonl``: one JSON object per training step, appended as the run goes.

A resumed run first cuts the file back to the steps its checkpoint holds, so a
step is never listed twice; a line cut short by a crash is dropped then too.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

from mixprec.experiment.records import strict_json

__all__ = ["MetricsLog", "NoMetrics", "read_metrics"]


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The lines of a metrics file that parse as JSON objects with an int ``step``."""
    out: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as f:
        for text in f:
            try:
                line = json.loads(text)
            except json.JSONDecodeError:
                continue
            if isinstance(line, dict) and isinstance(line.get("step"), int):
                out.append(line)
    return out


class MetricsLog:
    """Appends one line per step to `path`, keeping the lines of steps ``<= keep_through``.

    Args:
        path: the file (created when missing).
        keep_through: the step the run goes on from (its checkpoint's); lines of
            later steps, and lines that do not parse, are removed first (0: a fresh
            run, the file is emptied).
    """

    def __init__(self, path: Path, *, keep_through: int) -> None:
        self.path = path
        if keep_through == 0:
            path.write_text("", encoding="utf-8")
        elif path.exists():
            self._cut(keep_through)
        # Line-buffered: each step's line is in the file as soon as it is written
        # (``tail -f`` follows the run); `sync` also flushes it to disk.
        self._file: TextIO = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115

    def _cut(self, keep_through: int) -> None:
        kept = [line for line in read_metrics(self.path) if line["step"] <= keep_through]
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.writelines(json.dumps(line, allow_nan=False) + "\n" for line in kept)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, self.path.stat().st_mode & 0o777)  # the file's own mode
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def write(self, line: Mapping[str, Any]) -> None:
        """Append one line (strict JSON: a non-finite number is written as null)."""
        self._file.write(json.dumps(strict_json(dict(line)), allow_nan=False) + "\n")

    def sync(self) -> None:
        """Flush to disk: a checkpoint saved after this finds every line of its steps."""
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        """Flush and close the file."""
        if not self._file.closed:
            self._file.flush()
            self._file.close()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class NoMetrics:
    """A metrics log that writes nothing: ranks other than 0 (rank 0 writes the file)."""

    def write(self, line: Mapping[str, Any]) -> None:
        return None

    def sync(self) -> None:
        return None
