"""`runner run-batch`: a file of OpenAI Batch API requests answered offline, as vLLM's `run-batch` does.

Each input line is one request, `{"custom_id", "method": "POST", "url", "body"}`, for /v1/chat/completions,
/v1/completions or /v1/responses; each output line, in input order, is OpenAI's batch result
`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`. The requests go to the server's
own endpoints in this process (runner/serving/app.py through an in-memory ASGI transport, no socket), so a batch line
is answered exactly as the same request sent to `runner serve`, errors included; many lines are in flight at once,
so the engine batches them.
"""

from __future__ import annotations

import asyncio
import collections
import json
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import httpx

BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


@dataclass
class BatchCounts:
    lines: int = 0
    answered: int = 0  # status 200
    failed: int = 0  # an error status, or a line that is not a request
    completion_tokens: int = 0


async def run_batch(app, lines: Iterable[str], write: Callable[[str], None], in_flight: int) -> BatchCounts:
    """Answer every request line of `lines` with `app` (create_app's), `in_flight` at a time, and `write` each result
    line in input order."""
    counts = BatchCounts()
    limit = asyncio.Semaphore(in_flight)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)  # a failing line answers 500, as served
    async with httpx.AsyncClient(transport=transport, base_url="http://batch", timeout=None) as client:

        async def answer(number: int, line: str) -> dict:
            try:
                custom_id, url, body = _request(line)
            except ValueError as err:
                return _result(_custom_id(line), None, {"code": "invalid_request", "message": f"line {number}: {err}"})
            async with limit:
                reply = await client.post(url, json=body)
            try:
                answer_body = reply.json()
            except ValueError:  # (an unhandled failure's plain-text 500)
                answer_body = {"error": {"message": reply.text, "type": "server_error", "code": reply.status_code}}
            return _result(
                custom_id,
                {"status_code": reply.status_code, "request_id": f"batch-req-{uuid.uuid4().hex}", "body": answer_body},
                None,
            )

        pending: collections.deque[asyncio.Task] = collections.deque()

        def done(result: dict) -> None:
            response = result["response"]
            ok = response is not None and response["status_code"] == 200
            counts.answered += ok
            counts.failed += not ok
            if ok:
                usage = response["body"].get("usage") or {}
                counts.completion_tokens += usage.get("completion_tokens", usage.get("output_tokens", 0))
            write(json.dumps(result, ensure_ascii=False))

        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            counts.lines += 1
            pending.append(asyncio.create_task(answer(number, line)))
            if len(pending) >= 4 * in_flight:  # results go out in order; a bounded window keeps memory flat
                done(await pending.popleft())
        while pending:
            done(await pending.popleft())
    return counts


def _request(line: str) -> tuple[str, str, dict]:
    try:
        request = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"not JSON: {err}") from None
    if not isinstance(request, dict) or not isinstance(request.get("custom_id"), str):
        raise ValueError('a batch request is {"custom_id": str, "method": "POST", "url": ..., "body": {...}}')
    if request.get("method", "POST") != "POST" or request.get("url") not in BATCH_URLS:
        raise ValueError(f"method must be POST and url one of {', '.join(BATCH_URLS)}")
    body = request.get("body")
    if not isinstance(body, dict):
        raise ValueError("body must be an object")
    if body.get("stream"):
        raise ValueError("a batch request cannot stream")
    return request["custom_id"], request["url"], body


def _custom_id(line: str) -> str | None:
    try:
        value = json.loads(line).get("custom_id")
    except (json.JSONDecodeError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def _result(custom_id: str | None, response: dict | None, error: dict | None) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": response, "error": error}
