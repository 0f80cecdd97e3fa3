"""The multi-turn workload: conversations replayed turn by turn, each turn's prompt the previous prompt,
the reply the server actually gave, and a new user message, so a server with prefix reuse prefills only
the new part of every later turn.

    conversations(n, turns, ...)     seeded plans: every user message's text and length, every reply's
                                     max_tokens (lengths from --seed, words from the run's text seed)
    run_conversations(client, ...)   every conversation's turns in order, --think-time after each reply;
                                     conversations start at a seeded Poisson rate, or N at a time
    warmup_samples(convs, builder)   single-turn prompts as long as each turn's context, fresh words
                                     (no prefix shared with the measured conversations)

Chat (/v1/chat/completions, the default for this workload) sends the growing messages list, the
assistant's reply being the text it returned. Its template puts special tokens around every message,
so each earlier turn's tokens come out the same in the next prompt: the previous prompt is an exact
token prefix (up to the reply, which is re-tokenized from text). Plain completions send the
concatenated text; there the join between the previous prompt and the reply may merge into one new
token, losing the last block of reuse per turn.

Turns are numbered from 1 (a conversation's first request). A turn that fails ends its conversation
(the next turn has no reply to build on): the turns not sent are recorded as failed, naming the turn
that failed.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Callable

from pdserve.bench.load.runner import Planned, SendOptions, send_one
from pdserve.bench.load.metrics import RequestRecord
from pdserve.bench.load.workload import LengthDist, PromptBuilder, Sample, WorkloadError, arrival_times


@dataclass(frozen=True)
class Turn:
    message: str  # the user's new message
    message_len: int  # its tokens (exact with a tokenizer)
    output_len: int  # max_tokens of the reply


@dataclass(frozen=True)
class Conversation:
    index: int
    turns: tuple[Turn, ...]

    def planned_prompt_lens(self) -> list[int]:
        """Each turn's prompt in tokens, as planned: the messages and replies so far (chat template
        tokens not counted; the server's usage gives the real count)."""
        lens, total = [], 0
        for t, turn in enumerate(self.turns):
            total += turn.message_len + (self.turns[t - 1].output_len if t else 0)
            lens.append(total)
        return lens


def conversations(n: int, turns: int, first_len: LengthDist, new_len: LengthDist, output_len: LengthDist,
                  builder: PromptBuilder, *, seed: int, text_seed: int) -> list[Conversation]:
    """Lengths from `seed` (the same conversations' shapes in every run and arm), words from `text_seed`
    (fresh per run, so no run reuses another's cache)."""
    if n < 1 or turns < 1:
        raise WorkloadError(f"a multi-turn run needs >= 1 conversation of >= 1 turn, got {n} x {turns}")
    lengths, text = random.Random(seed), random.Random(text_seed)
    out = []
    for c in range(n):
        plan = []
        for t in range(turns):
            m = (first_len if t == 0 else new_len).sample(lengths)
            plan.append(Turn(builder.text(builder.words(m, text)), m, output_len.sample(lengths)))
        out.append(Conversation(c, tuple(plan)))
    return out


def warmup_samples(convs: list[Conversation], builder: PromptBuilder, seed: int) -> list[Sample]:
    """One fresh single-turn prompt per turn length of the first conversation."""
    rng = random.Random(seed)
    conv = convs[0]
    return [Sample(builder.text(builder.words(n, rng)), n, turn.output_len, kind=f"turn {t + 1}")
            for t, (n, turn) in enumerate(zip(conv.planned_prompt_lens(), conv.turns))]


async def run_conversation(client, conv: Conversation, policy: str | None, opts: SendOptions, t0: float,
                           start_s: float, think_s: float, on_done: Callable[[RequestRecord], None]
                           ) -> list[RequestRecord]:
    """Turn 1 is due at start_s (seconds after t0), each later turn think_s after the previous reply
    ended; a turn's due time is its scheduled_s, so a late send shows as lateness."""
    records: list[RequestRecord] = []
    messages: list[dict] = []  # chat: the conversation so far
    prompt = ""  # completions: the text so far
    n = len(conv.turns)
    for t, (turn, planned_len) in enumerate(zip(conv.turns, conv.planned_prompt_lens())):
        due = start_s if t == 0 else time.perf_counter() - t0 + think_s
        await asyncio.sleep(max(0.0, t0 + due - time.perf_counter()))
        messages = messages + [{"role": "user", "content": turn.message}]
        prompt = prompt + turn.message
        p = Planned(conv.index * n + t, Sample(prompt, planned_len, turn.output_len, kind=f"turn {t + 1}"), policy,
                    send_at_s=due, messages=messages if opts.chat else None,
                    conversation=conv.index, turn=t + 1)
        rec = await send_one(client, p, t0, opts)
        records.append(rec)
        on_done(rec)
        if not rec.success:
            for later in range(t + 1, n):
                lost = RequestRecord(conv.index * n + later, policy, 0, conv.turns[later].output_len,
                                     scheduled_s=time.perf_counter() - t0, start_s=time.perf_counter() - t0,
                                     error=f"not sent: turn {t + 1} of conversation {conv.index} failed "
                                           f"({rec.error})",
                                     kind=f"turn {later + 1}", conversation=conv.index, turn=later + 1)
                records.append(lost)
                on_done(lost)
            break
        messages = messages + [{"role": "assistant", "content": rec.reply}]
        prompt = prompt + rec.reply
    return records


async def run_conversations(client, convs: list[Conversation], policy: str | None, opts: SendOptions, *,
                            think_s: float, rate: float | None = None, concurrency: int | None = None,
                            burstiness: float = 1.0, seed: int = 0,
                            on_done: Callable[[RequestRecord], None] = lambda r: None
                            ) -> tuple[list[RequestRecord], float]:
    """Conversations start at `rate` per second (seeded arrivals, as the single-turn open loop) or
    `concurrency` at a time (the next starting when one ends). Returns every turn's record in
    (conversation, turn) order and the run's duration."""
    if (rate is None) == (concurrency is None):
        raise ValueError("give a conversation rate or a number of conversations in flight, not both")
    t0 = time.perf_counter()

    if rate is not None:
        starts = arrival_times(len(convs), rate, burstiness, seed=seed)
        done = await asyncio.gather(*(run_conversation(client, c, policy, opts, t0, float(s), think_s, on_done)
                                      for s, c in zip(starts, convs)))
    else:
        todo = list(reversed(convs))
        done = []

        async def worker():
            while todo:
                done.append(await run_conversation(client, todo.pop(), policy, opts, t0, time.perf_counter() - t0,
                                                   think_s, on_done))

        await asyncio.gather(*(worker() for _ in range(min(int(concurrency), len(convs)))))
    duration = time.perf_counter() - t0
    return sorted((r for recs in done for r in recs), key=lambda r: r.index), duration
