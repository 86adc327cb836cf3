"""Many config files at once: one odd file never stops a batch.

`check_paths` judges every file it is given (directories are walked, globs
expanded) and turns what stops one file into a ``config-unreadable`` finding for
that file alone: a file that cannot be read (missing, not valid YAML, no front
end claims it) and a value of an unexpected type (``max_steps: [1, 2]``).
Unknown keys never fail a file; the front ends ignore them. Files reached
through a directory or a glob whose format no front end knows are skipped and
counted, not reported; a directory or glob under which no file was judged is a
``config-unreadable`` of its own (a CI step pointed at the wrong folder).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from mixprec.doctor.facts import TrainingFacts
from mixprec.doctor.findings import Finding
from mixprec.doctor.frontends.dispatch import FormatMismatchError, check_config, detect_format
from mixprec.doctor.frontends.document import NotAMappingError, read_config
from mixprec.doctor.frontends.frontend import DeviceArg

__all__ = [
    "CONFIG_SUFFIXES",
    "BatchReport",
    "FileReport",
    "check_paths",
    "expand_paths",
    "unreadable",
]

#: File suffixes a directory walk or a glob reads as configs (others are skipped).
CONFIG_SUFFIXES: tuple[str, ...] = (".yaml", ".yml", ".json", ".toml")

#: The format of a file no front end read.
UNKNOWN_FORMAT = "unknown"

_GLOB_CHARS = frozenset("*?[")


@dataclass(frozen=True, kw_only=True)
class FileReport:
    """What the doctor made of one file.

    Attributes:
        source: the file path.
        format: the front end that read it, or ``"unknown"``.
        findings: the findings, errors first (one ``config-unreadable`` when the
            file could not be judged).
        readable: False when the file could not be read at all (missing, not valid
            YAML, not a mapping, no known format): the CLI then exits 2.
        facts: the facts the rules judged, None when the file could not be judged.
    """

    source: str
    format: str
    findings: tuple[Finding, ...]
    readable: bool = True
    facts: TrainingFacts | None = None


@dataclass(frozen=True, kw_only=True)
class BatchReport:
    """Every file judged, the files skipped for having no known format, and the
    broken symbolic links skipped (with ``skip_unknown``) while walking."""

    files: tuple[FileReport, ...]
    skipped: tuple[str, ...] = ()
    broken_links: tuple[str, ...] = ()

    @property
    def all_readable(self) -> bool:
        """Whether every file could be read."""
        return all(f.readable for f in self.files)


def _split_where(source: str, message: str) -> tuple[str, str]:
    """``("file:line key", reason)`` from a ``"file:line key: reason"`` message."""
    if message.startswith(source):
        rest = message[len(source) :]
        cut = rest.find(": ")
        if cut >= 0:
            return source + rest[:cut], rest[cut + 2 :]
    return source, message


def unreadable(source: str, exc: BaseException) -> Finding:
    """The ``config-unreadable`` finding for `source`, from the error that stopped it."""
    # The source is cut off first: a file name may hold a newline (one line each).
    where, reason = _split_where(source, str(exc).strip() or type(exc).__name__)
    reason = reason.splitlines()[0]
    return Finding(
        rule="config-unreadable",
        severity="error",
        where=where,
        message=f"not judged: {reason}",
        evidence={"error": type(exc).__name__, "reason": reason},
        fix="fix the value or the file (or pass --format); the other files were judged",
    )


def _walk(root: Path) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            yield Path(dirpath) / name


def _glob(pattern: str) -> list[Path]:
    """The paths `pattern` matches, each once. ``**`` recurses without following
    symbolic links to directories (pathlib's rule; `glob.glob` follows them, so a
    link to a parent folder made it match the same file forever)."""
    parts = Path(pattern).parts
    first = next(i for i, part in enumerate(parts) if _GLOB_CHARS & set(part))
    root = Path(*parts[:first]) if first else Path()
    seen: set[Path] = set()
    out: list[Path] = []
    for match in sorted(root.glob(str(Path(*parts[first:])))):
        real = match.resolve()
        if real not in seen:
            seen.add(real)
            out.append(match)
    return out


def expand_paths(args: Iterable[str | os.PathLike[str]]) -> list[tuple[Path, bool]]:
    """Each file to judge and whether it was named explicitly.

    Directories are walked (hidden ones skipped); an argument with ``*?[`` that
    names no existing path is a glob (``**`` recurses). A glob matching nothing
    stays as named, and `check_paths` reports it as matching nothing (exit code 2).
    """
    out: list[tuple[Path, bool]] = []
    for arg in args:
        path = Path(arg)
        text = os.fspath(arg)
        if not path.exists() and _GLOB_CHARS & set(text):
            matches = _glob(text)
            if matches:
                for match in map(Path, matches):
                    found = _walk(match) if match.is_dir() else iter((match,))
                    out.extend((f, False) for f in found)
                continue
        if path.is_dir():
            out.extend((f, False) for f in _walk(path))
        else:
            out.append((path, True))
    return out


def _broken_link(path: Path) -> bool:
    """A symbolic link to nothing, with a config suffix (others are skipped anyway)."""
    return path.suffix.lower() in CONFIG_SUFFIXES and path.is_symlink() and not path.exists()


def _no_match(pattern: str) -> str:
    return (
        f"{pattern}: no file matches the glob {pattern!r}; check the pattern and the "
        "directory it starts from ('**' matches any depth; quote the glob so the shell "
        "passes it unexpanded)"
    )


def _no_config(arg: str | os.PathLike[str], skipped: int, broken_links: int) -> str:
    held = [
        f"{n} {what}{'s' if n != 1 else ''} skipped{why}"
        for n, what, why in (
            (skipped, "file", ": of no known format"),
            (broken_links, "broken symbolic link", ""),
        )
        if n
    ]
    return (
        f"{os.fspath(arg)}: no config file found ({', '.join(held) or 'it holds no file'}); "
        "check the path, or name the config files"
    )


def _unread(source: str, exc: BaseException) -> FileReport:
    finding = unreadable(source, exc)
    return FileReport(source=source, format=UNKNOWN_FORMAT, findings=(finding,), readable=False)


def _check_one(
    path: Path, *, explicit: bool, format: str, device: DeviceArg, skip_unknown: bool
) -> FileReport | None:
    source = str(path)
    if explicit and _GLOB_CHARS & set(source) and not os.path.lexists(path):
        return _unread(source, FileNotFoundError(_no_match(source)))
    skippable = skip_unknown or not explicit
    if skippable and path.suffix.lower() not in CONFIG_SUFFIXES:
        return None
    try:
        doc = read_config(path)
    except NotAMappingError as exc:
        return None if skippable else _unread(source, exc)
    except (OSError, ValueError) as exc:
        return _unread(source, exc)
    name = format
    if format == "auto":
        try:
            name = detect_format(doc.data, source=source)
        except ValueError as exc:
            return None if skippable else _unread(source, exc)
    try:
        fmt, facts, findings = check_config(doc, format=name, device=device)
    except FormatMismatchError as exc:  # --format names another format than the file's
        unknown = exc.detected is None
        return None if not explicit or (unknown and skip_unknown) else _unread(source, exc)
    except (ValueError, TypeError) as exc:
        return FileReport(source=source, format=name, findings=(unreadable(source, exc),))
    return FileReport(source=source, format=fmt, findings=tuple(findings), facts=facts)


def check_paths(
    paths: Sequence[str | os.PathLike[str]],
    *,
    format: str = "auto",
    device: DeviceArg = None,
    skip_unknown: bool = False,
    should_stop: Callable[[], bool] | None = None,
) -> BatchReport:
    """Judge every config file under `paths` (files, directories, globs).

    Args:
        paths: files, directories (walked) and globs.
        format: ``"auto"`` or a front end's name, for every file.
        device: the device the runs target (see `check_file`).
        skip_unknown: also skip explicitly named files that are well-formed but of
            no known format: no front end claims them, or their top level is not a
            mapping (by default those are ``config-unreadable``; files found by
            walking a directory or expanding a glob are always skipped). A file
            that cannot be read or parsed is ``config-unreadable`` either way,
            except a broken symbolic link met while walking or expanding a glob,
            which `skip_unknown` skips and counts (`BatchReport.broken_links`). A
            directory or glob under which no file is judged (empty, or every file
            skipped) is ``config-unreadable`` itself, with or without `skip_unknown`.
        should_stop: asked before each file; when it answers True the batch ends
            there and reports the files judged so far (the CLI passes its Ctrl-C flag).

    Raises:
        ValueError: for an unknown `format` (nothing else: every per-file problem
            is a ``config-unreadable`` finding).
    """
    from mixprec.doctor.frontends.dispatch import FORMATS

    if format not in FORMATS:
        raise ValueError(f"unknown config format {format!r}; valid: {', '.join(FORMATS)}")
    files: list[FileReport] = []
    skipped: list[str] = []
    broken: list[str] = []
    for arg in paths:
        found = expand_paths([arg])
        judged, passed, links = len(files), len(skipped), len(broken)
        for path, explicit in found:
            if should_stop is not None and should_stop():
                return BatchReport(
                    files=tuple(files), skipped=tuple(skipped), broken_links=tuple(broken)
                )
            if skip_unknown and not explicit and _broken_link(path):
                broken.append(str(path))  # found by a walk or a glob: skipped and counted
                continue
            report = _check_one(
                path, explicit=explicit, format=format, device=device, skip_unknown=skip_unknown
            )
            if report is None:
                skipped.append(str(path))
            else:
                files.append(report)
        if not any(explicit for _, explicit in found) and len(files) == judged:
            # A folder or a glob with nothing judged: a CI step pointed at the wrong place.
            why = _no_config(arg, len(skipped) - passed, len(broken) - links)
            files.append(_unread(os.fspath(arg), FileNotFoundError(why)))
    return BatchReport(files=tuple(files), skipped=tuple(skipped), broken_links=tuple(broken))
