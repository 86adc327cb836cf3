"""Every run of a contract: the order of runs, resuming, added seeds, the output folder.

For each seed the baseline runs first, then the candidates. A run whose record
exists with the same fingerprint is reused instead of redone. When a
candidate's gap is inconclusive after the contract's seeds, the baseline and
that candidate run one more seed at a time, up to ``max_seeds``, where
eligibility is judged once (`verdicts.gap_verdict`); a candidate rejected on the
way stops. Stored runs of more seeds are used too: a decision reads every stored
seed of the contract. The output
folder gets ``contract.json`` first and is locked while runs write into it. A
stored record is reused only when it was measured on the same hardware (device,
torch version and threads, `hardware.DeviceFacts.key`): timings from elsewhere
are not comparable with the runs made here.

Training one run is not done here: `run_all` takes the run function
(`mixprec.experiment.runner.run_one`), so the order of runs can be tested
without training anything.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol, TextIO

from mixprec.experiment.contract import Contract
from mixprec.experiment.decision import decide
from mixprec.experiment.hardware import DeviceFacts, device_facts
from mixprec.experiment.plan import RunSettings, evaluation_steps, settings_dict, step_caps_for
from mixprec.experiment.records import RunRecord, load_records, record_path, write_json_atomic
from mixprec.experiment.summary import tail_start
from mixprec.workloads import Workload

__all__ = ["CONTRACT_FILE", "RunFn", "check_out_dir", "exclusive", "run_all"]

#: Written first into the output folder: what the experiment is (so `report` can
#: render an interrupted folder that has no results.json yet).
CONTRACT_FILE = "contract.json"


class RunFn(Protocol):
    """Train one policy with one seed and return its record (`runner.run_one`)."""

    def __call__(
        self,
        workload: Workload,
        policy_name: str,
        seed: int,
        settings: RunSettings,
        *,
        fingerprint: str,
        device: str,
        run_steps: int | None,
        eval_at: frozenset[int],
        progress: Callable[[int, float], None] | None,
        should_stop: Callable[[], bool] | None,
    ) -> RunRecord: ...


def check_out_dir(out_dir: Path) -> None:
    """Create `out_dir` and prove it writable, or raise a one-line ValueError."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ValueError(f"--out {out_dir} exists and is not a folder; choose a folder") from None
    except NotADirectoryError:
        raise ValueError(f"--out {out_dir} lies under a file; choose a folder") from None
    except OSError as exc:
        raise ValueError(f"--out {out_dir} cannot be created: {exc.strerror or exc}") from None
    try:
        with tempfile.TemporaryFile(dir=out_dir):
            pass
    except OSError as exc:
        raise ValueError(f"--out {out_dir} is not writable: {exc.strerror or exc}") from None


def run_all(
    contract: Contract,
    out_dir: Path,
    workload: Workload,
    settings: RunSettings,
    *,
    run: RunFn,
    device: str,
    stream: TextIO | None,
    on_record: Callable[[RunRecord, bool], None] | None,
    should_stop: Callable[[], bool] | None,
    hardware: DeviceFacts | None = None,
) -> list[RunRecord]:
    """Run (or reuse) every run of `contract` into `out_dir`, holding its lock.

    Args:
        contract: what to run.
        out_dir: an existing, writable folder (`check_out_dir`).
        workload: the workload every run trains.
        settings: the resolved settings of every run (`plan.settings_for`).
        run: trains one run (`runner.run_one`).
        device: the (resolved) device to train on.
        stream: where progress goes (None: silent).
        on_record: called with each record and whether it was reused from disk.
        should_stop: passed to each run (the command line's Ctrl-C).
        hardware: the facts of `device` here (default: `device_facts(device)`); a stored
            record measured elsewhere is redone. Records written before mixprec
            recorded hardware carry none and are reused, unless the contract names a
            `target_device` (then they are redone: where they ran decides).

    Returns:
        The records, in the order they ran (baseline first per seed).
    """
    here = device_facts(device) if hardware is None else hardware
    caps = step_caps_for(contract, settings.train.steps, device)
    eval_at = evaluation_steps(settings.train.steps, caps, settings.eval_every)
    with exclusive(out_dir):
        write_json_atomic(
            out_dir / CONTRACT_FILE,
            {
                "contract": contract.to_dict(),
                "workload_description": workload.description,
                "metric_name": workload.metric_name,
                "higher_is_better": workload.higher_is_better,
                "workload_steps": workload.defaults.steps,
                "settings": settings_dict(settings),
            },
        )
        found, skipped, trace_notes = load_records(out_dir)
        if stream is not None:
            for line in skipped:
                print(f"  skipping a bad run record (its run is redone): {line}", file=stream)
            for line in trace_notes:
                print(f"  {line}", file=stream)
        existing = {(r.policy, r.seed): r for r in found}
        records: list[RunRecord] = []

        # The held-out evaluations the decision reads: a run's own step and the start of
        # its last fifth, and for the baseline those of every capped candidate too.
        compared = {settings.train.steps, *caps.values()}
        judged_at = {0, *compared, *(tail_start(c) for c in compared)}

        def reusable(name: str, seed: int) -> RunRecord | None:
            """The stored finished run of `name` and `seed` under this contract, measured
            here (a record that does not say where it ran counts as here, unless the
            contract names a target: then only a run here can say it), with every
            held-out evaluation the decision reads (a candidate capped after the
            baseline ran needs the baseline evaluated at the cap)."""
            old = existing.get((name, seed))
            run_steps = caps.get(name, settings.train.steps)
            fingerprint = contract.run_fingerprint(name, seed, run_steps)
            if old is None or old.fingerprint != fingerprint or not old.ok:
                return None
            needs = (
                judged_at if name == contract.baseline else {0, run_steps, tail_start(run_steps)}
            )
            if any(math.isnan(old.heldout_at(s)) for s in needs if s <= old.steps):
                return None
            return None if elsewhere(old) else old

        def elsewhere(old: RunRecord) -> bool:
            """`old` was measured on other hardware (or does not say, and a target is
            named: then only a run here can say)."""
            if old.device is None:
                return contract.target_device is not None
            return old.device.key != here.key

        def run_seed(seed: int, names: tuple[str, ...]) -> None:
            for name in names:
                run_steps = caps.get(name, settings.train.steps)
                fingerprint = contract.run_fingerprint(name, seed, run_steps)
                reused = reusable(name, seed)
                if reused is not None:
                    records.append(reused)
                    _print_run(reused, True, stream)
                    if on_record is not None:
                        on_record(reused, True)
                    continue
                old = existing.get((name, seed))
                if (
                    stream is not None
                    and old is not None
                    and old.ok
                    and old.fingerprint == fingerprint
                    and elsewhere(old)
                ):
                    where = "not recorded" if old.device is None else old.device.key
                    print(
                        f"  {name} seed {seed} was measured on {where}, not "
                        f"{here.key}: running it again here",
                        file=stream,
                    )
                with _bar(run_steps, f"{name} seed {seed}", stream) as update:
                    record = run(
                        workload,
                        name,
                        seed,
                        settings,
                        fingerprint=fingerprint,
                        device=device,
                        run_steps=run_steps,
                        eval_at=eval_at,
                        progress=update,
                        should_stop=should_stop,
                    )
                write_json_atomic(record_path(out_dir, name, seed), record.to_dict())
                records.append(record)
                _print_run(record, False, stream)
                if on_record is not None:
                    on_record(record, False)

        for seed in range(contract.seeds):
            run_seed(seed, contract.policies)
        for seed in range(contract.seeds, contract.seed_limit):
            decision = decide(
                records,
                contract,
                higher_is_better=workload.higher_is_better,
                stands_for=workload.defaults.steps,
            )
            pending = tuple(decision.inconclusive)
            if not pending:
                break
            if stream is not None:
                print(
                    f"  seed {seed} for {', '.join(pending)} (neither rejected nor judged yet: "
                    f"eligibility is judged at max_seeds {contract.seed_limit})",
                    file=stream,
                )
            run_seed(seed, (contract.baseline, *pending))
        # Every stored seed of the contract is evidence: seeds beyond those run here
        # (an earlier run with a larger max_seeds) join the decision.
        have = {(r.policy, r.seed) for r in records}
        for name, seed in sorted(existing, key=lambda key: (key[1], key[0])):
            if (name, seed) in have or name not in contract.policies:
                continue
            old = reusable(name, seed)
            if old is not None:
                records.append(old)
                _print_run(old, True, stream)
                if on_record is not None:
                    on_record(old, True)
        return records


@contextlib.contextmanager
def exclusive(out_dir: Path, command: str = "compare") -> Iterator[None]:
    """Hold `out_dir/.lock` while this process writes there: a second `compare` (or
    `train`, named by `command`) into the same folder refuses instead of doing the
    work twice."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: no lock
        yield
        return
    path = out_dir / ".lock"
    with open(path, "a+", encoding="utf-8") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            raise ValueError(
                f"{out_dir} is in use by another mixprec {command} ({holder}); wait for it to "
                "finish or choose another --out"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()}\n")
        handle.flush()
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _print_run(record: RunRecord, reused: bool, stream: TextIO | None) -> None:
    """One line per finished (or reused) run: all a log keeps of its progress."""
    if stream is None:
        return
    end = "(reused)" if reused else "" if record.ok else f"FAILED: {record.error}"
    print(
        f"  {record.policy:<14} seed {record.seed}  {record.steps} steps  "
        f"{record.wall_time_s:.1f}s  {record.throughput.get('steps_per_s', math.nan):.1f} "
        f"steps/s  held-out loss {record.heldout_loss:.4f}  {record.metric_name} "
        f"{record.metric:.4f}  skipped {record.skipped_steps}  {end}".rstrip(),
        file=stream,
    )


@contextlib.contextmanager
def _bar(total: int, desc: str, stream: TextIO | None) -> Iterator[Callable[[int, float], None]]:
    """A tqdm bar on a terminal, cleared when the run ends; nothing on a file or pipe
    (a log gets `_print_run`'s line instead of carriage-returned redraws)."""
    if stream is None or not stream.isatty():
        yield lambda step, loss: None
        return
    from tqdm import tqdm

    with tqdm(
        total=total, desc=desc, file=stream, leave=False, mininterval=0.5, dynamic_ncols=True
    ) as bar:

        def update(step: int, loss: float) -> None:
            bar.update(1)
            if step % 10 == 0:
                bar.set_postfix_str(f"loss {loss:.4f}", refresh=False)

        yield update
