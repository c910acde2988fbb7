"""What the soak sends: one seeded mix of keys, endpoints, models, prompts and behaviours. Pure.

Most requests are ordinary (the alias "chat" mostly, the served name "llama" sometimes; chat
and completions; streamed or not; short prompts and long ones, many sharing a system prompt,
some in sessions). The others are what production also gets: a wrong key, bad input (malformed
JSON, a body nested too deep, an unknown model, a JSON list), slow readers, and clients that
leave at every phase: before the response head, after it, mid-stream after a few tokens, and
while waiting for a non-streamed answer.

Every request asks for ``ignore_eos`` so its length is ``max_tokens`` exactly: a client that
leaves after k tokens of a 128-token stream leaves a request the backend is still running.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal, TypeVar

from loadtest.soak.config import ALIAS, API_KEYS, SERVED_MODEL

Behaviour = Literal[
    "normal",
    "slow_reader",
    "disconnect_before_head",
    "disconnect_after_head",
    "disconnect_mid_stream",
    "disconnect_nonstream_wait",
    "bad_malformed",
    "bad_nested",
    "bad_unknown_model",
    "bad_list",
    "wrong_key",
    "probe",  # the limits probe's requests (not drawn by the mix)
]
DISCONNECTS: Final = frozenset(
    {
        "disconnect_before_head",
        "disconnect_after_head",
        "disconnect_mid_stream",
        "disconnect_nonstream_wait",
    }
)
BAD_INPUT: Final = frozenset({"bad_malformed", "bad_nested", "bad_unknown_model", "bad_list"})
CHAT_PATH: Final = "/v1/chat/completions"
COMPLETIONS_PATH: Final = "/v1/completions"
PROBED_KEY: Final = "internal-tools"
WRONG_KEY: Final = "sk-prod-wrong-example"

# (behaviour, weight); streamed-only behaviours force a stream.
_BEHAVIOURS: Final[tuple[tuple[Behaviour, float], ...]] = (
    ("normal", 70.0),
    ("slow_reader", 4.0),
    ("disconnect_before_head", 4.0),
    ("disconnect_after_head", 4.0),
    ("disconnect_mid_stream", 6.0),
    ("disconnect_nonstream_wait", 4.0),
    ("bad_malformed", 1.0),
    ("bad_nested", 1.0),
    ("bad_unknown_model", 1.0),
    ("bad_list", 1.0),
    ("wrong_key", 2.0),
)
_KEYS: Final = (("web-app", 60.0), ("nightly-batch", 34.0), (PROBED_KEY, 6.0))
_TEXT: Final = (
    "the a of to and in is that for it as with on was be by this are from at or an have not "
    "model request token stream backend cache prefix latency server answer question system "
    "user policy gateway limit memory queue batch client replica canary weight health probe "
    "fault kill restart reload shift rollback window burst error metric series bucket slot"
)
_WORDS: Final = tuple(_TEXT.split())
_STREAMED_ONLY: Final = frozenset({"slow_reader", "disconnect_after_head", "disconnect_mid_stream"})
NESTING: Final = 50_000  # deeper than any JSON parser recurses
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Plan:
    """One request to send, and how the client behaves while it runs."""

    index: int
    replica: int
    behaviour: Behaviour
    key: str  # the key's name, or "wrong"
    api_key: str
    path: str
    body: bytes
    stream: bool
    model: str
    max_tokens: int
    wait_s: float = 0.0  # disconnect_before_head / _nonstream_wait: leave after this long
    leave_after_tokens: int = 0  # disconnect_mid_stream
    session: str | None = None


def _pick(rng: random.Random, options: Sequence[tuple[T, float]]) -> T:
    return rng.choices([o for o, _ in options], weights=[w for _, w in options])[0]


class Mix:
    """Draws the soak's requests; the same seed gives the same run of plans."""

    def __init__(self, seed: int, replicas: int = 2) -> None:
        self._rng = random.Random(seed)
        self._replicas = replicas
        prefix_rng = random.Random(seed ^ 0x5EED)
        # Four long system prompts many requests share (what prefix affinity is for).
        self.prefixes = tuple(
            f"System prompt {g}: " + _words(prefix_rng, 260 + 60 * g) for g in range(4)
        )

    def next(self, index: int, *, probed_key_allowed: bool = True) -> Plan:
        rng = self._rng
        behaviour = _pick(rng, _BEHAVIOURS)
        replica = index % self._replicas
        if behaviour == "wrong_key":
            key, api_key = "wrong", WRONG_KEY
        else:
            keys = _KEYS if probed_key_allowed else _KEYS[:-1]
            key = _pick(rng, keys)
            api_key = API_KEYS[key]
        if behaviour in BAD_INPUT:
            return self._bad(index, replica, behaviour, key, api_key)
        chat = rng.random() < 0.7
        model = ALIAS if rng.random() < 0.8 else SERVED_MODEL
        if behaviour in _STREAMED_ONLY:
            stream = True
        elif behaviour == "disconnect_nonstream_wait":
            stream = False
        else:
            stream = rng.random() < 0.7
        long_answer = behaviour in DISCONNECTS
        max_tokens = rng.randint(128, 256) if long_answer else rng.randint(8, 96)
        body = self._body(model, max_tokens, chat=chat, stream=stream)
        session = f"session-{rng.randrange(40)}" if rng.random() < 0.2 else None
        wait_s = 0.0
        if behaviour == "disconnect_before_head":
            wait_s = rng.uniform(0.001, 0.04)
        elif behaviour == "disconnect_nonstream_wait":
            wait_s = rng.uniform(0.4, 1.0)
        return Plan(
            index=index,
            replica=replica,
            behaviour=behaviour,
            key=key,
            api_key=api_key,
            path=CHAT_PATH if chat else COMPLETIONS_PATH,
            body=body,
            stream=stream,
            model=model,
            max_tokens=max_tokens,
            wait_s=wait_s,
            leave_after_tokens=rng.randint(1, 8) if behaviour == "disconnect_mid_stream" else 0,
            session=session,
        )

    def _body(self, model: str, max_tokens: int, *, chat: bool, stream: bool) -> bytes:
        body: dict[str, object] = {"model": model, "max_tokens": max_tokens, "ignore_eos": True}
        system, user = self._prompt()
        if chat:
            messages = [{"role": "user", "content": user}]
            if system:
                messages.insert(0, {"role": "system", "content": system})
            body["messages"] = messages
        else:
            body["prompt"] = f"{system}\n\n{user}" if system else user
        if stream:
            body["stream"] = True
            if self._rng.random() < 0.5:
                body["stream_options"] = {"include_usage": True}
        return json.dumps(body, separators=(",", ":")).encode()

    def _prompt(self) -> tuple[str, str]:
        """(system prompt or "", user text): short or long, often after a shared prefix."""
        rng = self._rng
        system = rng.choice(self.prefixes) if rng.random() < 0.5 else ""
        n = rng.randint(8, 40) if rng.random() < 0.75 else rng.randint(200, 600)
        return system, _words(rng, n)

    def _bad(self, index: int, replica: int, behaviour: Behaviour, key: str, api_key: str) -> Plan:
        if behaviour == "bad_malformed":
            body = b'{"model": "chat", "messages": [{"role": "user", "content": "hi"}'
        elif behaviour == "bad_nested":
            body = b'{"model":"chat","messages":' + b"[" * NESTING + b"]" * NESTING + b"}"
        elif behaviour == "bad_unknown_model":
            body = json.dumps(
                {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}
            ).encode()
        else:
            body = b'[{"model": "chat", "messages": [{"role": "user", "content": "hi"}]}]'
        return Plan(index, replica, behaviour, key, api_key, CHAT_PATH, body, False, "", 0)


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def probe_plan(index: int, replica: int) -> Plan:
    """One request of the limits probe: the probed key, one token, not streamed."""
    body = {"model": ALIAS, "prompt": "limits probe", "max_tokens": 1, "ignore_eos": True}
    return Plan(
        index=index,
        replica=replica,
        behaviour="probe",
        key=PROBED_KEY,
        api_key=API_KEYS[PROBED_KEY],
        path=COMPLETIONS_PATH,
        body=json.dumps(body, separators=(",", ":")).encode(),
        stream=False,
        model=ALIAS,
        max_tokens=1,
    )
