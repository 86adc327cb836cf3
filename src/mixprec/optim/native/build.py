"""Building the native kernel (`step_cpu.cpp`) with the system C++ compiler and
caching it per machine: flags (with the rules' and formats' codes from their
registries, `format_defines`), the cache key, the manifest that guards against loading a
truncated library, the file lock that lets processes starting together build
once. `library()` returns the loaded `NativeLibrary`."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import mixprec.formats
from mixprec.formats import master_specs, moment_specs
from mixprec.optim.native.binding import SOURCE, BuildInfo, NativeLibrary, NativeUnavailableError
from mixprec.optim.rules import RULES
from mixprec.userdirs import user_cache_dir

_COMMON_FLAGS = (
    "-std=c++17",
    "-O3",
    "-fno-math-errno",  # lets sqrt vectorize; results are unchanged (IEEE sqrt)
    "-fno-trapping-math",
    "-ffp-contract=off",  # no FMA contraction: every product is rounded, as in eager
    "-fPIC",
    "-shared",
)
#: The formats' codecs the kernel includes (``formats/masters/<name>.h``).
FORMAT_HEADERS: tuple[Path, ...] = tuple(sorted(Path(mixprec.formats.__file__).parent.rglob("*.h")))
_X86 = platform.machine().lower() in ("x86_64", "amd64")
#: Flag sets tried in order until one compiles.
FLAG_SETS: tuple[tuple[str, ...], ...] = tuple(
    flags + _COMMON_FLAGS
    for flags in (
        ("-march=native", "-mprefer-vector-width=512", "-fopenmp") if _X86 else None,
        ("-march=native", "-fopenmp"),
        ("-fopenmp",),
        (),  # no OpenMP: one thread
    )
    if flags is not None
)


def format_defines() -> tuple[str, ...]:
    """The kernel's rule and format codes, from their registries (their one source):
    one ``-DMIXPREC_RULE_<NAME>=<code>`` per update rule (`Rule.code`) and one
    ``-DMIXPREC_MASTER_<NAME>=<code>`` or ``-DMIXPREC_MOMENTS_<NAME>=<code>`` per
    registered format with a ``kernel_code``, which the C++ enums are defined by."""
    kinds = (("MASTER", master_specs()), ("MOMENTS", moment_specs()))
    rules = tuple(f"-DMIXPREC_RULE_{r.name.upper()}={r.code}" for r in RULES.values())
    return rules + tuple(
        f"-DMIXPREC_{kind}_{spec.name.upper()}={spec.kernel_code}"
        for kind, specs in kinds
        for spec in specs
        if spec.kernel_code is not None
    )


def flag_sets() -> tuple[tuple[str, ...], ...]:
    """`FLAG_SETS`, each with the `format_defines` (rule and format codes)."""
    return tuple(flags + format_defines() for flags in FLAG_SETS)


def cache_key(compiler: str, flag_sets: Sequence[tuple[str, ...]]) -> str:
    """What a built library depends on: the source and the format headers it includes,
    the compiler's version, the CPU and the flag sets tried (the format codes among
    them)."""
    digest = hashlib.sha256()
    for path in (SOURCE, *FORMAT_HEADERS):
        digest.update(f"{path.name}\n".encode())
        digest.update(path.read_bytes())
    for part in (_version(compiler).encode(), _cpu_signature().encode()):
        digest.update(part)
    digest.update(repr(tuple(flag_sets)).encode())
    return digest.hexdigest()[:20]


def enabled() -> bool:
    """False when ``MIXPREC_NATIVE=0`` (or ``false``/``off``) turns the kernel off."""
    return os.environ.get("MIXPREC_NATIVE", "1").strip().lower() not in ("0", "false", "off", "no")


def cache_dir() -> Path:
    """Where built libraries live: ``native/`` in mixprec's cache folder
    (``$MIXPREC_CACHE_DIR``, else the user cache, `mixprec.userdirs.user_cache_dir`)."""
    return user_cache_dir() / "native"


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    raise NativeUnavailableError(
        "no C++ compiler found (set CXX, or install g++); steps use torch.compile or eager instead"
    )


def _cpu_signature() -> str:
    # -march=native code is only valid where the same instructions exist: key the
    # cache on the CPU's model and feature flags (a VM may mask features of a model).
    found: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in ("model name", "flags", "Features", "CPU part") and key not in found:
                    found[key] = line.strip()
    except OSError:
        pass
    if found:
        return "\n".join(found[k] for k in sorted(found))
    return f"{platform.machine()} {platform.processor()}"


def _version(compiler: str) -> str:
    try:
        out = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=30, check=False
        )
        return out.stdout.splitlines()[0] if out.stdout else compiler
    except (OSError, subprocess.SubprocessError):
        return compiler


_lock = threading.Lock()


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _manifest(target: Path) -> Path:
    """Beside each library: its flags, size and SHA-256, written at build."""
    return target.with_suffix(".json")


def _verified_flags(target: Path) -> tuple[str, ...] | None:
    """The build flags of a cached library whose size and checksum match its manifest,
    or None (a truncated, partly written or foreign file must never be mapped: a
    truncated shared object kills the process with SIGBUS when it is loaded)."""
    try:
        meta = json.loads(_manifest(target).read_text(encoding="utf-8"))
        if target.stat().st_size != meta["size"] or _digest(target) != meta["sha256"]:
            return None
        return tuple(str(f) for f in meta["flags"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_manifest(target: Path, tmp: Path, flags: tuple[str, ...]) -> None:
    meta = {"flags": list(flags), "size": tmp.stat().st_size, "sha256": _digest(tmp)}
    fd, meta_tmp = tempfile.mkstemp(suffix=".json", dir=target.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(meta, f)
    os.replace(meta_tmp, _manifest(target))


def _build(target: Path, compiler: str, flag_sets: Sequence[tuple[str, ...]]) -> BuildInfo:
    target.parent.mkdir(parents=True, exist_ok=True)
    errors = []
    for flags in flag_sets:
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        t0 = time.perf_counter()
        try:
            out = subprocess.run(
                [compiler, *flags, str(SOURCE), "-o", tmp],
                capture_output=True,
                text=True,
                timeout=600,
                check=False,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            out = None
            errors.append(f"{' '.join(flags)}: {exc}")
        if out is not None and out.returncode == 0:
            _write_manifest(target, Path(tmp), flags)
            os.replace(tmp, target)  # atomic: concurrent builders write the same bytes
            return BuildInfo(target, compiler, flags, time.perf_counter() - t0)
        Path(tmp).unlink(missing_ok=True)
        if out is not None:
            errors.append(f"{' '.join(flags)}: {out.stderr.strip()[-400:]}")
    raise NativeUnavailableError(f"{compiler} could not build {SOURCE.name}: " + " | ".join(errors))


@functools.cache
def library() -> NativeLibrary:
    """Build (once per machine) and load the kernel.

    Raises:
        NativeUnavailableError: turned off by ``MIXPREC_NATIVE=0``, no compiler, or
            every flag set failed to build (the message has the compiler output).
    """
    if not enabled():
        raise NativeUnavailableError("turned off by MIXPREC_NATIVE=0")
    with _lock:
        compiler = _compiler()
        tried = flag_sets()
        target = _writable_cache_dir() / f"step_cpu-{cache_key(compiler, tried)}.so"
        # Processes starting together (torchrun ranks) wait for one build.
        with _file_lock(target.with_suffix(".lock")):
            if target.exists():
                flags = _verified_flags(target)
                if flags is not None:
                    try:
                        return NativeLibrary(BuildInfo(target, compiler, flags, 0.0))
                    except OSError:
                        pass
                target.unlink(missing_ok=True)  # truncated, foreign or unverified: rebuild
            return NativeLibrary(_build(target, compiler, tried))


def _writable_cache_dir() -> Path:
    """`cache_dir()`, or a per-user temporary folder (with one warning) when it cannot be
    created or written (a read-only home, say)."""
    preferred = cache_dir()
    try:
        preferred.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=preferred):
            pass
        return preferred
    except OSError as exc:
        uid = os.getuid() if hasattr(os, "getuid") else "user"
        fallback = Path(tempfile.gettempdir()) / f"mixprec-{uid}" / "native"
        try:
            fallback.mkdir(parents=True, exist_ok=True)
        except OSError as again:
            raise NativeUnavailableError(
                f"no writable cache for the native kernel ({preferred}: {exc}; {fallback}: "
                f"{again}); set MIXPREC_CACHE_DIR"
            ) from None
        warnings.warn(
            f"cannot write the native kernel cache {preferred} ({exc.strerror or exc}); "
            f"building in {fallback} instead (set MIXPREC_CACHE_DIR to choose)",
            RuntimeWarning,
            stacklevel=4,
        )
        return fallback


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on `path` (POSIX ``flock``; elsewhere no lock:
    builds still rename atomically, they may only be repeated)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
