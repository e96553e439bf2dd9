"""`make demo-llm`: an LLM's lifecycle the way a user runs it, on the local services.

As `make demo` (services, setup, `prefect deploy --all`, a process worker), then: writes the
generated "count" corpus (workloads.llm.corpus), runs `llm-train-and-ship` through its
deployment (data-prep -> a Ray Train fine-tune of the tiny Llama -> held-out evaluation
against the base and the champion -> register-llm -> champion if better -> a gated LLM
rollout on /llm, vLLM from .venv-llm), asks the route held-out prompts and prints where to
look. A second run trains a challenger: promoted and rolled out only if it beats the champion.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import requests

from deployments import local
from deployments.demo import prepare, watch

DEPLOYMENT = "llm-train-and-ship/llm-train-and-ship"
ROUTE = "llm"
MODEL_NAME = "tiny-llama-count"
RUN_TIMEOUT_S = 1800
# 2 CPUs: two Train workers of 0.75 and two tokenize tasks of 0.25 (docs/llm-finetune.md).
PARAMS = {
    "training": {"total_steps": 200, "eval_every_steps": 50, "checkpoint_every_steps": 50},
    "resources": {"cpus_per_worker": 0.75},
}
LLM = {
    "engine": {"max_model_len": 256, "kv_cache_memory_bytes": 64 << 20, "dtype": "float32"},
    "num_cpus": 0.5,
}
GATES = {"smoke_max_latency_ms": 10000, "max_ttft_ms": 10000, "max_p99_ms": 10000}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deployments.demo_llm", description=__doc__)
    parser.add_argument("--state-dir", type=Path, default=local.DEFAULT_STATE_DIR)
    state_dir = parser.parse_args(argv).state_dir.resolve()
    ready = prepare(state_dir, DEPLOYMENT)
    if ready is None:
        return 1
    from prefect_ray_lifecycle.workloads.llm import corpus
    from prefect_ray_lifecycle.workloads.llm.evaluate import LLMEvalProtocol, held_out_examples

    environment = ready.environment
    source = state_dir / "llm" / "count"
    if not source.is_dir():
        corpus.write_corpus(source, 3000, seed=0)
    params = {
        "params": {
            **PARAMS,
            "data": {
                "source": str(source),
                "output": str(state_dir / "llm" / "count-prepared"),
                "split_key": "id",
            },
            "storage_root": str(state_dir / "llm" / "runs"),
        },
        "model_name": MODEL_NAME,
        "route": ROUTE,
        "llm": LLM,
        "gates": GATES,
    }
    print(f"== running {DEPLOYMENT} (a few minutes on 2 CPUs)", flush=True)
    flow_run_id, flow_run_url = ready.run_deployment(DEPLOYMENT, params)
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        final = watch(client, flow_run_id, RUN_TIMEOUT_S)
    ready.others_deployed()
    if not final.state.is_completed():
        print(f"{DEPLOYMENT} ended {final.state.name}: {final.state.message}", file=sys.stderr)
        return 1
    url = f"http://127.0.0.1:{environment.serve_port}/{ROUTE}/v1/completions"
    print(f"== asking {url} held-out prompts (greedy)", flush=True)
    for example in held_out_examples(LLMEvalProtocol(examples=5)):
        started = time.perf_counter()
        body = {"model": MODEL_NAME, "prompt": example.prompt, "max_tokens": 3, "temperature": 0}
        answer = requests.post(url, json=body, timeout=60)
        text = answer.json()["choices"][0]["text"] if answer.ok else answer.text[:80]
        print(
            f"   {example.prompt!r} -> {text!r} (expected {example.completion!r}) from "
            f"v{answer.headers.get('X-Model-Version')} "
            f"({(time.perf_counter() - started) * 1000:.0f} ms)"
        )
    prompt = json.dumps({"model": MODEL_NAME, "prompt": "a b: count on from 41", "max_tokens": 3})
    print(f"""
== done. Where to look:
  Prefect flow run   {flow_run_url} (artifacts: llm-evaluation, registration, llm-train-and-ship)
  MLflow model       {environment.mlflow_uri}/#/models/{MODEL_NAME}
  Try the endpoint   curl -s {url} -H 'content-type: application/json' -d '{prompt}'
  The route now      python -m deployments.status --url http://127.0.0.1:{environment.serve_port}/{ROUTE}
""")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
