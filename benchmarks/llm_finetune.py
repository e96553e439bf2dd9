"""The llm-finetune flow against a plain TorchTrainer script on the same data, steps and workers;
and the same flow with a training worker killed (SIGKILL) or a node drained as a Spot reclaim.

A temporary stack (deployments.testing.stack: a `ray start --head`, Prefect, MLflow) and, for every
run, a fresh second node (deployments.worker_node): the two workers are spread one per node
(SPREAD), so a drain of the second node takes one of them. The corpus is the generated
"count" corpus (workloads.llm.corpus), prepared once by the data-prep flow; the base is the
tiny Llama. Each round runs four sides, the order rotating round by round so that drift in
the machine's load falls on all of them: `raw` (the plain script: Ray Data reads and
tokenizes the prepared parquet into the object store with the flow's own pipeline, a
TorchTrainer trains with AdamW, the same schedule, the base's eval loss, a report per step
(asynchronous, as the flow's) and a checkpoint every N steps with its eval loss, keeping the
best two), `flow` (llm-finetune,
undisturbed), `kill` (a worker killed half way between two periodic checkpoints) and
`preempt` (the second node drained with DRAIN_NODE_REASON_PREEMPTION and a deadline, and
stopped once it passed). Medians over the rounds; overheads are each disturbed flow against
the undisturbed one. Both sides set the Train controller's poll interval the flow uses (Ray
Train's default 2 s throttles a loop that reports every step to one step per 2 s).

Each flow run also scores the base and its best checkpoint on the same 50 held-out prompts
(`ppl_before`, `ppl_after`, `exact_match_before`, `exact_match_after`: medians over the
undisturbed runs); that scoring's time (its evaluate-llm task runs, `eval_s`) is left out of
each flow run's time, since the raw script scores nothing. Then the last undisturbed run's
best checkpoint is registered as an LLM version (route, kind and serving settings kept with
the model) on the deployments a user runs
(`deployments.setup`, `prefect deploy --all`, a process worker), `champion` is moved to it
with MlflowClient, and `alias_to_live_s` is the time until the route answers with its
X-Model-Version (webhook -> receiver -> Prefect event -> trigger -> reconcile -> a first LLM
rollout through health and smoke, vLLM in .venv-llm). `--no-ship` leaves that out.

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import json
import math
import os
import signal
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks._output import strict_json

ARTICLE_PREEMPT_SHARE = 0.007  # the article's Spot reclaim: 0.7 % of the run's time lost
SIDES = ("raw", "flow", "kill", "preempt")
SHIP_ROUTE = "llm-bench"
SHIP_GATES = {
    "health_timeout_s": 300,
    "stability_window_s": 2,
    "smoke_max_latency_ms": 30000,
    "max_ttft_ms": 30000,
    "max_p99_ms": 30000,
}


def alias_to_live(stack, result, args) -> float:
    """Register the run's best checkpoint, move `champion` to it and time the route's answer
    naming it (see the module's docstring)."""
    import urllib.error
    import urllib.request

    from mlflow import MlflowClient

    from deployments.testing.stack import deployed
    from deployments.testing.watch import FAST_POLL_S, wait_for
    from prefect_ray_lifecycle.control import registry
    from prefect_ray_lifecycle.tasks.rollout.config import LLMServing, Serving

    client = MlflowClient(stack.mlflow_uri)
    name = f"bench-llm-{os.getpid()}"
    registered = registry.register_llm_folder(
        client,
        name=name,
        checkpoint=result.outcome.best_checkpoint_local,
        experiment_name="bench-llm-finetune",
        trial_key_value=f"bench-{os.getpid()}",
    )
    llm = LLMServing(
        engine={"max_model_len": 128, "kv_cache_memory_bytes": 64 << 20, "dtype": "float32"},
        num_cpus=0.5,
        host_in_router=False,
    )
    registry.set_serving_tags(
        client,
        name,
        SHIP_ROUTE,
        "llm",
        {"serving": Serving(router_num_cpus=0.1).model_dump(), "llm": llm.model_dump()},
    )
    url = f"http://127.0.0.1:{stack.serve_port}/{SHIP_ROUTE}"

    def serving() -> bool:
        try:
            with urllib.request.urlopen(urllib.request.Request(url), timeout=5) as answer:
                return answer.headers.get("X-Model-Version") == registered.version
        except urllib.error.HTTPError as error:  # the router answers GET with 405
            return error.headers.get("X-Model-Version") == registered.version
        except OSError:
            return False

    parameters = {"reconcile/reconcile": {"gates": SHIP_GATES}}
    with deployed(stack, routes=(SHIP_ROUTE,), parameters=parameters):
        moved = time.perf_counter()
        client.set_registered_model_alias(name, registry.CHAMPION, registered.version)
        wait_for(
            "the LLM version serves its route",
            serving,
            timeout=args.ship_timeout,
            every=FAST_POLL_S,
        )
        return time.perf_counter() - moved


def raw_loop(config: dict[str, Any]) -> None:
    """The plain script's training loop: what a Ray Train user writes for the same job."""
    import tempfile as scratch

    import ray.train
    import ray.train.torch
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from prefect_ray_lifecycle.workloads.llm.train.schedule import WarmupCosine

    torch.set_num_threads(1)
    world = ray.train.get_context().get_world_size()
    tokenizer = AutoTokenizer.from_pretrained(config["base"])
    model = ray.train.torch.prepare_model(AutoModelForCausalLM.from_pretrained(config["base"]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, WarmupCosine(config["warmup"], config["steps"], config["min_ratio"])
    )
    shard = ray.train.get_dataset_shard("train")
    held_out = ray.train.get_dataset_shard("eval")

    def batches():
        while True:
            yield from shard.iter_torch_batches(
                batch_size=config["micro_batch"], drop_last=True, dtypes=torch.int64
            )

    def evaluate() -> float:
        total = count = 0.0
        model.eval()
        with torch.no_grad():
            for batch in held_out.iter_torch_batches(batch_size=16, dtypes=torch.int64):
                ids = batch["input_ids"]
                total += model.module(input_ids=ids, labels=ids).loss.item() * ids.numel()
                count += ids.numel()
        model.train()
        sums = torch.tensor([total, count], dtype=torch.float64)
        torch.distributed.all_reduce(sums)
        return (sums[0] / sums[1]).item()

    def report(metrics: dict) -> None:
        # Asynchronous, as the flow's loop: a synchronous report waits for the controller to
        # read the previous one (one slot per worker, read once per poll).
        ray.train.report(metrics, checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC)

    stream = batches()
    report({"step": 0, "eval_loss": evaluate()})  # the base, as the flow measures it
    for step in range(1, config["steps"] + 1):
        for micro in range(config["accum"]):
            ids = next(stream)["input_ids"]
            sync = model.no_sync() if micro < config["accum"] - 1 and world > 1 else None
            with sync or contextlib.nullcontext():
                loss = model(input_ids=ids, labels=ids).loss
                (loss / config["accum"]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        metrics = {"step": step, "loss": loss.item()}
        if step % config["checkpoint_every"] and step != config["steps"]:
            report(metrics)
            continue
        metrics["eval_loss"] = evaluate()
        with scratch.TemporaryDirectory() as folder:
            if ray.train.get_context().get_world_rank() == 0:
                model.module.save_pretrained(folder)
                tokenizer.save_pretrained(folder)
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder))


def run_raw(cluster, prepared: Path, base: Path, storage: Path, args) -> float:
    """The plain script, timed from connecting to the end of fit()."""
    from ray.train import CheckpointConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from prefect_ray_lifecycle.workloads.llm.models import ModelLocation
    from prefect_ray_lifecycle.workloads.llm.train.settings import (
        FailureSettings,
        ResourceSettings,
        TrainingSettings,
        TrainSpec,
    )
    from prefect_ray_lifecycle.workloads.llm.train.trainer import job_env_vars, tokenized_split

    spec = TrainSpec(
        base=ModelLocation(path=str(base)),
        training=TrainingSettings(total_steps=args.steps),
        layout="prompt_completion",
        text_columns=["prompt", "completion"],
    )

    def tokenized(split: str):
        # The flow's own tokenize pipeline: the same data, read the same way.
        return tokenized_split(str(prepared / split), spec, ResourceSettings()).materialize()

    started = time.perf_counter()
    # The same controller settings as the flow's job (see the module's docstring).
    cluster = cluster.model_copy(
        update={"runtime_env": {"env_vars": job_env_vars(FailureSettings(preemption_poll_s=1))}}
    )
    with cluster.connect():
        TorchTrainer(
            raw_loop,
            train_loop_config={
                "base": str(base),
                "lr": 3e-3,
                "warmup": 20,
                "min_ratio": 0.1,
                "steps": args.steps,
                "accum": args.accum,
                "micro_batch": 8,
                "checkpoint_every": args.checkpoint_every,
            },
            scaling_config=ScalingConfig(
                num_workers=2, resources_per_worker={"CPU": 1}, placement_strategy="SPREAD"
            ),
            run_config=RunConfig(
                name="raw",
                storage_path=str(storage),
                checkpoint_config=CheckpointConfig(
                    num_to_keep=2,
                    checkpoint_score_attribute="eval_loss",
                    checkpoint_score_order="min",
                ),
            ),
            datasets={"train": tokenized("train"), "eval": tokenized("eval")},
        ).fit()
    return time.perf_counter() - started


def flow_params(source: Path, prepared: Path, base: Path, storage: Path, args) -> Any:
    from prefect_ray_lifecycle.flows.llm_finetune import FineTuneParams

    return FineTuneParams(
        data={"source": str(source), "output": str(prepared), "split_key": "id"},
        base={"path": str(base)},
        training={
            "total_steps": args.steps,
            "grad_accum_steps": args.accum,
            "checkpoint_every_steps": args.checkpoint_every,
            "eval_every_steps": args.checkpoint_every,
            "jit_margin_s": 2.0,
        },
        resources={"placement_strategy": "SPREAD"},
        failures={"preemption_poll_s": 1.0},
        storage_root=str(storage),
    )


def _last_step(storage: Path) -> int:
    from prefect_ray_lifecycle.workloads.llm.train.history import read_history

    steps = [
        r["step"]
        for history in storage.glob("*/finetune/history.jsonl")
        for r in read_history(str(history))
        if "step" in r
    ]
    return max(steps, default=-1)


def _wait_for_step(storage: Path, step: int, running) -> None:
    while _last_step(storage) < step:
        if running.done():
            running.result()
            raise RuntimeError(f"the run ended before step {step}")
        time.sleep(0.2)


def run_flow(stack, node, params, storage: Path, side: str, args) -> tuple[float, Any]:
    """The flow, timed end to end, with the side's disturbance from this thread."""
    from deployments.worker_node import alive_actors, drain
    from deployments.worker_node import stop as stop_node
    from prefect_ray_lifecycle.flows.llm_finetune import llm_finetune

    every = args.checkpoint_every
    with ThreadPoolExecutor(1) as pool:
        started = time.perf_counter()
        running = pool.submit(
            contextvars.copy_context().run,
            llm_finetune,
            params=params,
            ray_cluster=stack.ray_cluster(),
        )
        if side == "kill":  # half way between two periodic checkpoints
            _wait_for_step(storage, every + every // 2, running)
            worker = alive_actors(stack.ray_dashboard_url, stack.ray_token, "RayTrainWorker")[0]
            os.kill(worker["pid"], signal.SIGKILL)
        elif side == "preempt":
            _wait_for_step(storage, every + every // 2, running)
            drain(stack.ray_address, node.node_id, args.drain_deadline, stack.client_env())
            reclaim = threading.Timer(args.drain_deadline + 2, stop_node, (node.process,))
            reclaim.start()
        result = running.result()
        elapsed = time.perf_counter() - started
    if side == "preempt":
        reclaim.join()
    return elapsed, result


def evaluation_s(flow_run_id: str | None) -> float:
    """Seconds a flow run spent in its held-out evaluations (its evaluate-llm task runs)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, TaskRunFilter, TaskRunFilterName

    if flow_run_id is None:
        return 0.0
    from deployments.testing.watch import wait_for

    with get_client(sync_client=True) as client:

        def finished() -> list:  # task runs are recorded from events, a moment later
            runs = client.read_task_runs(
                flow_run_filter=FlowRunFilter(id={"any_": [flow_run_id]}),
                task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_="evaluate-llm")),
            )
            return runs if runs and all(run.end_time for run in runs) else []

        runs = wait_for("the evaluations' task runs are recorded", finished, 60, 0.5)
    return sum(run.total_run_time.total_seconds() for run in runs)


def evaluation_figures(results: list[Any]) -> dict[str, float | None]:
    """Medians of the held-out evaluations before and after, over the undisturbed runs."""

    def median(pick) -> float | None:
        values = [pick(r) for r in results if r.evaluation and r.base_evaluation]
        return round(statistics.median(values), 4) if values else None

    return {
        "ppl_before": median(lambda r: r.base_evaluation.perplexity),
        "ppl_after": median(lambda r: r.evaluation.perplexity),
        "exact_match_before": median(lambda r: r.base_evaluation.exact_match),
        "exact_match_after": median(lambda r: r.evaluation.exact_match),
        "held_out_prompts": results[-1].evaluation.examples if results else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of all four sides (>= 3)")
    parser.add_argument("--steps", type=int, default=600, help="optimizer steps per run")
    parser.add_argument("--accum", type=int, default=2, help="micro-batches per step")
    parser.add_argument("--checkpoint-every", type=int, default=100)
    parser.add_argument("--examples", type=int, default=3000, help="corpus rows")
    parser.add_argument("--drain-deadline", type=int, default=15, help="seconds of warning")
    parser.add_argument("--head-cpus", type=int, default=4)
    parser.add_argument(
        "--no-ship", dest="ship", action="store_false", help="leave out alias_to_live_s"
    )
    parser.add_argument("--ship-timeout", type=float, default=420.0)
    parser.add_argument(
        "--sides",
        default=",".join(SIDES),
        help="which of raw,flow,kill,preempt to run (flow always runs); e.g. flow for the "
        "evaluation and alias_to_live_s alone",
    )
    args = parser.parse_args(argv)

    from deployments.testing.stack import pointed_at, temporary_stack
    from deployments.worker_node import join
    from prefect_ray_lifecycle.flows.llm_finetune import llm_finetune
    from prefect_ray_lifecycle.workloads.llm import corpus
    from prefect_ray_lifecycle.workloads.llm.tiny import build_tiny_llm
    from prefect_ray_lifecycle.workloads.llm.train.settings import TrainingSettings

    work = Path(tempfile.mkdtemp(prefix="bench-finetune-"))
    source, prepared = work / "corpus", work / "prepared"
    corpus.write_corpus(source, args.examples, seed=0)
    base = build_tiny_llm(work / "tiny-llama")
    sides = tuple(s for s in SIDES if s in {*args.sides.split(","), "flow"})
    times: dict[str, list[float]] = {side: [] for side in sides}
    # The machine's 1-minute load average at the end of each run: other work on a shared
    # machine shows up in the times, and this says how much there was.
    loads: dict[str, list[float]] = {side: [] for side in sides}
    outcomes: dict[str, list[Any]] = {side: [] for side in sides if side != "raw"}
    results: list[Any] = []  # the undisturbed flow runs' results (their evaluations)
    # Seconds each flow run spent scoring the base and its best checkpoint: left out of its
    # time (the raw script scores nothing), reported as eval_s.
    evaluated: dict[str, list[float]] = {side: [] for side in sides if side != "raw"}
    alias_s = None
    with temporary_stack(args.head_cpus, prefix="bf-") as stack, pointed_at(stack):
        # The corpus is prepared once (data-prep caches it), outside the timing.
        warm = flow_params(source, prepared, base, work / "warm", args)
        warm.training = TrainingSettings(total_steps=2, warmup_steps=1)
        warm.resources.placement_strategy = "PACK"
        llm_finetune(params=warm, ray_cluster=stack.ray_cluster())
        for round_index in range(args.rounds):
            shift = round_index % len(sides)
            order = sides[shift:] + sides[:shift]
            for side in order:
                storage = work / f"round{round_index}-{side}"
                node_dir = stack.state_dir / f"n{round_index}{side[0]}"
                with join(
                    stack.ray_address,
                    stack.ray_dashboard_url,
                    stack.state_dir / "ray_auth_token",
                    node_dir,
                    cpus=2,
                ) as node:
                    if side == "raw":
                        times[side].append(
                            run_raw(stack.ray_cluster(), prepared, base, storage, args)
                        )
                    else:
                        params = flow_params(source, prepared, base, storage, args)
                        elapsed, result = run_flow(stack, node, params, storage, side, args)
                        scoring_s = evaluation_s(result.flow_run_id)
                        evaluated[side].append(scoring_s)
                        times[side].append(elapsed - scoring_s)
                        outcomes[side].append(result.outcome)
                        if side == "flow":
                            results.append(result)
                loads[side].append(os.getloadavg()[0])
                print(
                    json.dumps(
                        {
                            "round": round_index,
                            "side": side,
                            "s": times[side][-1],
                            "load": loads[side][-1],
                        }
                    )
                )
        if args.ship and results:
            alias_s = alias_to_live(stack, results[-1], args)
    median = {side: statistics.median(values) for side, values in times.items()}
    median.update({side: math.nan for side in SIDES if side not in median})  # not run
    flows = outcomes["flow"]

    def lost(side: str) -> int | None:
        """The most steps a resume of this side lost (None: no run of it resumed, e.g. the run
        ended before the drain's deadline, or the side was not run)."""
        runs = outcomes.get(side, [])
        return max((r.lost_steps for o in runs for r in o.resumes), default=None)

    kill_overhead = median["kill"] - median["flow"]
    preempt_overhead = median["preempt"] - median["flow"]
    print(
        strict_json(
            {
                "rounds": args.rounds,
                "steps": args.steps,
                "workers": 2,
                "raw_s": round(median["raw"], 2),
                "flow_s": round(median["flow"], 2),
                "ratio": round(median["flow"] / median["raw"], 3),
                "eval_s": round(statistics.median(evaluated["flow"]), 2),
                "tokens_per_s": round(statistics.median(o.tokens_per_s for o in flows), 1),
                "loss_before": round(statistics.median(o.base_eval_loss for o in flows), 3),
                "loss_after": round(statistics.median(o.best_eval_loss for o in flows), 3),
                **evaluation_figures(results),
                "alias_to_live_s": round(alias_s, 2) if alias_s is not None else None,
                "checkpoint_every_steps": args.checkpoint_every,
                "resume_lost_steps": lost("kill"),
                "preempt_lost_steps": lost("preempt"),
                "resumed_runs": {s: sum(bool(o.resumes) for o in outcomes[s]) for s in outcomes},
                "kill_s": round(median["kill"], 2),
                "preempt_s": round(median["preempt"], 2),
                "kill_overhead_s": round(kill_overhead, 2),
                "preempt_overhead_s": round(preempt_overhead, 2),
                "kill_overhead_share": round(kill_overhead / median["kill"], 4),
                "preempt_overhead_share": round(preempt_overhead / median["preempt"], 4),
                "article_preempt_share": ARTICLE_PREEMPT_SHARE,
                "preempt_run_s_for_article_share": round(
                    preempt_overhead / ARTICLE_PREEMPT_SHARE, 0
                ),
                "runs": {side: [round(t, 2) for t in values] for side, values in times.items()},
                "load_avg_1m": {side: [round(x, 1) for x in v] for side, v in loads.items()},
                "cpus": os.cpu_count(),
                "data_reread_blocks": sum(
                    r.reread_blocks for side in outcomes for o in outcomes[side] for r in o.resumes
                ),
                "data_repeated_blocks": sum(
                    r.repeated_blocks
                    for side in outcomes
                    for o in outcomes[side]
                    for r in o.resumes
                ),
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
