"""llm-finetune: a causal LM fine-tuned with Ray Train on text the data-prep flow prepared.

The story: check the parameters (no Ray yet), prepare the corpus (data-prep: quarantine and
cache as always), fine-tune it (Ray Data tokenizes, Ray Train trains; a re-run of the same flow
run resumes from its storage), score the base and the best checkpoint on the same held-out
prompts (perplexity, greedy exact match), record the run as an asset downstream of the
dataset. Each
checkpoint is a Hugging Face folder the LLM app serves as it is; a preemption notice gets a
just-in-time checkpoint, a lost worker a resume from the latest periodic one (docs/llm-finetune.md).
"""

from __future__ import annotations

from prefect import flow
from prefect.runtime import flow_run
from pydantic import BaseModel, Field

from prefect_ray_lifecycle.blocks import RayCluster
from prefect_ray_lifecycle.flows.data_prep import DataPrepParams, data_prep
from prefect_ray_lifecycle.tasks.finetune.config import (
    DEFAULT_STORAGE_ROOT,
    FineTuneInputError,
    FineTuneOutcome,
)
from prefect_ray_lifecycle.tasks.finetune.evaluate import (
    EVALUATION_KEY,
    LLMEvaluationSummary,
    evaluate_llm,
    publish_evaluation,
)
from prefect_ray_lifecycle.tasks.finetune.plan import plan_finetune, split_problem
from prefect_ray_lifecycle.tasks.finetune.report import record_run
from prefect_ray_lifecycle.tasks.finetune.train import run_finetune
from prefect_ray_lifecycle.tasks.params import Text
from prefect_ray_lifecycle.workloads.llm.evaluate import LLMEvaluationSettings
from prefect_ray_lifecycle.workloads.llm.models import ModelLocation
from prefect_ray_lifecycle.workloads.llm.train.settings import (
    CorpusSettings,
    FailureSettings,
    ResourceSettings,
    TrainingSettings,
)


class FineTuneParams(BaseModel):
    """What to fine-tune, on what text, how, and where its checkpoints live."""

    data: DataPrepParams = Field(
        description="The corpus, as the data-prep flow takes it: JSON lines, CSV or parquet of "
        "a text column or of prompt and completion columns (split_key: a row id). Bad rows "
        "and empty texts go to its quarantine; an unchanged corpus is reused from its cache."
    )
    corpus: CorpusSettings = Field(
        default_factory=CorpusSettings, description="Which columns hold the text."
    )
    base: ModelLocation | None = Field(
        default=None,
        description="The base causal LM: a Hugging Face folder (every node reads it), a URI of "
        "one, or an MLflow model version; empty: the tiny Llama (workloads.llm.tiny), built "
        "once under storage_root.",
    )
    training: TrainingSettings = Field(
        default_factory=TrainingSettings, description="Steps, batch, schedule, checkpoints."
    )
    resources: ResourceSettings = Field(
        default_factory=ResourceSettings, description="Workers and the CPU share of each part."
    )
    failures: FailureSettings = Field(
        default_factory=FailureSettings, description="Failure and preemption budgets."
    )
    storage_root: Text = Field(
        default=DEFAULT_STORAGE_ROOT,
        description="Where runs live: a folder every Ray node reaches (NFS, a shared volume) or "
        "a pyarrow filesystem URI (s3://bucket/prefix, file://...); a flow run's fine-tune "
        "lives under its id, so a retry or re-run of it resumes from its checkpoints.",
    )
    evaluation: LLMEvaluationSettings | None = Field(
        default_factory=LLMEvaluationSettings,
        description="The held-out prompts the base and the best checkpoint are scored on "
        "(perplexity, greedy exact match): generated from the corpus templates, or a file of "
        "prompt/completion rows never trained on; empty: no evaluation.",
    )


class FineTuneResult(BaseModel):
    outcome: FineTuneOutcome = Field(description="The run: checkpoints, resumes, losses, chart.")
    dataset_asset_key: str = Field(description="The prepared dataset it trained on.")
    dataset_fingerprint: str = Field(description="Its content fingerprint.")
    asset_key: str = Field(description="The fine-tune run's Prefect asset.")
    flow_run_id: str | None = Field(description="This flow run (its storage folder's name).")
    base_label: str = Field("", description="The base model, as people name it.")
    base_evaluation: LLMEvaluationSummary | None = Field(
        None, description="The base's held-out figures (before the fine-tune)."
    )
    evaluation: LLMEvaluationSummary | None = Field(
        None, description="The best checkpoint's held-out figures, under the same protocol."
    )


def prepare(params: FineTuneParams, cluster: RayCluster, run_id: str | None):
    """The plan (every check that needs no Ray), the evaluation protocol and the prepared
    corpus: what a fine-tune and a sweep of it start with."""
    data = params.data
    try:
        protocol = params.evaluation.protocol() if params.evaluation else None
    except ValueError as error:
        raise FineTuneInputError(str(error)) from None
    plan = plan_finetune(
        data.source,
        data.expected_schema,
        data.required_columns,
        params.corpus,
        params.base,
        params.training,
        params.resources,
        params.failures,
        params.storage_root,
        run_id,
    )
    dataset = data_prep(
        data.model_copy(update={"required_columns": plan.required_columns}), ray_cluster=cluster
    )
    if problem := split_problem(dataset.rows_train, dataset.rows_eval, dataset.rows_quarantined):
        raise FineTuneInputError(problem)
    return plan, protocol, dataset


def before_and_after(plan, protocol, checkpoint: str):
    """The base and `checkpoint` scored on the same held-out prompts, shown on the flow run:
    (base, fine-tuned), or (None, None) without a protocol."""
    if protocol is None:
        return None, None
    before = evaluate_llm(plan.spec.base, protocol)
    after = evaluate_llm(checkpoint, protocol)
    publish_evaluation(
        {f"base ({plan.base_label})": before, "fine-tuned (best checkpoint)": after},
        EVALUATION_KEY,
        "Held-out evaluation before and after the fine-tune",
    )
    print(
        f"held-out perplexity {before.perplexity:.2f} -> {after.perplexity:.2f}, exact "
        f"match {before.exact_match:.2f} -> {after.exact_match:.2f} ({after.examples} prompts)"
    )
    return before, after


@flow(name="llm-finetune", log_prints=True)
def llm_finetune(params: FineTuneParams, ray_cluster: RayCluster | None = None) -> FineTuneResult:
    """Fine-tune a causal LM on Ray Train (see FineTuneParams); return its best checkpoint,
    scored with the base on the same held-out prompts.

    Args:
        params: The corpus, base model, training, resources, failure budgets, storage and
            held-out evaluation.
        ray_cluster: Where to run; an embedded local Ray when empty.
    """
    cluster = ray_cluster or RayCluster()
    run_id = str(flow_run.id) if flow_run.id else None
    plan, protocol, dataset = prepare(params, cluster, run_id)
    outcome = run_finetune(plan, dataset.train_path, dataset.eval_path, cluster)
    print(
        f"eval loss {outcome.base_eval_loss} (base) -> {outcome.best_eval_loss}; best "
        f"checkpoint {outcome.best_checkpoint}; {len(outcome.resumes)} resumes"
    )
    before, after = before_and_after(plan, protocol, outcome.best_checkpoint_local)
    asset = record_run(
        outcome,
        dataset.asset_key,
        {
            "flow_run_id": run_id,
            "base": plan.base_label,
            "fingerprint": dataset.fingerprint,
            "exact_match": after.exact_match if after else None,
            "perplexity": after.perplexity if after else None,
        },
    )
    return FineTuneResult(
        outcome=outcome,
        dataset_asset_key=dataset.asset_key,
        dataset_fingerprint=dataset.fingerprint,
        asset_key=asset,
        flow_run_id=run_id,
        base_label=plan.base_label,
        base_evaluation=before,
        evaluation=after,
    )
