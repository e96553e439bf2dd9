"""The held-out evaluation of a fine-tune (workloads.llm.evaluate) as a Prefect task: the base
and the best checkpoint, or a registered version, scored the same way; and its table on the
flow run."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, Field

from prefect_ray_lifecycle.tasks.finetune.report import ARTIFACT_ERRORS
from prefect_ray_lifecycle.workloads.llm.evaluate import LLMEvalProtocol, evaluate_model
from prefect_ray_lifecycle.workloads.llm.models import ModelLocation, local_model

__all__ = ["EVALUATION_KEY", "LLMEvaluationSummary", "evaluate_llm", "publish_evaluation"]

EVALUATION_KEY = "llm-evaluation"


class LLMEvaluationSummary(BaseModel):
    """A model's figures on the held-out prompts of one protocol."""

    perplexity: float = Field(description="exp of the mean token NLL on the held-out texts.")
    exact_match: float = Field(description="Share of held-out prompts answered exactly (greedy).")
    examples: int = Field(description="Held-out prompts scored.")
    tokens: int = Field(description="Tokens the perplexity averages.")
    protocol: str = Field(description="The protocol (JSON), as recorded with a version.")
    answers: list[list[str]] = Field(
        default_factory=list, description="A few (prompt, reference, greedy answer) triples."
    )

    @property
    def eval_protocol(self) -> LLMEvalProtocol:
        return LLMEvalProtocol.from_json(self.protocol)


@task(name="evaluate-llm", cache_policy=NO_CACHE)
def evaluate_llm(model: str | ModelLocation, protocol: LLMEvalProtocol) -> LLMEvaluationSummary:
    """Perplexity and greedy exact match of a Hugging Face causal LM (a folder here, or a
    location fetched once) on the protocol's held-out prompts, in this process (transformers'
    `generate`, one prompt at a time: see workloads.llm.evaluate)."""
    folder = Path(model) if isinstance(model, str) else local_model(model)
    found = evaluate_model(folder, protocol)
    return LLMEvaluationSummary(
        perplexity=found.perplexity,
        exact_match=found.exact_match,
        examples=found.examples,
        tokens=found.tokens,
        protocol=protocol.to_json(),
        answers=[list(a) for a in found.answers],
    )


def publish_evaluation(rows: dict[str, LLMEvaluationSummary | None], key: str, title: str) -> None:
    """A table of evaluations (e.g. base, fine-tuned; or challenger, champion) on the flow run;
    an artifact that cannot be written is logged, never fatal."""
    from prefect.artifacts import create_markdown_artifact
    from prefect.logging import get_run_logger

    lines = [
        f"## {title}",
        "",
        "| model | perplexity | exact match | prompts |",
        "|---|---|---|---|",
    ]
    for label, row in rows.items():
        if row is not None:
            lines.append(
                f"| {label} | {row.perplexity:.3f} | {row.exact_match:.2f} | {row.examples} |"
            )
    sample = next((r for r in rows.values() if r is not None and r.answers), None)
    if sample is not None:
        lines += ["", "Protocol: `" + sample.protocol + "`"]
    try:
        create_markdown_artifact("\n".join(lines) + "\n", key=key, description=title)
    except ARTIFACT_ERRORS as error:
        get_run_logger().warning("could not write the %s artifact: %r", key, error)
