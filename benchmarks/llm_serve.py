"""Tokens/s and latency of the vLLM app on Ray Serve through the router, each way a route
serves it, against straight to the app over HTTP, in the same run:

- hosted (`ratio`): the router hosts the live version's engine in its own replica, as a
  rollout leaves an LLM route;
- forwarded (`forwarded_ratio`): the router forwards every request to the version's app by
  DeploymentHandle, as while the hosted engine loads;
- canary (`canary_ratio`): a hosted live version with a candidate at --canary-share, the
  candidate's requests forwarded to its app, under a rollout record whose lease the benchmark
  holds (the candidate is the same app under another version label, so both sides of the
  split run the same model and engine settings).

Starts an embedded local Ray (or joins --address), deploys workloads.llm with a route
(replicas under .venv-llm) and one router per path, then sends --requests completions of
--max-tokens tokens each, --concurrency at a time (ignore_eos, so every request generates
exactly that many), then --ttft-requests streamed ones one at a time for the time to first
token, for --rounds rounds with the order of the paths rotating; medians. The model is a
folder given with --model, else the tiny Llama built locally. A few requests warm each path
first, outside the timing. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROUTE = "/llm-bench"
APP_NAME = "llm-bench"
ROUTER_ROUTES = {  # path -> the route of its router
    "hosted": "llm-bench-router",
    "forwarded": "llm-bench-forward",
    "canary": "llm-bench-canary",
}
PATHS = ("direct", *ROUTER_ROUTES)
LIVE_VERSION = "bench"
CANDIDATE_VERSION = "bench-candidate"
CANARY_HOLDER = "llm-serve-benchmark"
CANARY_LEASE_S = 24 * 3600.0  # held for the whole run, released at its end
SERVED_NAME = "bench-llm"
WARMUP_REQUESTS = 4
PROMPT = "ray serve routes every request of the canary to the live model version and"


def detect_device() -> str:
    """'gpu' where nvidia-smi lists one (the LLM venv then needs CUDA vLLM), else 'cpu'."""
    if shutil.which("nvidia-smi") is None:
        return "cpu"
    result = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return "gpu" if result.returncode == 0 and "GPU" in result.stdout else "cpu"


def app_args(model: str, device: str, max_model_len: int, python: str | None) -> dict:
    engine: dict = {"max_model_len": max_model_len}
    if device == "gpu":
        engine["dtype"] = "bfloat16"
        actor = {"num_cpus": 1, "num_gpus": 1}
    else:
        engine.update(dtype="float32", kv_cache_memory_bytes=256 << 20)
        actor = {"num_cpus": 1}
    return {
        "model": model,
        "served_model_name": SERVED_NAME,
        "version_label": "bench",
        "engine": engine,
        "ray_actor_options": actor,
        "route_prefix": ROUTE,
        "max_ongoing_requests": 256,
        **({"python": python} if python else {}),
    }


def completion(max_tokens: int, stream: bool = False) -> dict:
    """A completion that generates exactly `max_tokens` tokens (ignore_eos)."""
    return {
        "model": SERVED_NAME,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
    }


async def load(url: str, requests: int, concurrency: int, max_tokens: int) -> dict:
    """Completions at `url` (.../v1/completions), `concurrency` at a time: wall time, tokens,
    and each request's latency in ms."""
    import httpx

    from prefect_ray_lifecycle.workloads.constants import VERSION_HEADER

    body = completion(max_tokens)
    latencies: list[float] = []
    versions: dict[str, int] = {}
    tokens = 0
    gate = asyncio.Semaphore(concurrency)

    async with httpx.AsyncClient(
        timeout=120, limits=httpx.Limits(max_connections=concurrency)
    ) as client:

        async def one() -> None:
            nonlocal tokens
            async with gate:
                start = time.perf_counter()
                response = await client.post(url, json=body)
                latencies.append((time.perf_counter() - start) * 1000)
            response.raise_for_status()
            tokens += response.json()["usage"]["completion_tokens"]
            version = response.headers.get(VERSION_HEADER, "")
            versions[version] = versions.get(version, 0) + 1

        await asyncio.gather(*(one() for _ in range(min(WARMUP_REQUESTS, requests))))
        latencies.clear()
        versions.clear()
        tokens = 0
        start = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(requests)))
        wall = time.perf_counter() - start
    return {"wall_s": wall, "tokens": tokens, "latencies_ms": latencies, "versions": versions}


async def first_token_ms(url: str, requests: int, max_tokens: int) -> list[float]:
    """Streamed completions at `url`, one at a time: ms from sending each until its first
    chunk of generated text arrives (time to first token)."""
    import httpx

    body = completion(max_tokens, stream=True)
    waits: list[float] = []
    async with httpx.AsyncClient(timeout=120) as client:
        for _ in range(requests):
            start = time.perf_counter()
            async with client.stream("POST", url, json=body) as response:
                response.raise_for_status()
                first = None
                async for line in response.aiter_lines():  # read to the end: one at a time
                    if first is None and line.startswith("data: ") and '"text"' in line:
                        first = (time.perf_counter() - start) * 1000
                if first is None:
                    raise RuntimeError(f"{url} streamed no text")
                waits.append(first)
    return waits


def summarize(run: dict) -> dict:
    latencies = sorted(run["latencies_ms"])
    p99_index = min(len(latencies) - 1, round(0.99 * (len(latencies) - 1)))
    return {
        "tokens_per_s": round(run["tokens"] / run["wall_s"], 1),
        "p50_ms": round(statistics.median(latencies), 1),
        "p99_ms": round(latencies[p99_index], 1),
        "requests": len(latencies),
        "tokens": run["tokens"],
        "wall_s": round(run["wall_s"], 2),
    }


def summarize_rounds(runs: list[dict], ttft_ms: list[float]) -> dict:
    """Medians over the rounds (tokens/s) and over every request (latency, TTFT)."""
    merged = summarize(merge(runs))
    return {
        **merged,
        "tokens_per_s": round(statistics.median(summarize(r)["tokens_per_s"] for r in runs), 1),
        "rounds_tokens_per_s": [summarize(r)["tokens_per_s"] for r in runs],
        "ttft_ms": round(statistics.median(ttft_ms), 1),
    }


def merge(runs: list[dict]) -> dict:
    return {
        "wall_s": sum(r["wall_s"] for r in runs),
        "tokens": sum(r["tokens"] for r in runs),
        "latencies_ms": [x for r in runs for x in r["latencies_ms"]],
    }


def candidate_share(runs: list[dict]) -> float:
    """The share of timed answers the candidate version gave."""
    answers = sum(sum(r["versions"].values()) for r in runs)
    candidate = sum(r["versions"].get(CANDIDATE_VERSION, 0) for r in runs)
    return round(candidate / answers, 3) if answers else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--model", help="a Hugging Face folder; default: the tiny Llama")
    parser.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
    parser.add_argument("--python", help="the LLM venv's python (default .venv-llm/bin/python)")
    parser.add_argument("--address", default="", help="Ray address; '' starts a local Ray")
    parser.add_argument(
        "--num-cpus",
        type=int,
        default=4,
        help="logical CPUs of the local Ray (oversubscribed on purpose)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every path (>= 3)")
    parser.add_argument(
        "--paths",
        default=",".join(ROUTER_ROUTES),
        help="router paths to measure against direct (a quick check may take fewer)",
    )
    parser.add_argument(
        "--canary-share", type=float, default=0.5, help="the candidate's share in the canary"
    )
    parser.add_argument(
        "--ttft-requests", type=int, default=8, help="streamed requests per path and round"
    )
    args = parser.parse_args(argv)
    routers = [p for p in args.paths.split(",") if p]
    if unknown := set(routers) - set(ROUTER_ROUTES):
        parser.error(f"unknown paths {sorted(unknown)}: choose from {list(ROUTER_ROUTES)}")

    from ray import serve

    from deployments import local, ports
    from prefect_ray_lifecycle.blocks import RayCluster
    from prefect_ray_lifecycle.compat import ray_internals
    from prefect_ray_lifecycle.control import serve_control
    from prefect_ray_lifecycle.workloads.llm import LLMAppArgs, deploy_llm_app
    from prefect_ray_lifecycle.workloads.llm.tiny import build_tiny_llm
    from prefect_ray_lifecycle.workloads.serve.route_state import drop_route_state

    device = detect_device() if args.device == "auto" else args.device
    workdir = Path(tempfile.mkdtemp(prefix="bench-llm-"))
    try:
        model = args.model or str(build_tiny_llm(workdir / "tiny", python=args.python))
        cluster = RayCluster(address=args.address, num_cpus=None if args.address else args.num_cpus)
        with cluster.connect():
            started_serve = ray_internals.serve_client_if_running() is None
            if started_serve:
                (port,) = ports.free_ports(1)
                serve.start(http_options={"host": local.HOST, "port": port})
            try:
                started = time.perf_counter()
                spec = LLMAppArgs.model_validate(
                    app_args(model, device, args.max_model_len, args.python)
                )
                deploy_llm_app(spec, name=APP_NAME)
                deploy_s = time.perf_counter() - started
                for path in routers:
                    deploy_router(cluster, spec, path, args.canary_share)
                http_port = ray_internals.serve_client().http_config.port
                base = f"http://{local.HOST}:{http_port}"
                paths = {"direct": ROUTE, **{p: f"/{ROUTER_ROUTES[p]}" for p in routers}}
                measured = [p for p in PATHS if p in paths]
                runs: dict[str, list[dict]] = {p: [] for p in measured}
                ttft: dict[str, list[float]] = {p: [] for p in measured}
                for round_ in range(args.rounds):
                    # The order rotates round by round, so drift in load falls on every path.
                    shift = round_ % len(measured)
                    for path in measured[shift:] + measured[:shift]:
                        url = f"{base}{paths[path]}/v1/completions"
                        runs[path].append(
                            asyncio.run(load(url, args.requests, args.concurrency, args.max_tokens))
                        )
                        ttft[path] += asyncio.run(
                            first_token_ms(url, args.ttft_requests, args.max_tokens)
                        )
                figures = {p: summarize_rounds(runs[p], ttft[p]) for p in measured}
            finally:
                deletes = {serve_control.router_app_name(ROUTER_ROUTES[p]) for p in routers}
                serve_control.apply(deletes=deletes)
                for path in routers:
                    drop_route_state(ROUTER_ROUTES[path])
                serve.delete(APP_NAME)
                if started_serve:
                    serve.shutdown()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    for path, summary in figures.items():
        print(f"{path}: {summary}")
    print(
        f"(deploy {deploy_s:.1f} s, {args.rounds} rounds of {args.requests} requests x "
        f"{args.max_tokens} tokens, {args.concurrency} at a time, device {device})"
    )
    direct = figures["direct"]
    result: dict = {
        "device": device,
        "direct_tokens_per_s": direct["tokens_per_s"],
        "direct_p50_ms": direct["p50_ms"],
        "direct_p99_ms": direct["p99_ms"],
        "direct_ttft_ms": direct["ttft_ms"],
    }
    names = {
        "hosted": ("router", ""),
        "forwarded": ("forwarded", "forwarded_"),
        "canary": ("canary", "canary_"),
    }
    for path in routers:
        field, prefix = names[path]
        routed = figures[path]
        result.update(
            {
                f"{field}_tokens_per_s": routed["tokens_per_s"],
                f"{prefix}ratio": round(routed["tokens_per_s"] / direct["tokens_per_s"], 3),
                f"{prefix}p50_ms": routed["p50_ms"],
                f"{prefix}p99_ms": routed["p99_ms"],
                f"{prefix}ttft_ms": routed["ttft_ms"],
                f"{prefix}ttft_ratio": round(routed["ttft_ms"] / direct["ttft_ms"], 3),
            }
        )
    if "canary" in routers:
        result["canary_candidate_share"] = candidate_share(runs["canary"])
        result["canary_share_configured"] = args.canary_share
    print(json.dumps({**result, "rounds": args.rounds, "statistic": "median"}))
    return 0


def deploy_router(cluster, spec, path: str, canary_share: float) -> None:
    """The router of one path (see the module's docstring), waited for until it serves as
    configured: hosting the live engine where it should, the candidate's share held."""
    import ray

    from prefect_ray_lifecycle.control import serve_control
    from prefect_ray_lifecycle.tasks.rollout.apps import serving_runtime_env
    from prefect_ray_lifecycle.tasks.rollout.config import LLMServing
    from prefect_ray_lifecycle.workloads.serve.route_state import route_state
    from prefect_ray_lifecycle.workloads.serve.router_config import (
        RolloutRecord,
        RouterConfig,
        Target,
    )

    route = ROUTER_ROUTES[path]
    host = path != "forwarded"
    actor = spec.ray_actor_options
    # As a rollout leaves an LLM route: a router that hosts the live version runs in the LLM
    # venv with an LLM replica's resources.
    runtime_env, router_options = LLMServing(
        engine=spec.engine.model_dump(),
        num_cpus=actor["num_cpus"],
        num_gpus=actor.get("num_gpus", 0.0),
        python=spec.python,
        host_in_router=host,
    ).router_serving(serving_runtime_env(cluster), {"max_ongoing_requests": 256})
    live_model = spec.model_copy(update={"route_prefix": None}).model_dump(mode="json")
    config = RouterConfig(
        live=Target(LIVE_VERSION, APP_NAME, "llm", live_model), inline_live=host, timeout_s=120
    )
    if path == "canary":
        ray.get(route_state(route).claim.remote(CANARY_HOLDER, CANARY_LEASE_S, {"bench": True}))
        config = replace(
            config,
            candidate=Target(CANDIDATE_VERSION, APP_NAME, "llm", live_model),
            candidate_weight=canary_share,
            rollout=RolloutRecord(CANARY_HOLDER, "canary", CANDIDATE_VERSION, time.time()),
        )
    app = serve_control.router_app_config(route, config, runtime_env, router_options)
    serve_control.apply({app["name"]: app})
    serve_control.wait_router(
        route, 0, timeout_s=300, inline_version=LIVE_VERSION if host else None
    )
    if path == "canary":
        deadline = time.monotonic() + 60
        while not all(s["candidate_share"] > 0 for s in serve_control.router_status(route)):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the canary router {route} never served its candidate")
            time.sleep(0.5)


if __name__ == "__main__":
    raise SystemExit(main())
