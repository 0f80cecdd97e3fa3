"""Heavy parsing kept to a share of the router's time (server/pacing.py), and oversized fields refused by
their length before the body is walked (server/body.py's check_sizes)."""

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from pdserve.server import body as body_mod
from pdserve.server.body import parse_body
from pdserve.server.errors import APIError
from pdserve.server.pacing import Pacer
from pdserve.server.requests import CompletionRequest


def test_paced_jobs_take_at_most_their_share_and_leave_the_loop_its_turns():
    """Six jobs of 40 ms each (holding their thread as a parse holds the interpreter), sent at once: at a
    share of 0.25 they take >= 6 x 40 / 0.25 - 3 x 40 ms of wall time (the last job's gap is not waited),
    one at a time, and a ticker on the event loop runs between every two of them."""
    async def main():
        pacer, ticks, running, most = Pacer(0.25), [], [0], [0]

        def job(_):
            running[0] += 1
            most[0] = max(most[0], running[0])
            time.sleep(0.04)
            running[0] -= 1

        async def ticker(stop):
            while not stop.is_set():
                ticks.append(time.monotonic())
                await asyncio.sleep(0.005)

        stop = asyncio.Event()
        tick = asyncio.create_task(ticker(stop))
        with ThreadPoolExecutor(4) as pool:
            t0 = time.monotonic()
            await asyncio.gather(*(pacer.run(pool, job, None) for _ in range(6)))
            wall = time.monotonic() - t0
        stop.set()
        await tick
        return wall, pacer.busy_s, most[0], ticks

    wall, busy, most, ticks = asyncio.run(main())
    assert most == 1 and busy == pytest.approx(0.24, abs=0.05)
    assert wall >= busy / 0.25 - 3 * 0.04 - 0.02, (wall, busy)
    gaps = [b - a for a, b in zip(ticks, ticks[1:])]
    assert len(ticks) > 60 and max(gaps) < 0.1, max(gaps)  # the loop ran throughout, between the jobs
    with pytest.raises(ValueError):
        Pacer(0)


def test_fields_over_their_length_are_refused_before_the_body_is_walked(monkeypatch):
    walked = []
    monkeypatch.setattr(body_mod, "check_tree", lambda data: walked.append(data))
    sizes = {"allowed_token_ids": (100, "holds {n} ids; at most {most}"), "bad_words": (4, "holds {n} words; at most {most}"),
             "bad_words.chars": (50, "holds {n} characters; at most {most}")}
    for fields, words in (({"allowed_token_ids": list(range(101))}, "holds 101 ids; at most 100"),
                          ({"bad_words": ["a"] * 5}, "holds 5 words; at most 4"),
                          ({"bad_words": ["a" * 30, "b" * 21]}, "holds 51 characters; at most 50")):
        raw = json.dumps({"prompt": "hi", **fields}).encode()
        with pytest.raises(APIError) as e:
            parse_body(raw, CompletionRequest, sizes)
        assert words in e.value.message and e.value.param == next(iter(fields))
    assert walked == []
    ok = parse_body(json.dumps({"prompt": "hi", "allowed_token_ids": list(range(100)),
                                "bad_words": ["a" * 25, "b" * 25]}).encode(), CompletionRequest, sizes)
    assert ok.allowed_token_ids == list(range(100)) and len(walked) == 1
