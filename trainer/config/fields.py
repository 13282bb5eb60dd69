"""What every config section is built from: the Section base class, the value types its fields take, and how a
value and a field's allowed values are written in a message ("got 1.5, out of range; allowed: a number > 0 and
<= 1"). A leaf of the config package: the schema's validators use these, and so do the messages about it.
"""

from __future__ import annotations

import types
import typing
from typing import Annotated, Any, Literal

import annotated_types
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic.fields import FieldInfo

Placement = Literal["cpu", "gpu"]
LossAggregation = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
# verl also accepts k1, k2 and k3 (Schulman's names) for kl, mse and low_var_kl: trainer.algorithms.kl_penalty
# maps them, and a test keeps this list equal to the estimators it knows.
KLEstimator = Literal["kl", "abs", "mse", "low_var_kl", "k1", "k2", "k3"]

# The values a config sets and the live settings (trainer.config.live.LiveSettings) may change while the run goes
# on: each bound is written here once, and both the schema and the live settings take these types.
MemoryThreshold = Annotated[float, Field(gt=0.0, le=1.0)]
LayerMinimum = Annotated[int, Field(ge=0)]
GpuSampleInterval = Annotated[float, Field(ge=0.05, le=60.0)]
PcieSampleInterval = Annotated[float, Field(ge=1.0, le=600.0)]
LogLevel = Literal["debug", "info", "warning", "error"]
# verl's experiment trackers (trainer.logger); trainer/tracking.py runs them. Each but console and file needs a
# library of the `trackers` extra (trainer/config/environment.py checks that it is installed).
TrackerBackend = Literal["console", "wandb", "tensorboard", "mlflow", "swanlab", "file"]


def describe_allowed(annotation: Any, field: FieldInfo | None) -> str:
    """What a field takes, in words: "an integer >= 1", "a number > 0 and <= 1", "'gae' or 'grpo'"."""
    annotation = unwrap_optional(annotation)
    if typing.get_origin(annotation) is Literal:
        return " or ".join(repr(choice) for choice in typing.get_args(annotation))
    if typing.get_origin(annotation) in (list, tuple):
        return "a list of strings" if typing.get_args(annotation) == (str,) else "a list"
    noun = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(annotation, "")
    bounds = []
    for constraint in field.metadata if field is not None else ():
        for name, symbol in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            if isinstance(constraint, getattr(annotated_types, name.capitalize())):
                bounds.append(f"{symbol} {getattr(constraint, name):g}")
    return " ".join(filter(None, [noun, " and ".join(bounds)])) or "a value of the right type"


def show(value: Any) -> str:
    """A value as the user typed it in YAML."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def unwrap_optional(annotation: Any) -> Any:
    """`X` of `X | None`; any other annotation as it is."""
    arguments = [argument for argument in typing.get_args(annotation) if argument is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(arguments) == 1:
        return arguments[0]
    return annotation


def section_type(annotation: Any) -> type[Section] | None:
    """The Section class a field holds, or None for a setting."""
    annotation = unwrap_optional(annotation)
    return annotation if isinstance(annotation, type) and issubclass(annotation, Section) else None


def is_mapping(annotation: Any) -> bool:
    """Whether a field is a free-form mapping (override_config), which takes any key below it."""
    return typing.get_origin(unwrap_optional(annotation)) is dict


def _number_type(annotation: Any) -> bool:
    return unwrap_optional(annotation) in (int, float)


class Section(BaseModel):
    """A config section: unknown keys are errors, field docstrings are the documentation."""

    # coerce_numbers_to_str: `experiment_name: 7` or `trainer.experiment_name=7` means the name "7".
    # allow_inf_nan=False: YAML reads `.inf` and `.nan` as floats, and no setting here wants them.
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True,
                              coerce_numbers_to_str=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _plain_yaml_values(cls, value: Any, info: ValidationInfo) -> Any:
        """An empty YAML section (`critic:` with every key commented out) reads as null: treat it as {}.

        Pydantic's lax mode would read `true` as 1 for a number; a boolean given for a number is a mistake.
        """
        field = cls.model_fields[info.field_name or ""]  # "*" validators always run for a field
        annotation = field.annotation
        if value is None and section_type(annotation) is not None:
            return {}
        if isinstance(value, bool) and _number_type(annotation):
            allowed = describe_allowed(annotation, field)
            raise ValueError(f"got {show(value)}, a boolean; allowed: {allowed}")
        return value
