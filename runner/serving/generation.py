"""Generation for one API call: its requests' token events from the AsyncEngine, merged as they come, run to the end
or until the client leaves, with engine failures turned into API errors and OpenAI's usage counts."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from runner.core.async_engine import AsyncEngine, EngineOverloaded, EngineStopped
from runner.core.engine import TokenEvent
from runner.core.request import Request as EngineRequest
from runner.serving.protocol import APIError

Disconnected = Callable[[], Awaitable[bool]]  # whether the client has left (Starlette's Request.is_disconnected)


def usage(groups: list[list[EngineRequest]], completion: int | None = None) -> dict:
    """`completion`: the tokens sent so far, where the stream is behind the engine (continuous usage stats)."""
    prompt = sum(len(g[0].prompt_token_ids) for g in groups)
    if completion is None:
        completion = sum(len(r.output_token_ids) for g in groups for r in g)
    cached = sum(g[0].num_cached_tokens for g in groups)  # prompt tokens the prefix cache held (0 without it)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


async def token_events(engine: AsyncEngine, groups: list[list[EngineRequest]]) -> AsyncIterator[TokenEvent]:
    """Events of all requests of one HTTP call, as they come."""
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(group: list[EngineRequest]) -> None:
        try:
            async for event in engine.generate(group):
                await merged.put(event)
        except BaseException as err:  # noqa: BLE001 - handed to the consumer, which re-raises it
            await merged.put(err)
        finally:
            await merged.put(None)

    tasks = [asyncio.create_task(pump(g)) for g in groups]
    try:
        remaining = len(tasks)
        while remaining:
            item = await merged.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()  # aborts whatever the client no longer waits for
        await asyncio.gather(*tasks, return_exceptions=True)


def engine_error(err: BaseException) -> APIError:
    if isinstance(err, EngineOverloaded):
        return APIError(503, str(err), "server_overloaded")
    if isinstance(err, EngineStopped):
        return APIError(503, str(err), "server_shutting_down")
    return APIError(500, f"generation failed: {err}", "server_error")


async def run_to_end(engine: AsyncEngine, disconnected: Disconnected, groups: list[list[EngineRequest]]) -> bool:
    """Generate the requests to their end; False when the client left first (generation then stops)."""
    watcher = asyncio.create_task(_watch_disconnect(disconnected))
    collector = asyncio.create_task(_collect(token_events(engine, groups)))
    done, _ = await asyncio.wait({watcher, collector}, return_when=asyncio.FIRST_COMPLETED)
    if collector not in done:
        collector.cancel()
        await asyncio.gather(collector, return_exceptions=True)
        return False
    watcher.cancel()
    if collector.exception() is not None:
        raise engine_error(collector.exception())
    return True


async def first_event(events: AsyncIterator[TokenEvent]) -> TokenEvent | None:
    """A stream's first event, awaited before its 200 is sent, so that capacity errors are still HTTP errors."""
    try:
        return await events.__anext__()
    except StopAsyncIteration:
        return None
    except Exception as err:
        raise engine_error(err) from None


async def _collect(events: AsyncIterator[TokenEvent]) -> None:
    async for _ in events:
        pass


async def _watch_disconnect(disconnected: Disconnected) -> None:
    while not await disconnected():
        await asyncio.sleep(0.25)
