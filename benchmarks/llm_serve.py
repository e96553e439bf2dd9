"""Tokens/s and latency of the vLLM app on Ray Serve: through the router (its stable route,
hosting the live version's engine in its own replica as a rollout leaves it; with
--forward, forwarding every request to the app by DeploymentHandle) versus straight to the
app over HTTP, in the same run.

Starts an embedded local Ray (or joins --address), deploys workloads.llm with a route
(replicas under .venv-llm) and a router whose live target is that app, then sends --requests
completions of --max-tokens tokens each, --concurrency at a time (ignore_eos, so every request
generates exactly that many), then --ttft-requests streamed ones one at a time for the time to
first token, for --rounds rounds with the order of router and direct alternating; medians. The
model is a folder given with --model, else the tiny Llama built locally. A few requests warm
each path first, outside the timing. Last line: one JSON object.
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
from pathlib import Path

ROUTE = "/llm-bench"
APP_NAME = "llm-bench"
ROUTER_ROUTE = "llm-bench-router"
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

    body = completion(max_tokens)
    latencies: list[float] = []
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

        await asyncio.gather(*(one() for _ in range(min(WARMUP_REQUESTS, requests))))
        latencies.clear()
        tokens = 0
        start = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(requests)))
        wall = time.perf_counter() - start
    return {"wall_s": wall, "tokens": tokens, "latencies_ms": latencies}


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
    parser.add_argument("--rounds", type=int, default=3, help="rounds of both sides (>= 3)")
    parser.add_argument(
        "--forward",
        action="store_true",
        help="the router forwards to the app instead of hosting the live version",
    )
    parser.add_argument(
        "--ttft-requests", type=int, default=8, help="streamed requests per side and round"
    )
    args = parser.parse_args(argv)

    from ray import serve

    from deployments import local
    from prefect_ray_lifecycle.blocks import RayCluster
    from prefect_ray_lifecycle.control import serve_control
    from prefect_ray_lifecycle.tasks.rollout.apps import serving_runtime_env
    from prefect_ray_lifecycle.tasks.rollout.config import LLMServing
    from prefect_ray_lifecycle.workloads.llm import LLMAppArgs, deploy_llm_app
    from prefect_ray_lifecycle.workloads.llm.tiny import build_tiny_llm
    from prefect_ray_lifecycle.workloads.serve.router_config import RouterConfig, Target

    device = detect_device() if args.device == "auto" else args.device
    workdir = Path(tempfile.mkdtemp(prefix="bench-llm-"))
    try:
        model = args.model or str(build_tiny_llm(workdir / "tiny", python=args.python))
        cluster = RayCluster(address=args.address, num_cpus=None if args.address else args.num_cpus)
        with cluster.connect():
            from prefect_ray_lifecycle.compat import ray_internals

            started_serve = ray_internals.serve_client_if_running() is None
            if started_serve:
                (port,) = local.free_ports(1)
                serve.start(http_options={"host": local.HOST, "port": port})
            try:
                started = time.perf_counter()
                spec = LLMAppArgs.model_validate(
                    app_args(model, device, args.max_model_len, args.python)
                )
                deploy_llm_app(spec, name=APP_NAME)
                deploy_s = time.perf_counter() - started
                http_port = ray_internals.serve_client().http_config.port
                # As a rollout leaves an LLM route: the router hosts the live version in its
                # replica (in the LLM venv, with an LLM replica's resources), or forwards.
                host = not args.forward
                actor = spec.ray_actor_options
                runtime_env, router_options = LLMServing(
                    engine=spec.engine.model_dump(),
                    num_cpus=actor["num_cpus"],
                    num_gpus=actor.get("num_gpus", 0.0),
                    python=spec.python,
                    host_in_router=host,
                ).router_serving(serving_runtime_env(cluster), {"max_ongoing_requests": 256})
                live = spec.model_copy(update={"route_prefix": None}).model_dump(mode="json")
                router = serve_control.router_app_config(
                    ROUTER_ROUTE,
                    RouterConfig(
                        live=Target("bench", APP_NAME, "llm", live),
                        inline_live=host,
                        timeout_s=120,
                    ),
                    runtime_env,
                    router_options,
                )
                serve_control.apply({router["name"]: router})
                serve_control.wait_router(
                    ROUTER_ROUTE, 0, timeout_s=300, inline_version="bench" if host else None
                )
                base = f"http://{local.HOST}:{http_port}"
                runs: dict[str, list[dict]] = {"router": [], "direct": []}
                ttft: dict[str, list[float]] = {"router": [], "direct": []}
                paths = {"router": f"/{ROUTER_ROUTE}", "direct": ROUTE}
                for round_ in range(args.rounds):
                    # The order alternates round by round, so drift in load falls on both.
                    for side in ("router", "direct") if round_ % 2 == 0 else ("direct", "router"):
                        url = f"{base}{paths[side]}/v1/completions"
                        runs[side].append(
                            asyncio.run(load(url, args.requests, args.concurrency, args.max_tokens))
                        )
                        ttft[side] += asyncio.run(
                            first_token_ms(url, args.ttft_requests, args.max_tokens)
                        )
                direct = summarize_rounds(runs["direct"], ttft["direct"])
                routed = summarize_rounds(runs["router"], ttft["router"])
            finally:
                serve_control.apply(deletes={serve_control.router_app_name(ROUTER_ROUTE)})
                serve.delete(APP_NAME)
                if started_serve:
                    serve.shutdown()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    print(
        f"direct: {direct}\nrouter: {routed}\n(deploy {deploy_s:.1f} s, {args.rounds} "
        f"rounds of {args.requests} requests x {args.max_tokens} tokens, "
        f"{args.concurrency} at a time, device {device})"
    )
    print(
        json.dumps(
            {
                "device": device,
                "router": "forwards" if args.forward else "hosts the live version",
                "router_tokens_per_s": routed["tokens_per_s"],
                "direct_tokens_per_s": direct["tokens_per_s"],
                "ratio": round(routed["tokens_per_s"] / direct["tokens_per_s"], 3),
                "p50_ms": routed["p50_ms"],
                "p99_ms": routed["p99_ms"],
                "direct_p50_ms": direct["p50_ms"],
                "direct_p99_ms": direct["p99_ms"],
                "ttft_ms": routed["ttft_ms"],
                "direct_ttft_ms": direct["ttft_ms"],
                "ttft_ratio": round(routed["ttft_ms"] / direct["ttft_ms"], 3),
                "rounds": args.rounds,
                "statistic": "median",
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
