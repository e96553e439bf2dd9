"""Pydantic models of dataset prep: row filters, the plan made before any Ray work, the
prepared dataset's result, and the bad-row verdict."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from prefect_ray_lifecycle.workloads.data.pipeline import PipelineSpec, RowFilter

ColumnType = Literal["int64", "float64", "string", "bool", "timestamp"]
FilterOp = Literal["==", "!=", "<", "<=", ">", ">=", "in", "not in"]
# The default share of bad rows a run may quarantine before it fails.
DEFAULT_MAX_BAD_FRACTION = 0.01
DEFAULT_EVAL_FRACTION = 0.1


class RowFilterParam(BaseModel):
    """Keep only rows where `column op value` holds; rows with a null there are dropped."""

    column: str = Field(description="A column of the schema.")
    op: FilterOp = Field(description="Comparison; 'in' and 'not in' take a list value.")
    value: Any = Field(description="The value (a list for 'in' and 'not in') to compare with.")

    @model_validator(mode="after")
    def _list_for_membership(self) -> RowFilterParam:
        if self.op in ("in", "not in") and not isinstance(self.value, list):
            raise ValueError(
                f"filter on {self.column!r}: {self.op!r} needs a list value, got {self.value!r}"
            )
        return self


class DatasetPlan(BaseModel):
    """What the flow process learnt about the job before any Ray work."""

    source: str = Field(description="The source as given.")
    source_uri: str = Field(description="The source as a URI, for lineage.")
    format: str = Field(description="parquet, csv or json (lines).")
    paths: list[str] = Field(description="Source files, in order.")
    schema_: dict[str, str] = Field(alias="schema", description="Column -> checked type.")
    required: list[str] = Field(description="Columns that must not be null.")
    filters: list[RowFilterParam] = Field(description="Row filters.")
    transform: str | None = Field(description="`module:function` applied with map_batches.")
    transform_kwargs: dict[str, Any] = Field(description="Keyword arguments of the transform.")
    batch_format: Literal["pandas", "pyarrow"] = Field(description="Transform batch kind.")
    split_key: str = Field(description="Column hashed for the train/eval split.")
    eval_fraction: float = Field(description="Share of keys that go to eval.")
    max_bad_fraction: float = Field(description="Largest share of quarantined rows allowed.")
    output: str = Field(description="Output location as given.")
    output_uri: str = Field(description="The output as a URI: the asset key.")
    fingerprint: str = Field(description="Content fingerprint of source, transform, parameters.")

    model_config = {"populate_by_name": True}

    def spec(self) -> PipelineSpec:
        return PipelineSpec(
            format=self.format,
            schema=self.schema_,
            required=tuple(self.required),
            filters=tuple(RowFilter(f.column, f.op, f.value) for f in self.filters),
            transform=self.transform,
            transform_kwargs=self.transform_kwargs,
            batch_format=self.batch_format,
            split_key=self.split_key,
            eval_fraction=self.eval_fraction,
        )


class DatasetResult(BaseModel):
    """A prepared dataset: where it is, what went in and out, and its fingerprint for the
    training and registration steps to record."""

    output: str = Field(description="The dataset folder (train/, eval/, quarantine/).")
    train_path: str = Field(description="Parquet folder of the train split.")
    eval_path: str = Field(description="Parquet folder of the eval split.")
    quarantine_path: str = Field(description="Parquet folder of the bad rows, with reasons.")
    asset_key: str = Field(description="The Prefect asset this dataset materialises.")
    source: str = Field(description="The source it was made from.")
    fingerprint: str = Field(
        description="Content fingerprint (source bytes, transform "
        "source, parameters): equal fingerprints, equal datasets."
    )
    rows_in: int = Field(description="Rows in the source.")
    rows_train: int = Field(description="Rows written to train.")
    rows_eval: int = Field(description="Rows written to eval.")
    rows_quarantined: int = Field(description="Rows sent to the quarantine.")
    rows_filtered: int = Field(description="Good rows the filters left out.")
    reasons: dict[str, int] = Field(description="Quarantined rows per reason.")
    output_schema: dict[str, str] = Field(description="Columns and arrow types of the output.")
    cache_hit: bool = Field(
        default=False,
        description="True when this run reused the "
        "published dataset with the same fingerprint and did no Ray work.",
    )


class Verdict(BaseModel):
    """A pass or fail decision and the reason for it."""

    passed: bool
    reason: str
