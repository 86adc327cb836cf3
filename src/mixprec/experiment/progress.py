"""What `train` shows while it runs: a progress bar and one line per doctor finding."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from mixprec.doctor import Finding
    from mixprec.engine import Precision

__all__ = ["Progress", "finding_line"]


def finding_line(finding: Mapping[str, Any]) -> str:
    """A doctor finding (its dict form) as one line."""
    message = str(finding.get("message", "")).strip().splitlines()
    return (
        f"doctor: {finding.get('severity')} {finding.get('rule')} ({finding.get('where')}): "
        f"{message[0] if message else ''}"
    )


class Progress:
    """A tqdm bar on `stream` (loss, last held-out metric, loss scale, skipped steps,
    steps/s), with notes printed above it; nothing without a stream."""

    def __init__(self, stream: TextIO | None, *, start: int, total: int) -> None:
        self.stream = stream
        self.bar: Any = None
        self.metric = ""
        self.seen: set[str] = set()
        if stream is not None:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total,
                initial=start,
                unit="step",
                file=stream,
                mininterval=0.5,
                dynamic_ncols=True,
                leave=True,
            )

    def note(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=self.stream)

    def step(self, line: Mapping[str, Any], prec: Precision, metric_name: str) -> None:
        if self.bar is None:
            return
        if "eval_metric" in line:
            self.metric = f" | {metric_name} {line['eval_metric']:.4f}"
        scale = prec.stats.loss_scale
        text = f"loss {line['loss']:.4f}{self.metric}"
        if scale is not None:
            text += f" | scale {scale:g}"
        text += f" | skipped {prec.stats.skipped_steps}"
        self.bar.set_postfix_str(text, refresh=False)
        self.bar.update(1)

    def findings(self, findings: list[Finding]) -> None:
        """Print each finding of a rule not printed before (one line each)."""
        for finding in findings:
            if finding.rule not in self.seen:
                self.seen.add(finding.rule)
                self.note(finding_line(finding.to_dict()))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
