"""Output text: simple, deterministic, stable across processes.

The tokenizer is the gateway's word tokenizer (``gateway/tokenizer/words.py``: a token is a
whitespace-separated word, vocabulary words have ids 0..VOCAB_SIZE-1), so the gateway's
``SimTokenizer`` and the simulator give a prompt the same ids by construction. Generated words
come from the vocabulary, so a generated answer pasted into the next prompt tokenises back to
the ids that were generated, and a multi-turn chat hits the prefix cache the way it would on a
real server.

Stop strings (``cut_at_stops``) end an answer as vLLM's detokenizer does: at the token whose
text completes the earliest match, the text cut just before it, and, while streaming, the
last ``len(longest stop) - 1`` characters held back until the next token shows they are not
the start of a match.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Final

from gateway.tokenizer.words import VOCAB, VOCAB_SIZE, word_id

_M64: Final = (1 << 64) - 1


def detokenize(ids: Sequence[int]) -> str:
    """The text of token ids: vocabulary words joined by spaces (an id outside the
    vocabulary, a hashed word, cannot be told back and is left out)."""
    return " ".join(VOCAB[i] for i in ids if 0 <= i < VOCAB_SIZE)


def mix64(x: int) -> int:
    """SplitMix64's finaliser: a cheap, well-spread, deterministic hash of an int."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def prompt_seed(prompt_ids: Sequence[int], seed: int) -> int:
    """A seed derived from the prompt, so the same prompt gets the same answer.

    The hash of a tuple of ints is not salted, so this is stable across processes.
    """
    return mix64((hash(tuple(prompt_ids)) ^ seed) & _M64)


def natural_length(seed: int, low: int, high: int) -> int:
    """How many tokens an answer runs before its EOS token (EOS included)."""
    return low + mix64(seed ^ 0x5DEECE66D) % (high - low + 1)


@dataclass(frozen=True, slots=True)
class StopCut:
    """An answer's text under stop strings: ``text`` (cut before a matched stop string) and
    how much of it had been released after each token (``ends``, the last one all of it)."""

    text: str
    ends: tuple[int, ...]
    stop: str | None  # the stop string matched, None if the answer ended otherwise


@dataclass(frozen=True, slots=True)
class OutputText:
    """The answer to one request, token by token: ``token_id(i)`` and ``piece(i)``.

    ``random`` draws vocabulary words from the seed; ``echo`` repeats ``source``
    (the prompt's words) cyclically. ``eos_index`` is the position of the EOS token,
    whose text is empty, or None when the answer is cut by length. With stop strings,
    ``cut`` gives each token's released text instead (``cut_at_stops``).
    """

    seed: int
    source: tuple[str, ...] = ()
    eos_index: int | None = None
    cut: StopCut | None = None

    @property
    def stop_reason(self) -> str | None:
        """The stop string that ended the answer (vLLM's ``stop_reason``), if one did."""
        return None if self.cut is None else self.cut.stop

    def token_id(self, index: int) -> int:
        if index == self.eos_index:
            return EOS_TOKEN_ID
        if self.source:
            return word_id(self.source[index % len(self.source)])
        return mix64(self.seed + index) % VOCAB_SIZE

    def piece(self, index: int) -> str:
        cut = self.cut
        if cut is not None:
            return cut.text[cut.ends[index - 1] if index else 0 : cut.ends[index]]
        return self._word(index)

    def _word(self, index: int) -> str:
        if index == self.eos_index:
            return ""
        if self.source:
            return " " + self.source[index % len(self.source)]
        return " " + VOCAB[mix64(self.seed + index) % VOCAB_SIZE]

    def text(self, count: int) -> str:
        cut = self.cut
        if cut is not None:
            return cut.text[: cut.ends[count - 1]] if count else ""
        return "".join(self._word(i) for i in range(count))


def cut_at_stops(output: OutputText, count: int, stops: Sequence[str]) -> tuple[int, OutputText]:
    """The first ``count`` tokens of ``output`` under stop strings: how many are generated
    and their text. The answer ends at the token that completes a stop string (the match
    completing earliest, ties in list order, as vLLM's ``check_stop_strings``), its text
    cut before it; a stream holds back ``len(longest) - 1`` characters until the next token."""
    stops = [s for s in stops if s]
    if not stops or count < 1:
        return count, output
    hold = max(len(s) for s in stops) - 1
    text = ""
    ends: list[int] = []
    for i in range(count):
        new = output._word(i)
        text += new
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for s in stops:
            at = text.find(s, max(0, len(text) + 1 - len(new) - len(s)))
            if at != -1 and (best is None or at + len(s) < best[0]):
                best = (at + len(s), at, s)
        if best is not None:
            text = text[: best[1]]
            ends.append(len(text))
            cut = StopCut(text, tuple(ends), best[2])
            return i + 1, replace(output, eos_index=None, cut=cut)
        ends.append(max(len(text) - hold, ends[-1] if ends else 0))
    ends[-1] = len(text)  # the last token releases everything
    return count, replace(output, cut=StopCut(text, tuple(ends), None))


EOS_TOKEN_ID: Final = VOCAB_SIZE - 1 + (1 << 33)  # outside both id ranges above
