"""What to send: seeded, reproducible request streams. Pure: no I/O, no clock.

A ``Workload`` yields ``RequestSpec``s, each with the exact JSON body to POST. The same
workload and seed always yield the same requests, whatever the load shape.

Token counts are whitespace-separated words, which is how the simulator tokenizes (one token
per word); against a real vLLM the counts are approximate (~1.3 tokens per English word).

Length distributions
    ``fixed``, ``uniform`` (inclusive bounds), or ``lognormal`` given by its median and
    sigma and clipped to [low, high]. ``CHAT_PROMPT`` and ``CHAT_OUTPUT`` mimic chat traffic:
    their means match the ShareGPT figures reported in the vLLM paper (Kwon et al., 2023,
    fig. 11: mean prompt 161 tokens, mean output 338 tokens; ShareGPT is the dataset vLLM's
    ``benchmark_serving`` uses), with a heavy right tail. The sigmas (1.0 and 0.9) are our
    choice for that tail, not a fit to the raw data: median = mean / exp(sigma^2 / 2).

Shared prefixes
    ``PrefixGroups(groups=N, length=L, hot_share=h)``: every prompt starts with one of N
    fixed L-token prefixes (a system prompt; in chat, the system message). Group 0 gets a
    share ``h`` of requests and the others split the rest evenly; ``h=None`` is uniform.
    ``hot_length`` gives group 0 a prefix of its own length (say, a chat app's short system
    prompt beside long per-task contexts); unset, it is ``length`` too.

Multi-turn sessions
    ``turns=T``: a session is T requests; turn k's prompt is turn k-1's prompt, then a
    stand-in for its answer (as many words as that turn's ``max_tokens``), then a new user
    message drawn from the prompt distribution. Sessions are emitted ``interleave`` at a
    time, turn-major, and ``RequestSpec.after`` names the turn that must finish first.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

LengthKind = Literal["fixed", "uniform", "lognormal"]
Endpoint = Literal["chat", "completions"]

# Common words keep prompts readable in logs; the simulator treats any word as a token.
_VOCAB: tuple[str, ...] = (
    "the", "of", "and", "to", "in", "is", "you", "that", "it", "he", "was", "for", "on", "are",
    "as", "with", "his", "they", "at", "be", "this", "have", "from", "or", "one", "had", "by",
    "word", "but", "not", "what", "all", "were", "we", "when", "your", "can", "said", "there",
    "use", "an", "each", "which", "she", "do", "how", "their", "if", "will", "up", "other",
    "about", "out", "many", "then", "them", "these", "so", "some", "her", "would", "make",
    "like", "him", "into", "time", "has", "look", "two", "more", "write", "go", "see",
    "number", "no", "way", "could", "people", "my", "than", "first", "water", "been", "call",
    "who", "oil", "its", "now", "find", "long", "down", "day", "did", "get", "come", "made",
    "may", "part", "over", "new", "sound", "take", "only", "little", "work", "know", "place",
    "year", "live", "me", "back", "give", "most", "very", "after", "thing", "our", "just",
    "name", "good", "sentence", "man", "think", "say", "great", "where", "help", "through",
    "much", "before", "line", "right", "too", "mean", "old", "any", "same", "tell", "boy",
    "follow", "came", "want", "show",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class LengthDist:
    kind: LengthKind = "fixed"
    value: int = 128  # fixed
    low: int = 1  # uniform bounds (inclusive) and lognormal clip
    high: int = 4096
    median: float = 128.0  # lognormal
    sigma: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "uniform", "lognormal"):
            raise ValueError(f"unknown length distribution {self.kind!r}")
        if self.kind == "fixed" and self.value < 1:
            raise ValueError("a fixed length must be at least 1")
        if not 1 <= self.low <= self.high:
            raise ValueError(f"need 1 <= low <= high, got {self.low}..{self.high}")
        if self.kind == "lognormal" and not (self.median > 0 and self.sigma >= 0):
            raise ValueError("lognormal needs median > 0 and sigma >= 0")

    @classmethod
    def fixed(cls, n: int) -> LengthDist:
        return cls("fixed", value=n)

    @classmethod
    def uniform(cls, low: int, high: int) -> LengthDist:
        return cls("uniform", low=low, high=high)

    @classmethod
    def lognormal(cls, median: float, sigma: float, low: int = 1, high: int = 4096) -> LengthDist:
        return cls("lognormal", median=median, sigma=sigma, low=low, high=high)

    @property
    def mean(self) -> float:
        """The mean before clipping."""
        if self.kind == "fixed":
            return float(self.value)
        if self.kind == "uniform":
            return (self.low + self.high) / 2
        return self.median * math.exp(self.sigma**2 / 2)

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return self.value
        if self.kind == "uniform":
            return rng.randint(self.low, self.high)
        n = round(rng.lognormvariate(math.log(self.median), self.sigma))
        return min(max(n, self.low), self.high)


CHAT_PROMPT = LengthDist.lognormal(median=161 / math.exp(0.5), sigma=1.0, low=4, high=3072)
CHAT_OUTPUT = LengthDist.lognormal(median=338 / math.exp(0.405), sigma=0.9, low=1, high=1024)


@dataclass(frozen=True, slots=True)
class PrefixGroups:
    groups: int = 0  # 0: no shared prefix
    length: int = 0  # tokens per prefix
    hot_share: float | None = None  # share of requests in group 0; None: uniform
    hot_length: int | None = None  # tokens of group 0's prefix; None: ``length``

    def __post_init__(self) -> None:
        if self.groups < 0 or self.length < 0 or (self.hot_length or 0) < 0:
            raise ValueError("prefix groups and lengths must not be negative")
        if self.hot_share is not None and not 0.0 <= self.hot_share <= 1.0:
            raise ValueError("hot_share must be within 0..1")

    def pick(self, rng: random.Random) -> int | None:
        if self.groups == 0 or self.length == 0:
            return None
        if self.hot_share is None or self.groups == 1:
            return rng.randrange(self.groups)
        if rng.random() < self.hot_share:
            return 0
        return 1 + rng.randrange(self.groups - 1)

    def length_of(self, group: int) -> int:
        if group == 0 and self.hot_length is not None:
            return self.hot_length
        return self.length


@dataclass(frozen=True, slots=True)
class RequestSpec:
    index: int  # position in the workload's sequence
    session: int
    turn: int
    after: int | None  # index of the request that must finish before this one is sent
    group: int | None  # shared-prefix group
    prompt_tokens: int
    max_tokens: int
    path: str  # /v1/chat/completions or /v1/completions
    body: dict[str, Any] = field(hash=False, compare=True)


@dataclass(frozen=True, slots=True)
class Workload:
    model: str = "sim-model"
    endpoint: Endpoint = "chat"
    stream: bool = True
    prompt: LengthDist = field(default_factory=lambda: LengthDist.fixed(128))
    output: LengthDist = field(default_factory=lambda: LengthDist.fixed(64))
    prefix: PrefixGroups = field(default_factory=PrefixGroups)
    turns: int = 1
    interleave: int = 16  # sessions in progress at once (turns > 1)
    ignore_eos: bool = True  # exactly max_tokens out, as benchmark_serving does by default
    seed: int = 0

    def __post_init__(self) -> None:
        if self.endpoint not in ("chat", "completions"):
            raise ValueError(f"endpoint must be chat or completions, got {self.endpoint!r}")
        if self.turns < 1 or self.interleave < 1:
            raise ValueError("turns and interleave must be at least 1")

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"

    def requests(self) -> Iterator[RequestSpec]:
        """The endless, reproducible sequence of requests."""
        rng = random.Random(f"workload-{self.seed}")
        prefixes: dict[int, list[str]] = {}
        index = 0
        session = 0
        while True:
            batch = [
                self._session(session + k, rng, prefixes)
                for k in range(self.interleave if self.turns > 1 else 1)
            ]
            session += len(batch)
            first_index = index
            for turn in range(self.turns):
                for k, turns in enumerate(batch):
                    group, prompt_tokens, max_tokens, body = turns[turn]
                    after = None if turn == 0 else first_index + (turn - 1) * len(batch) + k
                    yield RequestSpec(
                        index=index,
                        session=session - len(batch) + k,
                        turn=turn,
                        after=after,
                        group=group,
                        prompt_tokens=prompt_tokens,
                        max_tokens=max_tokens,
                        path=self.path,
                        body=body,
                    )
                    index += 1

    def take(self, n: int) -> list[RequestSpec]:
        it = self.requests()
        return [next(it) for _ in range(n)]

    def _session(
        self, session: int, rng: random.Random, prefixes: dict[int, list[str]]
    ) -> list[tuple[int | None, int, int, dict[str, Any]]]:
        group = self.prefix.pick(rng)
        prefix: list[str] = []
        if group is not None:
            if group not in prefixes:
                prng = random.Random(f"prefix-{self.seed}-{group}")
                length = self.prefix.length_of(group)
                prefixes[group] = [prng.choice(_VOCAB) for _ in range(length)]
            prefix = prefixes[group]
        messages: list[dict[str, str]] = []
        if prefix:
            messages.append({"role": "system", "content": " ".join(prefix)})
        turns: list[tuple[int | None, int, int, dict[str, Any]]] = []
        for turn in range(self.turns):
            if turn > 0:
                answer = [rng.choice(_VOCAB) for _ in range(turns[-1][2])]
                messages.append({"role": "assistant", "content": " ".join(answer)})
            # A session tag first, so two sessions never share more than the group prefix.
            words = [f"s{session}t{turn}"]
            words += [rng.choice(_VOCAB) for _ in range(max(self.prompt.sample(rng) - 1, 0))]
            messages.append({"role": "user", "content": " ".join(words)})
            max_tokens = self.output.sample(rng)
            tokens = sum(len(m["content"].split()) for m in messages)
            turns.append((group, tokens, max_tokens, self._body(list(messages), max_tokens)))
        return turns

    def _body(self, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "max_tokens": max_tokens}
        if self.endpoint == "chat":
            body["messages"] = messages
        else:
            body["prompt"] = "\n".join(m["content"] for m in messages)
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body
