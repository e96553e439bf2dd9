"""Walk from a served answer back to the sweep that made it.

    python -m deployments.lineage [--url http://127.0.0.1:8000/policy] [--model cartpole-ppo]
                                  [--version 3]

One request to the route gives X-Model-Version (or --version names one without asking); the
MLflow version's lifecycle.* tags give the Prefect runs (pipeline, registration, sweep,
rollout), the Tune experiment and trial, the git commit and the dataset fingerprint when there
was one. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import urllib.error
import urllib.request
from typing import Any

from prefect_ray_lifecycle.tasks.params import model_version
from prefect_ray_lifecycle.workloads.constants import VERSION_HEADER

DEFAULT_OBSERVATION = [0.01, -0.02, 0.03, 0.04]  # a CartPole observation


def ask(url: str, observation: list[float] = DEFAULT_OBSERVATION) -> dict[str, Any]:
    """POST one observation; the answer, its status (0: no answer) and the version."""
    request = urllib.request.Request(
        url,
        data=json.dumps({"observation": observation}).encode(),
        headers={"content-type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            status, headers, body = response.status, response.headers, response.read()
    except urllib.error.HTTPError as error:
        status, headers, body = error.code, error.headers, error.read()
    except (urllib.error.URLError, OSError) as error:  # nothing listens there
        return {"status": 0, "version": None, "answer": {"error": repr(error)}}
    try:
        answer = json.loads(body or b"{}")
    except ValueError:
        answer = {"raw": body[:200].decode(errors="replace")}
    return {"status": status, "version": headers.get(VERSION_HEADER), "answer": answer}


def walk(
    url: str, model_name: str, tracking_uri: str, version: str | None = None
) -> dict[str, Any]:
    from mlflow import MlflowClient

    from prefect_ray_lifecycle.control import registry

    served = ask(url) if version is None else None
    version = served["version"] if version is None else version
    if not version:
        return {"url": url, "served": served, "error": "the answer has no X-Model-Version"}
    client = MlflowClient(tracking_uri)
    found = client.get_model_version(model_name, version)
    tags = {
        k.removeprefix(f"{registry.TAG}."): v
        for k, v in found.tags.items()
        if k.startswith(f"{registry.TAG}.")
    }
    return {
        "url": url,
        "served": served,
        "mlflow_version": f"{tracking_uri}/#/models/{model_name}/versions/{version}",
        "mlflow_run": (
            f"{tracking_uri}/#/experiments/"
            f"{client.get_run(found.run_id).info.experiment_id}/runs/{found.run_id}"
            if found.run_id
            else None
        ),
        "pipeline_flow_run": tags.get("pipeline.flow_run_url"),
        "registration_flow_run": tags.get("prefect.flow_run_url"),
        "sweep_flow_run": tags.get("tune.flow_run_url"),
        "tune_experiment": tags.get("tune.experiment_path"),
        "tune_trial": tags.get("tune.trial_id"),
        "eval_mean_return": tags.get("eval.mean_return"),
        "promotion": tags.get("promotion.reason"),
        "rollout": {
            k.removeprefix("rollout."): v
            for k, v in tags.items()
            if k.startswith("rollout.") and k != "rollout.by"
        },
        "dataset_fingerprint": tags.get("dataset.fingerprint"),
        "git_commit": tags.get("git_commit"),
    }


def _version(text: str) -> str:
    try:
        return model_version(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deployments.lineage",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000/policy")
    parser.add_argument("--model", default="cartpole-ppo")
    parser.add_argument(
        "--mlflow-uri", default=os.environ.get("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    )
    parser.add_argument(
        "--version",
        type=_version,
        help="walk back from this version (a number) instead of the one the route serves",
    )
    args = parser.parse_args(argv)
    print(json.dumps(walk(args.url, args.model, args.mlflow_uri, args.version), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
