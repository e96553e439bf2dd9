"""The LLMServer Serve deployment: one model version behind OpenAI's completion endpoints,
reached by HTTP or by the router's handle, answering whole or streamed."""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray import serve

from prefect_ray_lifecycle.workloads.constants import (
    LLM_DEPLOYMENT,
    REQUEST_ID_HEADER,
    SHADOW_KEY,
    STREAM_FAILED_KEY,
    VERSION_HEADER,
)
from prefect_ray_lifecycle.workloads.http import JSON_TYPE, BadRequest, request_dict
from prefect_ray_lifecycle.workloads.llm.config import LLMAppArgs, LLMFaults
from prefect_ray_lifecycle.workloads.llm.engine import (
    EngineLoop,
    ReplicaStats,
    make_engine,
    warm_up,
)
from prefect_ray_lifecycle.workloads.llm.models import download_from_mlflow, model_cache_dir
from prefect_ray_lifecycle.workloads.llm.protocol import (
    EVENT_STREAM_TYPE,
    SSE_DONE,
    AnswerFormat,
    CompletionRequest,
    bad_request_body,
    compact_json,
    endpoint,
    error_body,
    generation_budget,
    invalid,
    models_body,
    openai_request_id,
    parse_json_body,
    sse,
    usage,
)

__all__ = ["WARMUP_PROMPT", "LLMServer", "download_from_mlflow", "model_cache_dir"]

logger = logging.getLogger("ray.serve")

WARMUP_PROMPT = "ray serve"


@dataclass
class Reply:
    """An HTTP answer: a whole body, or (stream) an async iterator of SSE chunks."""

    status: int
    headers: dict[str, str]
    body: bytes = b""
    stream: AsyncIterator[bytes] | None = None
    generation: Generation | None = None  # a completion's: its token ids, once it is done

    def shadow(self) -> dict[str, Any] | None:
        """What a shadow comparison needs of this answer: the completion's token ids."""
        if self.generation is None:
            return None
        return {"token_ids": list(self.generation.token_ids)}


@serve.deployment(name=LLM_DEPLOYMENT)
class LLMServer:
    """One model version behind OpenAI's /v1/completions and /v1/chat/completions."""

    def __init__(self, args: dict):
        spec = LLMAppArgs.model_validate(args)
        self.version = spec.resolved_version_label()
        self.model_name = spec.resolved_served_model_name()
        self.health_timeout_s = spec.health_check_timeout_s
        self.stats_data = ReplicaStats()
        self.faults = LLMFaults()  # a drill's, from the user_config (reconfigure)
        self.rejected_config: str | None = None
        started = time.monotonic()
        if spec.mlflow is not None:
            model_dir = download_from_mlflow(spec.mlflow)
        else:
            model_dir = Path(spec.model)
            if not (model_dir / "config.json").exists():
                raise FileNotFoundError(f"model folder {model_dir} has no config.json on this node")
        engine = make_engine(model_dir, spec.engine, self.model_name)
        self.max_model_len = engine.model_config.max_model_len
        # A tokenizer of our own: vLLM's detokenizes on the engine thread. Only the LLM venv
        # has transformers.
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.tokenizer.model_max_length = 1 << 30  # lengths are checked against max_model_len
        self.vocab_size = len(self.tokenizer)
        self.engine_start_s = time.monotonic() - started
        if spec.warmup:
            warm_up(engine, self._warmup_prompt_ids(), self.health_timeout_s)
        self.engine = EngineLoop(engine)
        logger.info(
            "LLM %s (version %s) ready in %.1f s, max_model_len %d",
            self.model_name,
            self.version,
            time.monotonic() - started,
            self.max_model_len,
        )

    def _warmup_prompt_ids(self) -> list[int]:
        """The warm-up prompt, chat-templated when the model has a template."""
        if not self.tokenizer.chat_template:
            return self.tokenizer.encode(WARMUP_PROMPT)
        text = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": WARMUP_PROMPT}], add_generation_prompt=True, tokenize=False
        )
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def _one_token(self, purpose: str) -> int:
        from vllm import SamplingParams

        prompt_ids = self.tokenizer.encode(WARMUP_PROMPT)
        params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0)
        tokens = 0
        async for output in self.engine.generate(
            f"{purpose}-{uuid.uuid4().hex}", prompt_ids, params
        ):
            tokens += len(output.outputs[0].token_ids)
        if tokens != 1:
            raise RuntimeError(f"{purpose}: the engine generated {tokens} tokens, not 1")
        return tokens

    def reconfigure(self, config: dict[str, Any]) -> None:
        # Never raises (Serve stops a replica whose reconfigure raises) and is idempotent.
        try:
            self.faults = LLMFaults.parse((config or {}).get("faults"))
        except ValueError as error:
            self.rejected_config = str(error)
            logger.error("ignored a bad user_config %r: %s", config, error)
            return
        self.rejected_config = None

    async def check_health(self) -> None:
        """Serve's health check: the engine generates one token in time, or this raises."""
        if not self.engine.alive():
            raise RuntimeError(f"vLLM engine loop is down: {self.engine.failure!r}")
        tokens = await asyncio.wait_for(
            self._one_token("health"), timeout=self.health_timeout_s * 0.8
        )
        self.stats_data.health_tokens += tokens

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.stop()

    async def __call__(self, request):
        """Direct HTTP through Serve's proxy (when the app has a route)."""
        from starlette.responses import Response, StreamingResponse

        path = request.url.path
        root = request.scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :] or "/"
        # Read at most the body limit + 1 byte: a bigger body is a 413, never read whole.
        body = (await request_dict(request))["body"]
        reply = await self._respond(request.method, path, dict(request.headers), body)
        # Serve's proxy answers with X-Request-Id itself: the one it put on the request (the
        # client's, or a new one), which is the id used here.
        reply.headers.pop(REQUEST_ID_HEADER.lower(), None)
        if reply.stream is not None:
            return StreamingResponse(
                reply.stream,
                status_code=reply.status,
                headers=reply.headers,
                media_type=EVENT_STREAM_TYPE,
            )
        return Response(reply.body, status_code=reply.status, headers=reply.headers)

    async def handle_http(self, request: dict) -> dict:
        """For the router's DeploymentHandle: {"method", "path", "query", "headers", "body"}
        in, {"status", "headers", "body"} out (a streamed answer is gathered whole). Asked for
        a shadow comparison (SHADOW_KEY), it also carries the completion's token ids."""
        reply = await self._respond(
            request.get("method", "POST"),
            request.get("path", "/"),
            request.get("headers") or {},
            request.get("body") or b"",
        )
        body = reply.body
        if reply.stream is not None:
            body = b"".join([chunk async for chunk in reply.stream])
        answer = {"status": reply.status, "headers": reply.headers, "body": body}
        if request.get(SHADOW_KEY) and reply.status == 200:
            answer[SHADOW_KEY] = reply.shadow()
        return answer

    async def handle_http_stream(self, request: dict):
        """Streaming twin of handle_http (call with handle.options(stream=True)): first
        {"status", "headers"}, then the body as bytes chunks (SSE for "stream": true); last,
        {STREAM_FAILED_KEY: True} when the stream failed after its first byte, else, asked for
        a shadow comparison, {SHADOW_KEY: the token ids}. The router keeps both."""
        reply = await self._respond(
            request.get("method", "POST"),
            request.get("path", "/"),
            request.get("headers") or {},
            request.get("body") or b"",
        )
        yield {"status": reply.status, "headers": reply.headers}
        if reply.stream is not None:
            async for chunk in reply.stream:
                yield chunk
        elif reply.body:
            yield reply.body
        if reply.generation is not None and reply.generation.failed:
            yield {STREAM_FAILED_KEY: True}
        elif request.get(SHADOW_KEY) and reply.status == 200:
            yield {SHADOW_KEY: reply.shadow()}

    async def stats(self, reset: bool = False) -> dict:
        """Counters and latency samples since start (or the last reset), for canary analysis."""
        data = self.stats_data
        if reset:
            self.stats_data = ReplicaStats()
        return {
            "version": self.version,
            "model": self.model_name,
            **data.counters(),
            "engine_start_s": round(self.engine_start_s, 3),
            "faults": self.faults.model_dump(),
            **data.series(),
        }

    def _headers(self, request_id: str, content_type: str = JSON_TYPE) -> dict[str, str]:
        return {
            "content-type": content_type,
            VERSION_HEADER.lower(): self.version,
            REQUEST_ID_HEADER.lower(): request_id,
        }

    def _json_reply(self, status: int, request_id: str, body: dict[str, Any]) -> Reply:
        return Reply(status, self._headers(request_id), compact_json(body))

    def _error_reply(self, status: int, request_id: str, body: dict[str, Any]) -> Reply:
        self.stats_data.count_error(status)
        return self._json_reply(status, request_id, body)

    async def _respond(self, method: str, path: str, headers: dict, body: bytes) -> Reply:
        headers = {k.lower(): v for k, v in headers.items()}
        request_id = openai_request_id(headers)
        try:
            kind = endpoint(method, path)
            if kind == "models":
                answer = models_body(self.model_name, self.max_model_len, self.version)
                return self._json_reply(200, request_id, answer)
            if kind == "health":
                if not self.engine.alive():
                    return self._error_reply(503, request_id, error_body(503, "engine is down"))
                return self._json_reply(200, request_id, {"status": "ok"})
            self.stats_data.requests += 1
            return await self._complete(parse_json_body(body), kind == "chat", request_id)
        except BadRequest as error:
            return self._error_reply(error.status, request_id, bad_request_body(error))
        except Exception as exc:
            logger.exception("request %s failed", request_id)
            failure = error_body(500, f"internal error: {exc}", code="internal_error")
            return self._error_reply(500, request_id, failure)

    def _prompt_ids(self, request: CompletionRequest) -> list[int]:
        if request.chat:
            if not self.tokenizer.chat_template:
                raise invalid(
                    f"{self.model_name} has no chat template: use /v1/completions",
                    param="messages",
                    code="unsupported",
                )
            from jinja2 import TemplateError

            try:
                text = self.tokenizer.apply_chat_template(
                    request.turns, add_generation_prompt=True, tokenize=False
                )
            except TemplateError as exc:  # e.g. a template that wants alternating roles
                raise invalid(
                    f"the model's chat template refuses these messages: {exc}",
                    param="messages",
                    code="invalid_value",
                ) from None
            return self.tokenizer.encode(text, add_special_tokens=False)
        if isinstance(request.prompt, str):
            return self.tokenizer.encode(request.prompt)
        return request.prompt

    async def _complete(self, payload: dict, chat: bool, request_id: str) -> Reply:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        request = CompletionRequest.from_body(
            payload, chat=chat, model_name=self.model_name, vocab_size=self.vocab_size
        )
        prompt_ids = self._prompt_ids(request)
        max_tokens = generation_budget(
            len(prompt_ids), self.max_model_len, request.sampling.max_tokens, chat=chat
        )
        params = SamplingParams(
            **request.sampling.engine_kwargs(max_tokens),
            # Deltas for whole answers too: time to first token is measured either way.
            output_kind=RequestOutputKind.DELTA,
        )
        answer_format = AnswerFormat.for_request(
            request_id,
            chat=chat,
            model=self.model_name,
            version=self.version,
            include_usage=request.include_usage,
        )
        generation = Generation(self, request_id, prompt_ids, params, answer_format)
        if request.stream:
            faults = self.faults
            if faults.stream_refuse_rate and random.random() < faults.stream_refuse_rate:
                refused = error_body(503, "stream refused by a drill", code="drill")
                return self._error_reply(503, request_id, refused)
            generation.break_after = faults.stream_break_after_tokens
            headers = self._headers(request_id, EVENT_STREAM_TYPE)
            return Reply(200, headers, stream=generation.sse(), generation=generation)
        try:
            answer = await generation.whole()
        except BadRequest:
            raise
        except Exception as exc:
            failure = error_body(500, f"generation failed: {exc}", code="engine_error")
            return self._error_reply(500, request_id, failure)
        reply = self._json_reply(200, request_id, answer)
        reply.generation = generation
        return reply


class Generation:
    """One completion request through the engine, answered as one JSON body or as SSE chunks,
    and recorded in the replica's stats."""

    def __init__(
        self,
        server: LLMServer,
        request_id: str,
        prompt_ids: list[int],
        params,
        answer_format: AnswerFormat,
    ):
        self.server, self.request_id = server, request_id
        self.prompt_ids, self.params, self.format = prompt_ids, params, answer_format
        self.started = time.perf_counter()
        self.first_token_at: float | None = None
        self.completion_tokens = 0
        self.token_ids: list[int] = []
        self.break_after = 0  # a drill's: the stream fails after this many tokens (0: never)
        self.failed = False  # the stream ended with an error event of the version's own

    def _usage(self) -> dict[str, int]:
        return usage(len(self.prompt_ids), self.completion_tokens)

    async def _outputs(self):
        engine_id = f"{self.request_id}-{uuid.uuid4().hex[:8]}"
        async for output in self.server.engine.generate(engine_id, self.prompt_ids, self.params):
            completion = output.outputs[0]
            delay_s = self.server.faults.token_delay_ms / 1000 * len(completion.token_ids)
            if delay_s:  # a drill's slow tokens
                await asyncio.sleep(delay_s)
            if completion.token_ids and self.first_token_at is None:
                self.first_token_at = time.perf_counter()
            self.completion_tokens += len(completion.token_ids)
            self.token_ids.extend(completion.token_ids)
            yield completion
            tokens = self.completion_tokens
            if self.break_after and tokens >= self.break_after and not completion.finish_reason:
                raise RuntimeError(f"stream broken by a drill after {tokens} tokens")

    def _record(self) -> None:
        self.server.stats_data.record(
            len(self.prompt_ids),
            self.completion_tokens,
            self.started,
            self.first_token_at,
            time.perf_counter(),
        )

    async def whole(self) -> dict[str, Any]:
        texts, finish_reason = [], None
        async for completion in self._outputs():
            texts.append(completion.text)
            finish_reason = completion.finish_reason or finish_reason
        self._record()
        return self.format.whole("".join(texts), finish_reason, self._usage())

    async def sse(self) -> AsyncIterator[bytes]:
        try:
            if self.format.chat:
                yield sse(self.format.chunk("", None, role=True))
            async for completion in self._outputs():
                if completion.text or completion.finish_reason:
                    yield sse(self.format.chunk(completion.text, completion.finish_reason))
            self._record()
            if self.format.include_usage:
                yield sse(self.format.usage_chunk(self._usage()))
        except BadRequest as error:  # the request's fault, not the version's
            self.server.stats_data.count_error(error.status)
            yield sse(bad_request_body(error))
        except Exception as exc:
            self.failed = True
            self.server.stats_data.count_error(500)
            yield sse(error_body(500, f"generation failed: {exc}", code="engine_error"))
        yield SSE_DONE
