"""The inference schema contract: every training-config field is classified, the derived
``InferenceConfig`` keeps only inference fields, and bundle versions are checked."""

from __future__ import annotations

import logging

import pytest
from pydantic import Field, ValidationError, create_model

from asrforge.bundle.schema import (
    ALL,
    BUNDLE_VERSION,
    INFERENCE_FIELDS,
    TRAINING_ONLY,
    InferenceConfig,
    check_version,
    parse_inference_config,
    unclassified_fields,
)
from asrforge.config import SHAPE_FIELDS, DataConfig, ModelConfig, OptimConfig, TrainConfig
from asrforge.errors import CheckpointNotSupportedError

pytestmark = pytest.mark.fast


def _bundle_facts(**extra) -> dict:
    return {
        "asrforge_version": "0.1.0",
        "weights": "raw",
        "multilingual": True,
        "languages": ["en"],
        "features": {"feature_size": 80, "chunk_length": 30},
        "model": {},
        "data": {},
        "eval": {},
        **extra,
    }


def test_every_training_field_is_classified_once() -> None:
    assert unclassified_fields() == []


def test_the_guard_names_a_field_added_without_a_decision() -> None:
    """A copy of TrainConfig with new fields: in a split section, at the top, and in a section
    that is training-only as a whole (which needs no decision)."""
    model = create_model("ModelConfigPlus", __base__=ModelConfig, beam_size=(int, 1))
    optim = create_model("OptimConfigPlus", __base__=OptimConfig, lookahead=(bool, False))
    grown = create_model(
        "TrainConfigPlus",
        __base__=TrainConfig,
        model=(model, Field(default_factory=model)),
        optim=(optim, Field(default_factory=optim)),
        language_model=(str | None, None),
    )
    problems = unclassified_fields(grown)
    assert [p.split(":")[0] for p in problems] == ["model.beam_size", "language_model"]
    assert "in neither TRAINING_ONLY nor INFERENCE_FIELDS" in problems[0]

    # deciding makes the guard pass again
    training = {**TRAINING_ONLY, "language_model": ALL}
    inference = {**INFERENCE_FIELDS, "model": {**INFERENCE_FIELDS["model"], "beam_size": ALL}}
    assert unclassified_fields(grown, training, inference) == []


def test_the_guard_names_fields_in_both_sets_and_stale_names() -> None:
    both = {**INFERENCE_FIELDS, "data": {**INFERENCE_FIELDS["data"], "batch_size": ALL}}
    assert unclassified_fields(TrainConfig, TRAINING_ONLY, both) == [
        "data.batch_size: in both TRAINING_ONLY and INFERENCE_FIELDS"
    ]
    stale = {**INFERENCE_FIELDS, "eval": {"max_new_tokens": ALL, "beam": ALL}}
    assert unclassified_fields(TrainConfig, TRAINING_ONLY, stale) == [
        "eval.beam: listed in INFERENCE_FIELDS but EvalConfig has no such field"
    ]
    whole = {**INFERENCE_FIELDS, "optim": ALL}
    assert unclassified_fields(TrainConfig, TRAINING_ONLY, whole) == [
        "optim: in both TRAINING_ONLY and INFERENCE_FIELDS"
    ]


def test_inference_config_keeps_inference_fields_only() -> None:
    fields = InferenceConfig.model_fields
    assert set(fields["model"].annotation.model_fields) == {
        *SHAPE_FIELDS,
        "vocab_size",
        "attn_implementation",
    }
    assert set(fields["data"].annotation.model_fields) == {"task", "language_tokens"}
    assert not {"output_dir", "seed", "optim", "train", "selection", "checkpoint"} & set(fields)
    # the field docstrings come along
    derived = fields["model"].annotation.model_fields["max_source_positions"]
    assert derived.description == ModelConfig.model_fields["max_source_positions"].description
    assert derived.description and "50 per second" in derived.description

    cfg = InferenceConfig.model_validate(_bundle_facts(model={"d_model": 384}))
    assert cfg.model.d_model == 384 and cfg.bundle_version == BUNDLE_VERSION
    for bad in ({"model": {"dropout": 0.1}}, {"data": {"path": "/x"}}, {"optim": {}}):
        with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
            InferenceConfig.model_validate(_bundle_facts(**bad))
    assert DataConfig.model_fields["path"].is_required()  # training needs it; a bundle does not


def test_versions_major_newer_or_older_are_refused_naming_the_need() -> None:
    raw = _bundle_facts(bundle_version="2.3.0", asrforge_version="4.0.0")
    with pytest.raises(CheckpointNotSupportedError) as e:
        check_version(raw, "b")
    msg = str(e.value)
    assert "bundle_version 2.3.0" in msg and "asrforge >= 4.0.0" in msg and "format 2.x" in msg
    assert f"up to {BUNDLE_VERSION}" in msg
    with pytest.raises(CheckpointNotSupportedError, match="older format"):
        check_version(_bundle_facts(bundle_version="0.9.0"), "b")
    for bad in ("1.0", "one", None, "1.0.0-rc1"):
        with pytest.raises(CheckpointNotSupportedError, match="MAJOR.MINOR.PATCH"):
            check_version(_bundle_facts(bundle_version=bad), "b")


def test_a_newer_minor_version_drops_unknown_fields_with_a_warning(caplog) -> None:
    major, minor = BUNDLE_VERSION.split(".")[:2]
    newer = f"{major}.{int(minor) + 1}.0"  # the next minor version, whatever ours is
    raw = _bundle_facts(bundle_version=newer, vad={"threshold": 0.5}, model={"beam": 5})
    with caplog.at_level(logging.WARNING, logger="asrforge.bundle.schema"):
        cfg = parse_inference_config(raw, "b")
    assert cfg.bundle_version == newer
    assert "vad" in caplog.text and "model.beam" in caplog.text
    # the same fields in a bundle of our own minor version are errors
    with pytest.raises(CheckpointNotSupportedError, match="vad: unknown field"):
        parse_inference_config({**raw, "bundle_version": BUNDLE_VERSION}, "b")
