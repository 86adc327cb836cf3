"""The training recipe: the dict form of a compare contract, plus what a long run needs."""

from __future__ import annotations

import pytest

from mixprec.experiment import Contract, Recipe
from mixprec.experiment.plan import settings_for, workload_options
from mixprec.workloads import load_workload

#: Keys a contract and a recipe share, as YAML 1.1 reads them (``1e-2`` is a string).
SHARED = {
    "workload": "digits",
    "size": "tiny",
    "steps": "1e2",
    "lr": "1e-2",
    "batch_size": 16,
    "betas": [0.9, 0.95],
    "eval_every": 10,
    "probe_every": 5,
}


def test_a_recipe_reads_the_workload_and_training_keys_as_a_contract_does() -> None:
    recipe = Recipe.from_dict({**SHARED, "policy": "bf16-mixed"})
    contract = Contract.from_dict(SHARED)
    assert (
        recipe.train
        == contract.train
        == {
            "steps": 100,
            "lr": 0.01,
            "batch_size": 16,
            "betas": (0.9, 0.95),
        }
    )
    assert workload_options(recipe) == workload_options(contract) == {"size": "tiny"}
    workload = load_workload("digits", size="tiny")
    assert settings_for(recipe, workload) == settings_for(contract, workload)
    assert recipe.policy == "amp_bf16"  # an alias is stored as its preset


def test_the_dict_form_round_trips_with_train_overrides_as_top_level_keys() -> None:
    recipe = Recipe.from_dict(
        {**SHARED, "policy": "bf16_master", "seed": "3", "keep_last": None, "export_dtype": "bf16"}
    )
    data = recipe.to_dict()
    assert data["steps"] == 100 and data["betas"] == [0.9, 0.95] and "train" not in data
    assert data["seed"] == 3 and data["keep_last"] is None and data["export_dtype"] == "bf16"
    assert Recipe.from_dict(data) == recipe


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"stepz": 5}, r"unknown recipe keys \['stepz'\]; valid keys: \[.*'policy'"),
        ({"train": {"steps": 5}}, r"unknown recipe keys \['train'\]"),
        ({"policy": None}, "names no policy"),
        ({"policy": "bf16_mastr"}, "unknown precision policy"),
        ({"steps": 0}, "steps must be a positive int"),
        ({"seed": -1}, "seed must be an int >= 0"),
        ({"save_every": 0}, "save_every must be an int >= 1"),
        ({"keep_last": 0}, "keep_last must be an int >= 1 or null"),
        ({"export_dtype": "int8"}, "export_dtype must be one of fp32, bf16, fp16"),
        ({"size": 3}, "size must be a string"),
    ],
)
def test_bad_recipes_are_refused_naming_the_value(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Recipe.from_dict({"workload": "digits", "policy": "fp32", **changes})


def test_a_contract_still_refuses_recipe_only_keys() -> None:
    with pytest.raises(ValueError, match=r"unknown contract keys \['policy', 'save_every'\]"):
        Contract.from_dict({"workload": "digits", "policy": "fp32", "save_every": 5})


def test_an_infinite_clip_survives_recipe_json() -> None:
    """Found in review: a bf16_lean4 run (grad_clip_norm .inf) could not resume, since
    recipe.json is strict JSON and stored the inf as null, read back as the default 1.0."""
    import json

    from mixprec.experiment.records import strict_json

    recipe = Recipe.from_dict({**SHARED, "policy": "bf16_lean4", "grad_clip_norm": float("inf")})
    stored = json.loads(json.dumps(strict_json(recipe.to_dict()), allow_nan=False))
    again = Recipe.from_dict(stored)
    assert again.train["grad_clip_norm"] == float("inf") == recipe.train["grad_clip_norm"]
    assert again == recipe
