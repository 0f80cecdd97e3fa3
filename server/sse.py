"""A completion streamed as server-sent events (OpenAI's chunk stream), from its choices' Token and Done
events as the dispatcher runs them.

    completion_events(api, rid, model, prompt_tokens, options, choices, events) -> the stream's text
        one event per token; a choice's last token and its finish reason in one event; the last event
        carries the usage (the prompt counted once) and pdserve's timings (choice 0's); then
        `data: [DONE]`. stream_options: OpenAI's include_usage (every event says "usage": null, and a
        last one with empty choices carries the usage), vLLM's continuous_usage_stats (every event
        carries the usage so far). An error once the stream has started travels as an event.
"""

from __future__ import annotations

import json
import logging
from typing import AsyncIterator

from pdserve.protocol.timings import Timings
from pdserve.server import responses
from pdserve.server.apis import Api
from pdserve.server.errors import APIError
from pdserve.server.job import Done, Token
from pdserve.server.requests import StreamOptions

log = logging.getLogger("pdserve.router")


async def completion_events(api: Api, rid: str, model: str, prompt_tokens: int, options: StreamOptions | None,
                            choices: list[responses.ChoiceBuilder],
                            events: AsyncIterator[tuple[int, Token | Done]]) -> AsyncIterator[str]:
    created = responses.now_s()
    usage_event = options is not None and options.usage_event()
    continuous = usage_event and options.continuous_usage_stats
    generated = 0  # tokens of every choice so far
    held: dict[int, tuple[str, list[int]]] = {}  # choice -> its last token, sent with its Done in one event
    completion_tokens, left = 0, len(choices)
    timings = Timings()  # choice 0's, as a whole response reports them
    try:
        async for i, event in events:
            c = choices[i]
            if isinstance(event, Token):
                text = c.add(event.token_id, event.text, event.logprobs, event.prompt_logprobs)
                generated += 1
                if event.last:  # the Done follows at once: one final event carries both
                    held[i] = (text, [event.token_id])
                else:
                    body = responses.chunk_body(api, rid, created, model, c.delta(text, [event.token_id]),
                                                null_usage=usage_event)
                    if continuous:
                        body["usage"] = responses.usage(prompt_tokens, generated)
                    yield event_text(body)
                continue
            text, ids = held.pop(i, ("", []))
            body = responses.chunk_body(api, rid, created, model, c.delta(text, ids, event.finish_reason),
                                        null_usage=usage_event)
            if continuous:
                body["usage"] = responses.usage(prompt_tokens, generated)
            completion_tokens += len(event.token_ids)
            timings = event.timings if i == 0 else timings
            left -= 1
            if left:
                yield event_text(body)
                continue
            if usage_event:
                yield event_text(body)
                body = responses.usage_chunk_body(api, rid, created, model)
            # the prompt counted once (and its cached tokens: choice 0's)
            body["usage"] = responses.usage(prompt_tokens, completion_tokens, timings.cached_tokens)
            body["timings"] = timings.to_dict()
            yield event_text(body)
    except APIError as e:
        log.warning("request %s failed mid-stream: %s", rid, e.message)
        yield event_text(e.body())
    except Exception as e:  # the stream has started: the error can only travel as an event
        log.exception("request %s failed mid-stream", rid)
        yield event_text(APIError(500, f"request {rid}: internal error: {type(e).__name__}: {e}",
                                  "server_error", None, "internal_error").body())
    yield "data: [DONE]\n\n"


def event_text(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"
