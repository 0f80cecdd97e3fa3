"""What the load generator sends: prompts with known token lengths, and when to send them.

    LengthDist.parse("uniform:128:1024")      a length distribution (fixed / uniform / normal)
    PromptBuilder(tokenizer).words(n, rng)    text of exactly n tokens (n words without a tokenizer)
    synthetic_samples(...)                    lengths drawn from distributions, with a long/short mix
                                              (exactly long_count(n, fraction) long prompts)
    retext(samples, builder, seed)            the same synthetic lengths with fresh words
    prompt_text(seed, text_seed, reuse)       where an invocation's words come from: a fresh nonce unless a
                                              text seed or reuse was asked for (recorded in results.json)
    sharegpt_samples(path, ...)               first human turn as prompt, first reply's length as output
    mooncake_samples(path, ...)               a JSONL trace replayed at its timestamps; equal hash_ids
                                              give equal text blocks (a shared prefix stays shared)
    arrival_times(n, rate, burstiness, seed)  open-loop send times: Poisson (burstiness 1) or gamma
    assign_policies(n, policies)              request i gets policies[i % len(policies)]

A `Sample` with `copies=k` is repeated k times in a row (fresh random text for synthetic prompts), so
with k = number of policies every policy gets the same prompt lengths through the same schedule.
"""

from __future__ import annotations

import json
import math
import random
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

# Common English words; with a BPE tokenizer " word" is one token for most of them, and only those
# are kept when a tokenizer is given (PromptBuilder), so n words make exactly n tokens.
WORDS = """the of and to in is was for on that with as by at from his her are this be or had not but
which have were one all they their an has been would there who more will when can said time only new
about some into other could them than then also its two first most over after these like where made
many year state world city water house school place number part people work life light night home
day way man name land line end point form hand high long word small great group side right old music
game book story war power case fact area system program question government company field market
river island church report country family friend order music order class paper table green black
white blue red north south east west south early late young good best open close start build keep
turn show play move live read write speak learn teach grow stand sit run walk call ask tell give take
bring hold carry follow lead meet send pay leave begin seem help talk""".split()


class WorkloadError(ValueError):
    """A workload that cannot be built from the given arguments or files; the message says which."""


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution: fixed:N, uniform:LO:HI (inclusive), normal:MEAN:STD (>= 1)."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> "LengthDist":
        parts = spec.split(":")
        try:
            if len(parts) == 1:
                return cls("fixed", int(parts[0]))
            kind, nums = parts[0], [float(x) for x in parts[1:]]
        except ValueError as e:
            raise WorkloadError(f"bad length spec {spec!r}: {e}; use N, fixed:N, uniform:LO:HI or normal:MEAN:STD") from e
        if kind == "fixed" and len(nums) == 1 and nums[0] >= 1:
            return cls("fixed", nums[0])
        if kind == "uniform" and len(nums) == 2 and 1 <= nums[0] <= nums[1]:
            return cls("uniform", nums[0], nums[1])
        if kind == "normal" and len(nums) == 2 and nums[0] >= 1 and nums[1] >= 0:
            return cls("normal", nums[0], nums[1])
        raise WorkloadError(f"bad length spec {spec!r}: use N, fixed:N, uniform:LO:HI (1 <= LO <= HI) "
                         "or normal:MEAN:STD (MEAN >= 1)")

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        return max(1, round(rng.gauss(self.a, self.b)))

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{int(self.a)}"
        return f"{self.kind}:{self.a:g}:{self.b:g}"


@dataclass(frozen=True)
class Sample:
    prompt: str | list[int]  # text, or token ids sent as they are (bench/engine/cpu_served.py)
    prompt_len: int  # tokens: exact with a tokenizer, estimated without
    output_len: int  # max_tokens to ask for
    arrival_s: float | None = None  # trace replay: seconds after the start
    kind: str = "synthetic"  # "short" / "long" for the synthetic mix, or the data source


class PromptBuilder:
    """Makes text of a given token length from single-token words (so lengths add up exactly)."""

    def __init__(self, tokenizer: Tokenizer | None = None):
        self.tokenizer = tokenizer
        if tokenizer is None:
            self.vocab = list(dict.fromkeys(WORDS))
        else:
            self.vocab = [w for w in dict.fromkeys(WORDS)
                          if len(tokenizer.encode(" " + w, add_special_tokens=False)) == 1]
            if len(self.vocab) < 20:
                raise WorkloadError("the tokenizer splits almost every common English word; it cannot be used "
                                 "to build length-controlled prompts (leave --tokenizer out to approximate)")

    @property
    def exact(self) -> bool:
        return self.tokenizer is not None

    def words(self, n: int, rng: random.Random) -> list[str]:
        return rng.choices(self.vocab, k=n)

    def text(self, words: list[str]) -> str:
        return "".join(" " + w for w in words)

    def count(self, text: str) -> int:
        """Tokens in natural text: exact with a tokenizer, else ~4 characters per token."""
        if self.tokenizer is not None:
            return len(self.tokenizer.encode(text, add_special_tokens=False))
        return max(1, round(len(text) / 4))


def long_count(n: int, long_fraction: float) -> int:
    """How many of n prompts are long: n * fraction rounded half up (25% of 10 -> 3, of 24 -> 6)."""
    return math.floor(n * long_fraction + 0.5)


def synthetic_samples(n: int, input_len: LengthDist, output_len: LengthDist, builder: PromptBuilder, *,
                      seed: int, text_seed: int | None = None, long_fraction: float = 0.0,
                      long_input_len: LengthDist | None = None, copies: int = 1) -> list[Sample]:
    """Lengths come from `seed` (the same for every point of a sweep), text from `text_seed`.
    Exactly long_count(n, long_fraction) of the n prompts are long, at seeded positions: a coin per
    prompt would send 3 long prompts of 24 at 25% (seed 0), not the stated 6."""
    if not 0.0 <= long_fraction <= 1.0:
        raise WorkloadError(f"long fraction must be in [0, 1], got {long_fraction}")
    if long_fraction > 0 and long_input_len is None:
        raise WorkloadError("a long/short mix needs the long input length distribution")
    lengths = random.Random(seed)
    text = random.Random(seed if text_seed is None else text_seed)
    long_at = set(lengths.sample(range(n), long_count(n, long_fraction)))
    out = []
    for i in range(n):
        is_long = i in long_at
        n_in = (long_input_len if is_long else input_len).sample(lengths)
        n_out = output_len.sample(lengths)
        for _ in range(copies):
            # each copy gets its own words: no two requests share a prefix a server could cache
            out.append(Sample(builder.text(builder.words(n_in, text)), n_in, n_out,
                              kind="long" if is_long else "short"))
    return out


def retext(samples: list[Sample], builder: PromptBuilder, seed: int) -> list[Sample]:
    """The same lengths with fresh words: for synthetic prompts, whose text is builder words."""
    rng = random.Random(seed)
    return [Sample(builder.text(builder.words(s.prompt_len, rng)), s.prompt_len, s.output_len, s.arrival_s, s.kind)
            for s in samples]


def prompt_text(seed: int, text_seed: int | None = None, reuse: bool = False) -> dict:
    """The invocation's text seed and how it was chosen. By default a random nonce: two invocations with the
    same --seed send the same lengths and arrivals but new words, so a server's prefix cache from the first
    cannot serve the second. text_seed: reproducible text (each run still its own); reuse: every run sends
    the same text (from text_seed, else --seed), so later runs and invocations meet a warm prefix cache."""
    nonce = None if text_seed is not None or reuse else secrets.randbelow(2**31)
    base = nonce if nonce is not None else (seed if text_seed is None else text_seed)
    if reuse:
        note = (f"reused on purpose (--reuse-prompts): every run sends the same text, from text seed {base}; a "
                "server with a prefix cache serves later runs and invocations from it")
    elif nonce is None:
        note = (f"text seed {base} given: each run its own text, the same as any invocation with this text seed "
                "(a server that saw it may serve it from its cache)")
    else:
        note = f"fresh: each run its own text, from this invocation's nonce {nonce}"
    return {"text_seed": base, "nonce": nonce, "reused": reuse or nonce is None, "per_run": not reuse, "note": note}


def _read_text(path: str | Path) -> str:
    try:
        return Path(path).read_text()
    except OSError as e:
        raise WorkloadError(f"cannot read the dataset file: {e}") from e


def _read_json(path: str | Path):
    try:
        return json.loads(_read_text(path))
    except json.JSONDecodeError as e:
        raise WorkloadError(f"{path} is not JSON ({e})") from e


def sharegpt_samples(path: str | Path, n: int, builder: PromptBuilder, *, seed: int,
                     output_len: int | None = None, max_len: int | None = None, copies: int = 1) -> list[Sample]:
    """ShareGPT JSON: [{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}, ...]."""
    data = _read_json(path)
    if not isinstance(data, list):
        raise WorkloadError(f"{path}: a ShareGPT file is a JSON list of conversations")
    convs = [d.get("conversations") or d.get("conversation") for d in data if isinstance(d, dict)]
    convs = [c for c in convs if isinstance(c, list) and len(c) >= 2]
    random.Random(seed).shuffle(convs)
    out: list[Sample] = []
    for conv in convs:
        if len(out) >= n * copies:
            break
        prompt, reply = str(conv[0].get("value", "")), str(conv[1].get("value", ""))
        n_in = builder.count(prompt)
        n_out = output_len if output_len is not None else builder.count(reply)
        if not prompt.strip() or n_out < 2 or (max_len is not None and n_in + n_out > max_len):
            continue
        out.extend(Sample(prompt, n_in, n_out, kind="sharegpt") for _ in range(copies))
    if len(out) < n * copies:
        raise WorkloadError(f"{path}: only {len(out) // copies} usable conversations, {n} asked for "
                         "(lower --num-prompts or raise --max-model-len)")
    return out


def mooncake_samples(path: str | Path, builder: PromptBuilder, *, n: int | None = None, block_size: int = 512,
                     speedup: float = 1.0, seed: int = 0) -> list[Sample]:
    """Mooncake JSONL: {"timestamp": ms, "input_length", "output_length", "hash_ids": [...]} per line. A hash
    id's words come from it and `seed`: shared within a run, new for another seed."""
    if speedup <= 0:
        raise WorkloadError(f"trace speedup must be > 0, got {speedup}")
    rows = []
    for lineno, line in enumerate(_read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise WorkloadError(f"{path}:{lineno}: not JSON ({e}); a Mooncake trace has one JSON object a line") from e
        missing = {"timestamp", "input_length", "output_length"} - set(row)
        if missing:
            raise WorkloadError(f"{path}:{lineno}: a Mooncake trace line needs {sorted(missing)}")
        rows.append(row)
        if n is not None and len(rows) >= n:
            break
    if not rows:
        raise WorkloadError(f"{path}: the trace has no requests")
    t0 = min(r["timestamp"] for r in rows)
    blocks: dict[int, list[str]] = {}
    rng = random.Random(seed)
    out = []
    for row in sorted(rows, key=lambda r: r["timestamp"]):
        n_in = int(row["input_length"])
        words: list[str] = []
        for h in row.get("hash_ids") or []:
            if h not in blocks:
                blocks[h] = builder.words(block_size, random.Random(f"block-{seed}-{h}"))
            words.extend(blocks[h])
        words = words[:n_in] + builder.words(max(0, n_in - len(words)), rng)
        out.append(Sample(builder.text(words), n_in, max(1, int(row["output_length"])),
                          arrival_s=(row["timestamp"] - t0) / 1e3 / speedup, kind="trace"))
    return out


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Send times in seconds from the start, first at 0. Gaps ~ Gamma(shape=burstiness,
    scale=1/(rate*burstiness)): mean 1/rate always; burstiness 1 is Poisson, < 1 burstier."""
    if rate <= 0 or burstiness <= 0:
        raise WorkloadError(f"request rate and burstiness must be > 0, got {rate} and {burstiness}")
    if math.isinf(rate):
        return np.zeros(n)
    gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])]) if n else np.zeros(0)


def assign_policies(n: int, policies: list[str] | None) -> list[str | None]:
    if not policies:
        return [None] * n
    return [policies[i % len(policies)] for i in range(n)]


def load_tokenizer(name: str):
    """The tokenizer of a pdserve model name (all of ours use SmolLM2's) or of a local HF directory."""
    from pdserve.settings import models as models  # transformers imports torch where it is installed: only when asked

    if name in models.MODEL_NAMES:
        return models.load_smollm2_tokenizer()
    if Path(name).is_dir():
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(name)
    raise WorkloadError(f"unknown tokenizer {name!r}: give a pdserve model name ({', '.join(models.MODEL_NAMES)}) "
                        "or a local HuggingFace directory, or leave --tokenizer out to approximate")
