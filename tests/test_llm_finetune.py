"""The llm-finetune flow against the session's Ray head, a second raylet and the Prefect server.

One fine-tune run carries the recovery tests: its flow process runs as a worker would run it
(an API-created flow run in a process of its own); a training worker is killed with SIGKILL
after the first periodic checkpoint; later the second node is drained with the preemption
reason (a Spot reclaim notice) and taken away once the run has left it; then the flow
process is killed and the same flow run runs again. Each test reads what that run recorded:
its result, its history and its checkpoints; its held-out evaluation, and the registration of
its best checkpoint (and of a worse one, not promoted). Bad inputs fail before any Ray work,
naming the field. The pure pieces are in test_llm_finetune_pure.py."""

from __future__ import annotations

import base64
import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from chart_checks import png_size
from prefect.client.schemas.filters import ArtifactFilter, FlowRunFilter
from prefect.states import Crashed

from deployments.testing.watch import actors_gone
from deployments.worker_node import alive_actors, alive_nodes, drain
from deployments.worker_node import stop as stop_node
from prefect_ray_lifecycle.blocks import RayCluster
from prefect_ray_lifecycle.flows.llm_finetune import FineTuneParams, llm_finetune
from prefect_ray_lifecycle.tasks.finetune.chart import draw_finetune
from prefect_ray_lifecycle.tasks.finetune.config import FineTuneInputError
from prefect_ray_lifecycle.tasks.finetune.plan import (
    plan_finetune,
)
from prefect_ray_lifecycle.workloads.llm import corpus
from prefect_ray_lifecycle.workloads.llm.models import (
    MODEL_CACHE_ENV,
    ModelLocation,
    local_model,
)
from prefect_ray_lifecycle.workloads.llm.tiny import build_tiny_llm
from prefect_ray_lifecycle.workloads.llm.train.history import (
    CONTROLLER_START,
    read_history,
    summarize,
)
from prefect_ray_lifecycle.workloads.llm.train.settings import (
    CorpusSettings,
    FailureSettings,
    ResourceSettings,
    TrainingSettings,
)
from prefect_ray_lifecycle.workloads.llm.train.state import STATE_DIR, read_state
from tests import flow_process, multinode

CHECKPOINT_EVERY = 20
TOTAL_STEPS = 160
MICRO_BATCH = 8
WORKERS = 2
TRAINING = {
    "total_steps": TOTAL_STEPS,
    "checkpoint_every_steps": CHECKPOINT_EVERY,
    "eval_every_steps": CHECKPOINT_EVERY,
    "warmup_steps": 10,
    "micro_batch_size": MICRO_BATCH,
    "jit_margin_s": 2.0,
}
CORPUS_EXAMPLES = 2000
DRAIN_DEADLINE_S = 10
# Measured on the disturbed run below (2 CPUs, three runs): eval loss 6.95 (the tiny Llama's
# random weights: ln 1024) -> 0.975-0.992 after 160 steps, a drop of 5.96-5.98; the floor is
# the noise words, drawn at random. Asserted with room for another machine's arithmetic.
EVAL_LOSS_MARGIN = 5.5
# The held-out evaluation of the same run (50 generated prompts never trained on, greedy):
# see test_the_fine_tune_raises_exact_match_and_lowers_held_out_perplexity.
BASE_EXACT_MATCH_AT_MOST = 0.05
EXACT_MATCH_AT_LEAST = 0.8
PERPLEXITY_RATIO_AT_MOST = 0.7  # the goal: at least 30 % lower


def test_an_mlflow_llm_version_is_a_base(stack, tiny_base, source, tmp_path, monkeypatch):
    """LLM versions are Hugging Face folders registered as MLflow model artifacts: the plan
    fetches and checks one as it would a folder (workers fetch it the same way, once per
    node)."""
    from mlflow import MlflowClient

    monkeypatch.setenv(MODEL_CACHE_ENV, str(tmp_path / "cache"))
    client = MlflowClient(tracking_uri=stack.mlflow_uri)
    name = f"tiny-base-{os.getpid()}"
    run = client.create_run(client.create_experiment(name))
    client.log_artifacts(run.info.run_id, str(tiny_base), artifact_path="hf")
    client.create_registered_model(name)
    client.create_model_version(name, f"{run.info.artifact_uri}/hf", run_id=run.info.run_id)
    base = ModelLocation(
        mlflow={"tracking_uri": stack.mlflow_uri, "model_name": name, "version": "1"}
    )
    plan = plan_finetune.fn(
        str(source),
        None,
        ["id"],
        CorpusSettings(),
        base,
        TrainingSettings(),
        ResourceSettings(),
        FailureSettings(),
        str(tmp_path / "runs"),
        "run-1",
    )
    assert plan.base_label == f"MLflow model {name} version 1"
    assert plan.spec.base == base and plan.spec.layout == "prompt_completion"
    assert plan.required_columns == ["completion", "id", "prompt"]
    assert plan.experiment_path == str(tmp_path / "runs" / "run-1" / "finetune")
    first = local_model(base)
    assert (first / "config.json").is_file()
    # The name deleted and registered again: its version 1 is another model now, and a node
    # that fetched the first one must not serve that copy for it.
    client.delete_registered_model(name)
    other = shutil.copytree(tiny_base, tmp_path / "other")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "note": "registered again"}))
    again = client.create_run(run.info.experiment_id)
    client.log_artifacts(again.info.run_id, str(other), artifact_path="hf")
    client.create_registered_model(name)
    client.create_model_version(name, f"{again.info.artifact_uri}/hf", run_id=again.info.run_id)
    second = local_model(base)
    assert json.loads((second / "config.json").read_text()).get("note") == "registered again"
    assert "note" not in json.loads((first / "config.json").read_text())
    with pytest.raises(FineTuneInputError, match=r"training.seq_len: 4096 tokens is over"):
        plan_finetune.fn(
            str(source),
            None,
            [],
            CorpusSettings(),
            base,
            TrainingSettings(seq_len=4096),
            ResourceSettings(),
            FailureSettings(),
            str(tmp_path / "runs"),
            None,
        )


# --- against the session's services --------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory) -> Path:
    return build_tiny_llm(tmp_path_factory.mktemp("tiny-llama") / "model")


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("corpus") / "src"
    corpus.write_corpus(folder, CORPUS_EXAMPLES, seed=0)
    return folder


def not_a_causal_lm(tmp_path: Path) -> str:
    folder = tmp_path / "bert"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps({"architectures": ["BertForMaskedLM"], "model_type": "bert"})
    )
    (folder / "tokenizer.json").write_text("{}")
    return str(folder)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        (
            "no text column",
            r"corpus.text, or corpus.prompt and corpus.completion: the data has no text column "
            r"'text' and no 'prompt' or 'completion' \(it has \['id', 'body'\]\)",
        ),
        (
            "empty corpus",
            r"data.source '.*empty' has no rows \(1 json files\): the corpus is empty",
        ),
        ("not a causal LM", r"base: .*bert is not a causal language model \(architectures: "),
        (
            "too long",
            r"training.seq_len: 1024 tokens is over the model's limit of 512 "
            r"\(max_position_embeddings\) \(base .*model\)",
        ),
    ],
)
def test_bad_inputs_fail_naming_the_field_before_any_ray_work(
    prefect_api, tmp_path, tiny_base, source, case, message
):
    data = {"source": str(source), "output": str(tmp_path / "prepared"), "split_key": "id"}
    base, training = {"path": str(tiny_base)}, {}
    if case == "no text column":
        (tmp_path / "bodies").mkdir()
        (tmp_path / "bodies" / "a.jsonl").write_text('{"id": "1", "body": "text"}\n')
        data["source"] = str(tmp_path / "bodies")
    elif case == "empty corpus":
        (tmp_path / "empty").mkdir()
        (tmp_path / "empty" / "a.jsonl").write_text("")
        data["source"] = str(tmp_path / "empty")
    elif case == "not a causal LM":
        base = {"path": not_a_causal_lm(tmp_path)}
    else:
        training = {"seq_len": 1024}
    params = FineTuneParams(
        data=data, base=base, training=training, storage_root=str(tmp_path / "runs")
    )
    # Nothing listens there: any Ray work would fail otherwise.
    with pytest.raises(FineTuneInputError, match=message):
        llm_finetune(params=params, ray_cluster=RayCluster(address="127.0.0.1:1"))
    assert not (tmp_path / "prepared").exists() and not (tmp_path / "runs").exists()


def start_flow_run(stack, flow_run_id, parameters: dict, script: Path) -> flow_process.FlowProcess:
    return flow_process.start_flow_run(
        stack,
        "prefect_ray_lifecycle.flows.llm_finetune:llm_finetune",
        flow_run_id,
        parameters,
        script,
    )


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL to the process and everything it started (its session), and reap it."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)


def attempts(records: list[dict]) -> list[list[dict]]:
    """Step records by attempt (a worker-group start), in order."""
    groups: list[list[dict]] = []
    for record in records:
        if "step" in record:
            if not groups or groups[-1][0]["attempt"] != record["attempt"]:
                groups.append([])
            groups[-1].append(record)
    return groups


def last_step(records: list[dict]) -> int:
    return max((r["step"] for r in records if "step" in r), default=-1)


def own_lines(output: str, keep: int = 60) -> str:
    """The flow process's own last lines, without what Ray forwards from its workers."""
    own = [line for line in output.splitlines() if not re.match(r"(\x1b\[\d+m)*\(", line)]
    return "\n".join(own[-keep:])


def snapshot_states(records: list[dict], states: dict[int, object]) -> None:
    """Each checkpoint's TrainState, read while it is there (only the best are kept)."""
    for record in records:
        if record.get("checkpoint_kind") and record["step"] not in states:
            with contextlib.suppress(FileNotFoundError):  # already evicted: not kept
                states[record["step"]] = read_state(record["checkpoint_path"])


def wait_for(
    history: Path, ready, process: flow_process.FlowProcess, what: str, states: dict, timeout=300.0
):
    """The history once `ready(records)` holds; fails naming `what` if the run ends first."""
    deadline = time.monotonic() + timeout
    while True:
        records = read_history(str(history))
        snapshot_states(records, states)
        if records and ready(records):
            return records
        if process.poll() is not None:
            output = own_lines(process.output())
            raise AssertionError(f"the flow run ended before {what}: {output}")
        if time.monotonic() >= deadline:
            # What the flow process said is the only clue to where it stood: stop it first.
            kill_group(process)
            output = own_lines(process.output())
            last = records[-1] if records else "no history yet"
            raise AssertionError(f"timed out waiting for {what} (last record: {last}): {output}")
        time.sleep(0.3)


@pytest.fixture(scope="module")
def disturbed(stack, prefect_client, tiny_base, source, tmp_path_factory):
    """The run the recovery tests read (see the module's docstring): what it returned, its
    history, and what the test did to it, when."""
    work = tmp_path_factory.mktemp("finetune")
    parameters = FineTuneParams(
        data={"source": str(source), "output": str(work / "prepared"), "split_key": "id"},
        base={"path": str(tiny_base)},
        training=TRAINING,
        # One worker per node while there are two: the drain takes one of them.
        resources={"placement_strategy": "SPREAD"},
        failures={"max_failures": 2, "preemption_poll_s": 1},
        storage_root=str(work / "runs"),
    ).model_dump(mode="json")
    flow_run = prefect_client.create_flow_run(llm_finetune, parameters={"params": parameters})
    history = work / "runs" / str(flow_run.id) / "finetune" / "history.jsonl"
    states: dict[int, object] = {}
    seen: dict = {
        "flow_run_id": str(flow_run.id),
        "work": work,
        "states": states,
        "parameters": parameters,
    }
    script = work / "run_existing.py"
    with contextlib.ExitStack() as cleanup:
        node = cleanup.enter_context(multinode.second_node(stack, "ft"))
        nodes = alive_nodes(stack.ray_dashboard_url, stack.ray_token)
        seen["head"] = next(n["node_id"] for n in nodes if n["node_id"] != node.node_id)
        seen["second_node"] = node.node_id
        first = start_flow_run(stack, flow_run.id, {"params": parameters}, script)
        cleanup.callback(kill_group, first)

        # 1. A training worker killed without warning, after the first periodic checkpoint.
        records = wait_for(
            history,
            lambda rs: last_step(rs) >= CHECKPOINT_EVERY + 4,
            first,
            "the first periodic checkpoint",
            states,
            # Data prep, the worker group's start and 24 steps (about 60 s here): a CI run
            # at half this machine's speed saw no record in 300 s once (its output then went
            # to a pipe nobody read, which may have stopped it; see flow_process).
            timeout=600.0,
        )
        victim = alive_actors(stack.ray_dashboard_url, stack.ray_token, "RayTrainWorker")[0]
        os.kill(victim["pid"], signal.SIGKILL)
        seen["worker_killed_after"] = last_step(read_history(str(history)))
        seen["nodes_before_kill"] = attempts(records)[0][0]["worker_nodes"]

        # 2. The second node drained with the preemption reason, and taken away.
        records = wait_for(
            history,
            lambda rs: len(attempts(rs)) == 2 and last_step(rs) >= attempts(rs)[-1][0]["step"] + 5,
            first,
            "the resume after the killed worker",
            states,
        )
        seen["nodes_after_kill"] = attempts(records)[-1][0]["worker_nodes"]
        drain(stack.ray_address, node.node_id, DRAIN_DEADLINE_S, stack.client_env(), "test")
        drained_at = time.time()
        seen["drained_after"] = last_step(records)
        wait_for(
            history,
            lambda rs: any(r.get("checkpoint_kind") == "jit" for r in rs),
            first,
            "the just-in-time checkpoint",
            states,
        )
        records = wait_for(
            history,
            lambda rs: len(attempts(rs)) == 3,
            first,
            "the resume after the preemption",
            states,
        )
        assert time.time() >= drained_at + DRAIN_DEADLINE_S  # Ray Train waited for it
        seen["nodes_after_preemption"] = attempts(records)[-1][0]["worker_nodes"]
        stop_node(node.process)  # the reclaim: the node goes (the run has left it)

        # 3. The flow process killed after the next periodic checkpoint, and run again.
        def checkpointed_since_preemption(rs: list[dict]) -> bool:
            runs = attempts(rs)
            return (
                len(runs) == 3
                and any(r.get("checkpoint_kind") == "periodic" for r in runs[-1])
                # Between the poll that sees this and the kill a few more steps run (a step
                # takes about 0.2 s here, the poll 0.3 s): killed at 17, a CI run reached the
                # next checkpoint first and lost nothing. Early in the interval, it cannot.
                and 3 <= last_step(rs) % CHECKPOINT_EVERY <= CHECKPOINT_EVERY // 2
            )

        wait_for(
            history,
            checkpointed_since_preemption,
            first,
            "a checkpoint after the preemption",
            states,
        )
        kill_group(first)
        # The flow process was the run's Ray driver: Ray ends its Train controller and workers
        # after it, and until then a worker may finish a step and record it (a CI run read
        # 106 here and the run had reached 107). The attempt's history is whole once they are
        # gone.
        actors_gone(stack.ray_dashboard_url, stack.ray_token, "RayTrainWorker")
        records = read_history(str(history))
        seen["flow_killed_after"] = last_step(records)
        seen["checkpoint_before_flow_kill"] = max(
            r["step"] for r in records if r.get("checkpoint_kind")
        )
        prefect_client.set_flow_run_state(
            flow_run.id, Crashed(message="killed by the test"), force=True
        )
        second = start_flow_run(stack, flow_run.id, {"params": parameters}, script)
        cleanup.callback(kill_group, second)
        output, _ = second.communicate(timeout=600)
        assert second.returncode == 0, own_lines(output)
    seen["result"] = flow_process.result_of(output)
    seen["records"] = read_history(str(history))
    snapshot_states(seen["records"], states)
    return seen


def resumes(disturbed) -> dict[str, dict]:
    return {r["kind"]: r for r in disturbed["result"]["outcome"]["resumes"]}


def test_the_fine_tune_lowers_held_out_eval_loss_against_the_base(disturbed, prefect_client):
    outcome = disturbed["result"]["outcome"]
    assert outcome["steps"] == TOTAL_STEPS
    assert outcome["base_eval_loss"] == pytest.approx(math.log(1024), abs=0.1)  # random weights
    assert outcome["base_eval_loss"] - outcome["best_eval_loss"] >= EVAL_LOSS_MARGIN
    assert prefect_client.read_flow_run(disturbed["flow_run_id"]).state.is_completed()


def test_a_worker_killed_without_warning_resumes_from_the_latest_periodic_checkpoint(disturbed):
    resume = resumes(disturbed)["worker failure"]
    killed_after = disturbed["worker_killed_after"]
    latest = killed_after - killed_after % CHECKPOINT_EVERY
    assert resume["checkpoint_kind"] == "periodic" and resume["from_step"] == latest
    assert resume["reached_step"] >= killed_after
    assert 0 <= resume["lost_steps"] <= CHECKPOINT_EVERY
    assert resume["replayed_blocks"] == resume["lost_steps"] * MICRO_BATCH * WORKERS
    assert any(r.get("event") == "worker-failure" for r in disturbed["records"])


def test_a_drained_node_gets_a_jit_checkpoint_and_the_run_resumes_on_the_node_left(disturbed):
    outcome = disturbed["result"]["outcome"]
    (notice,) = outcome["preemptions"]
    assert notice["nodes"] == [disturbed["second_node"]]
    assert disturbed["second_node"] in disturbed["nodes_after_kill"]  # a worker was there
    resume = resumes(disturbed)["preemption"]
    # Resumed from the just-in-time checkpoint at the step it was at: no step lost.
    assert resume["checkpoint_kind"] == "jit"
    assert resume["from_step"] == resume["reached_step"] and resume["lost_steps"] == 0
    (jit,) = [c for c in outcome["checkpoints"] if c["kind"] == "jit"]
    state = disturbed["states"][jit["step"]]  # read from the checkpoint while it was kept
    assert (state.step, state.kind) == (resume["from_step"], "jit")
    assert jit["step"] >= notice["step"] >= disturbed["drained_after"]
    assert set(disturbed["nodes_after_preemption"]) == {disturbed["head"]}


def test_a_killed_flow_process_runs_again_from_its_storage(disturbed):
    outcome = disturbed["result"]["outcome"]
    assert outcome["resumed"] is True
    resume = resumes(disturbed)["flow re-run"]
    assert resume["from_step"] == disturbed["checkpoint_before_flow_kill"]
    assert resume["reached_step"] == disturbed["flow_killed_after"]
    assert 0 < resume["lost_steps"] <= CHECKPOINT_EVERY
    assert sum(r.get("event") == CONTROLLER_START for r in disturbed["records"]) == 1
    assert [r["kind"] for r in outcome["resumes"]] == [
        "worker failure",
        "preemption",
        "flow re-run",
    ]


def test_data_read_again_and_trained_twice_after_a_resume_is_counted(disturbed):
    """Ray Data cannot checkpoint an iterator: each resume reads its epoch again up to where
    its checkpoint was and skips that; what the re-read epoch hands out anew may be trained
    twice. Both are counted, from the checkpoint's own record of its place in the epoch."""
    outcome = disturbed["result"]["outcome"]
    for resume in outcome["resumes"]:
        state = disturbed["states"][resume["from_step"]]
        assert resume["reread_blocks"] == state.batches_in_epoch * MICRO_BATCH * WORKERS
        assert resume["repeated_blocks"] >= 0
    assert sum(r["reread_blocks"] for r in outcome["resumes"]) > 0


def test_checkpoints_are_hugging_face_folders_kept_by_eval_loss(disturbed):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    outcome = disturbed["result"]["outcome"]
    best = Path(outcome["best_checkpoint_local"])
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in best.iterdir()
    }
    assert not list(best.glob("*.pt"))  # training state stays in its folder, apart
    assert {p.name for p in (best / STATE_DIR).iterdir()} == {
        "optimizer.pt",
        "scheduler.pt",
        "state.json",
        "rng-rank0.pt",
        "rng-rank1.pt",
    }
    AutoModelForCausalLM.from_pretrained(best)
    AutoTokenizer.from_pretrained(best)
    kept = [c for c in outcome["checkpoints"] if c["kept"]]
    on_disk = sorted(p.name for p in Path(outcome["experiment_path"]).glob("checkpoint-*"))
    assert sorted(Path(c["path"]).name for c in kept) == on_disk
    assert len(on_disk) <= TRAINING.get("keep_checkpoints", 2) + 1  # the N best and the latest
    assert outcome["best_eval_loss"] == min(c["eval_loss"] for c in kept)


def test_the_loss_chart_is_on_the_flow_run_and_beside_the_checkpoints(disturbed, prefect_client):
    outcome = disturbed["result"]["outcome"]
    chart = Path(outcome["chart_path"])
    assert chart == Path(outcome["experiment_path"]) / "loss-chart.png"
    png = chart.read_bytes()
    width, height = png_size(png)
    assert 800 <= width <= 3000 and 500 <= height <= 3000
    artifacts: dict[str, list] = {}
    for artifact in prefect_client.read_artifacts(
        flow_run_filter=FlowRunFilter(id={"any_": [disturbed["flow_run_id"]]})
    ):
        artifacts.setdefault(artifact.key, []).append(artifact)
    embedded = re.search(
        r"data:image/png;base64,([A-Za-z0-9+/=]+)\)", artifacts["llm-finetune-chart"][0].data
    )
    assert embedded and base64.b64decode(embedded.group(1)) == png
    # Each flow process kept its own progress artifact; the one that finished reached 100 %.
    assert max(a.data for a in artifacts["llm-finetune-progress"]) == 100
    assert "flow re-run: resumed at step" in artifacts["llm-finetune-summary"][0].data
    # What it draws: a mark for each checkpoint kind, the notice and the three resumes.
    records = disturbed["records"]
    figure = draw_finetune(records, summarize(records, MICRO_BATCH * WORKERS))
    gids = {line.get_gid() for line in figure.axes[0].get_lines()}
    assert {"checkpoint:periodic", "checkpoint:jit", "checkpoint:final", "preemption:0"} <= gids
    assert {"resume:0", "resume:1", "resume:2", "base", "eval"} <= gids


# --- evaluate, register, promote: the same run's best checkpoint ----------------------------


def test_the_fine_tune_raises_exact_match_and_lowers_held_out_perplexity(disturbed):
    """The base (random weights) and the best checkpoint scored on the same 50 held-out
    prompts, greedy, one prompt at a time (workloads.llm.evaluate)."""
    result = disturbed["result"]
    before, after = result["base_evaluation"], result["evaluation"]
    print("held-out evaluation:", json.dumps({"before": before, "after": after}))
    assert before["protocol"] == after["protocol"] and after["examples"] == 50
    assert before["exact_match"] <= BASE_EXACT_MATCH_AT_MOST
    assert after["exact_match"] >= EXACT_MATCH_AT_LEAST
    assert after["perplexity"] <= PERPLEXITY_RATIO_AT_MOST * before["perplexity"]


def kept_checkpoints(outcome: dict) -> list[dict]:
    return sorted((c for c in outcome["checkpoints"] if c["kept"]), key=lambda c: c["eval_loss"])


def test_the_best_checkpoint_is_registered_with_its_lineage_and_a_worse_one_is_not_promoted(
    stack, disturbed, prefect_client, tmp_path
):
    from mlflow import MlflowClient

    from prefect_ray_lifecycle.blocks import MLflowServer
    from prefect_ray_lifecycle.control import registry
    from prefect_ray_lifecycle.flows.llm_finetune import FineTuneResult
    from prefect_ray_lifecycle.flows.llm_pipeline import registration_request
    from prefect_ray_lifecycle.flows.llm_register import (
        LLMRegistrationRequest,
        register_llm_and_promote,
    )
    from prefect_ray_lifecycle.tasks.rollout.config import LLMServing

    client, server = MlflowClient(stack.mlflow_uri), MLflowServer(tracking_uri=stack.mlflow_uri)
    params = FineTuneParams.model_validate(disturbed["parameters"])
    trained = FineTuneResult.model_validate(disturbed["result"])
    name = f"finetuned-{os.getpid()}"
    request = registration_request(params, trained, name, "llm-ft", LLMServing(num_cpus=0.5), None)
    first = register_llm_and_promote(request, mlflow_server=server)
    assert first.promoted and first.reason.startswith("no champion yet"), first.reason
    assert first.evaluation == trained.evaluation  # the fine-tune's own, not measured again
    version = client.get_model_version(name, first.version)
    tags = version.tags
    best = Path(trained.outcome.best_checkpoint_local)
    assert tags["lifecycle.train.checkpoint_step"] == str(read_state(best).step)
    assert tags["lifecycle.train.flow_run_id"] == disturbed["flow_run_id"]
    assert tags["lifecycle.train.run"] == trained.outcome.experiment_path
    assert tags["lifecycle.dataset.fingerprint"] == trained.dataset_fingerprint
    assert tags["lifecycle.base"] == trained.base_label
    assert float(tags["lifecycle.eval.exact_match"]) == pytest.approx(
        trained.evaluation.exact_match, abs=1e-5
    )
    # Where the LLM rollout loads it from: the checkpoint's Hugging Face files, not its
    # optimizer state; the loss chart beside it on the run.
    served = {a.path.rsplit("/", 1)[-1] for a in client.list_artifacts(version.run_id, "hf")}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= served
    assert not served & {"trainer_state", "optimizer.pt"}
    assert [a.path for a in client.list_artifacts(version.run_id, "charts")] == ["charts/loss.png"]
    # Kept with the model before the promotion: what its champion move needs in reconcile.
    place = registry.serving_tags(client, name)
    assert (place["route"], place["kind"]) == ("llm-ft", "llm")
    assert place["settings"]["llm"]["num_cpus"] == 0.5

    # A worse fine-tune: the run's kept checkpoint with the highest eval loss.
    worse_checkpoint = kept_checkpoints(disturbed["result"]["outcome"])[-1]["path"]
    assert worse_checkpoint != str(best)
    state = register_llm_and_promote(
        LLMRegistrationRequest(
            model_name=name,
            checkpoint=worse_checkpoint,
            train_run=trained.outcome.experiment_path,
            evaluation=params.evaluation,
        ),
        mlflow_server=server,
        return_state=True,
    )
    worse = state.result()
    assert not worse.promoted and "not better by a margin" in worse.reason, worse.reason
    # The reason on the flow run too, where people look.
    (artifact,) = prefect_client.read_artifacts(
        artifact_filter=ArtifactFilter(key={"any_": ["registration"]}),
        flow_run_filter=FlowRunFilter(id={"any_": [state.state_details.flow_run_id]}),
    )
    assert "challenger, not promoted" in artifact.data and worse.reason in artifact.data
    assert registry.resolve_alias(client, name, registry.CHAMPION).version == first.version
    assert registry.resolve_alias(client, name, registry.CHALLENGER).version == worse.version
    verdict = client.get_model_version(name, worse.version).tags
    assert verdict["lifecycle.promotion.verdict"] == "rejected"
    assert verdict["lifecycle.promotion.champion_version"] == first.version
    assert verdict["lifecycle.promotion.reason"] == worse.reason

    # Bad input writes nothing and moves no alias.
    before = len(client.search_model_versions(f"name = '{name}'"))
    with pytest.raises(registry.RegistrationError, match=r"checkpoint: .* is not a causal lang"):
        register_llm_and_promote(
            LLMRegistrationRequest(
                model_name=name, checkpoint=not_a_causal_lm(tmp_path), train_run="/nowhere"
            ),
            mlflow_server=server,
        )
    assert len(client.search_model_versions(f"name = '{name}'")) == before
    assert registry.resolve_alias(client, name, registry.CHALLENGER).version == worse.version
    client.delete_registered_model(name)
