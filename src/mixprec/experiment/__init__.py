"""Precision experiments (the same workload under several policies, gates, a decision, a
report) and long training runs of one policy (`train`)."""

from mixprec.experiment.compare import Rerendered, Results, compare, rerender, run_contract
from mixprec.experiment.contract import DEFAULT_CANDIDATES, Contract
from mixprec.experiment.decision import Decision, Verdict, decide
from mixprec.experiment.gates import Gates
from mixprec.experiment.recipe import Recipe
from mixprec.experiment.records import RunRecord, read_records
from mixprec.experiment.report import Report, render, terminal_table
from mixprec.experiment.runner import RunSettings, run_experiment, run_one, settings_for
from mixprec.experiment.summary import PolicySummary, summarize
from mixprec.experiment.training import TrainResult, train

__all__ = [
    "DEFAULT_CANDIDATES",
    "Contract",
    "Decision",
    "Gates",
    "PolicySummary",
    "Recipe",
    "Report",
    "Rerendered",
    "Results",
    "RunRecord",
    "RunSettings",
    "TrainResult",
    "Verdict",
    "compare",
    "decide",
    "read_records",
    "render",
    "rerender",
    "run_contract",
    "run_experiment",
    "run_one",
    "settings_for",
    "summarize",
    "terminal_table",
    "train",
]
