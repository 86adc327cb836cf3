"""NeMo recipe values read as NeMo AutoModel's loader reads them (issue 17).

NeMo's ``ConfigNode`` passes every scalar except ``_target_`` and ``*_fn`` through
``translate_value`` (``nemo_automodel/components/config/loader.py``): the strings
None/none/true/True/false/False, then ``ast.literal_eval``, else the string; and
it resolves ``${VAR}``, ``${VAR,default}``, ``${oc.env:VAR}`` and ``$VAR`` from
the environment of the run, which the doctor cannot know.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mixprec.doctor import check_file, load_config
from mixprec.doctor.frontends.nemo_values import Unresolved, translate_value

from .cases import write

RECIPE = """
model:
  _target_: nemo_automodel.NeMoAutoModelForCausalLM.from_pretrained
  torch_dtype: {dtype}
step_scheduler:
  max_steps: {steps}
optimizer:
  _target_: torch.optim.AdamW
"""


@pytest.mark.parametrize(
    ("raw", "value"),
    [
        ("None", None),
        ("none", None),
        ("true", True),
        ("True", True),
        ("False", False),
        ("false", False),
        ("1e-4", 1e-4),
        ("20", 20),
        ("[1, 2]", [1, 2]),
        ("{'a': 1}", {"a": 1}),
        ("torch.bfloat16", "torch.bfloat16"),
        ("__import__('os').system('x')", "__import__('os').system('x')"),  # never run
        ("NULL", "NULL"),  # not one of NeMo's symbols, not a Python literal
        (3, 3),
        ("x" * 1001, "x" * 1001),
    ],
)
def test_translate_value_is_nemos(raw: object, value: object) -> None:
    assert translate_value(raw) == value


@pytest.mark.parametrize("token", ["${STEPS}", "${oc.env:STEPS,100}", "$STEPS", "run_${X}"])
def test_environment_references_are_unresolved(token: str) -> None:
    assert translate_value(token) == Unresolved(token)


def test_max_steps_none_is_none_not_an_error(tmp_path: Path) -> None:
    # examples/llm_seq_cls/glue/mrpc_roberta_lora.yaml: step_scheduler.max_steps: None
    path = write(tmp_path, RECIPE.format(dtype="bfloat16", steps="None"))
    facts = load_config(path)
    assert facts.steps is None and facts.unknown == ()
    assert [f.rule for f in check_file(path)] == ["optimizer-state-16bit"]


def test_quoted_numbers_and_booleans_read_as_nemo_reads_them(tmp_path: Path) -> None:
    path = write(tmp_path, RECIPE.format(dtype="bfloat16", steps="'500'"))
    assert load_config(path).steps == 500
    findings = check_file(path)
    assert findings[0].severity == "warning"  # a short run (at most 1000 steps)


def test_an_environment_reference_is_unknown_never_guessed(tmp_path: Path) -> None:
    path = write(tmp_path, RECIPE.format(dtype="${oc.env:DTYPE,float32}", steps="${STEPS}"))
    facts = load_config(path)
    assert facts.param_dtype is None and facts.steps is None
    assert any("model.torch_dtype" in u and "${oc.env:DTYPE,float32}" in u for u in facts.unknown)
    assert any(u.startswith(f"{path}:6 step_scheduler.max_steps") for u in facts.unknown)
    assert check_file(path) == []  # the storage dtype is unknown: nothing judged on it


def test_targets_are_not_translated(tmp_path: Path) -> None:
    path = write(tmp_path, RECIPE.format(dtype="bfloat16", steps=100000))
    facts = load_config(path)
    assert facts.optimizer is not None and facts.optimizer.name == "torch.optim.AdamW"
