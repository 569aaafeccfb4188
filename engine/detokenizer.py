"""Incremental detokenizer with stop strings.

Decoding: each step decodes only a short window of token ids, from
``_start`` (a point where earlier text was complete) to the end, and hands
out the characters of that window not handed out before (``_consumed``
counts them). A window whose text ends in U+FFFD holds an incomplete UTF-8
character: those trailing replacement chars wait for the next tokens. When
a window ends cleanly it slides forward, so each step costs O(1) decodes
of a few tokens, not O(length).

Stop strings: one Aho-Corasick automaton over all stop strings (built once
per distinct stop list) scans each new character once. Its state after the
last character is the longest suffix of the text that is a prefix of some
stop string: exactly the text to hold back, since it may still become a stop.
Workers build a request's automaton (``stop_matcher``) before they hand the
request to the engine thread, so a long stop list never holds a step back;
built automata are kept in an LRU cache bounded in bytes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

_PROMPT_CONTEXT_TOKENS = 6  # prompt tokens decoded before the first output token
_MAX_DIRTY_WINDOW = 16  # a window still ending in U+FFFD is cut back past this many tokens
_DIRTY_KEEP = 8  # tokens kept when cutting; they hold the incomplete char (<= 3 bytes)
_REPLACEMENT = "\ufffd"
_STATE_BYTES = 360  # one automaton state: its children dict, three list slots, ints
STOP_CACHE_BYTES = 64 << 20


@dataclass
class DetokenizerUpdate:
    text_delta: str  # new text safe to emit now
    stopped: bool  # a stop string matched; text_delta ends right before it


class StopMatcher:
    """Aho-Corasick automaton over a set of stop strings; immutable once built.

    State 0 is the root. ``depth[s]`` is the length of the string state s
    stands for; ``match_len[s]`` the length of the longest stop string that
    ends there (0: none).
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.children: list[dict[str, int]] = [{}]
        self.depth = [0]
        self.match_len = [0]
        for stop in stops:
            self._insert(stop)
        self.fail = [0] * len(self.children)
        self._link()

    def _insert(self, stop: str) -> None:
        node = 0
        for ch in stop:
            nxt = self.children[node].get(ch)
            if nxt is None:
                nxt = len(self.children)
                self.children[node][ch] = nxt
                self.children.append({})
                self.depth.append(self.depth[node] + 1)
                self.match_len.append(0)
            node = nxt
        self.match_len[node] = len(stop)

    def _link(self) -> None:
        queue = deque(self.children[0].values())
        while queue:
            node = queue.popleft()
            for ch, child in self.children[node].items():
                f = self.fail[node]
                while f and ch not in self.children[f]:
                    f = self.fail[f]
                self.fail[child] = self.children[f].get(ch, 0)
                if not self.match_len[child]:
                    self.match_len[child] = self.match_len[self.fail[child]]
                queue.append(child)

    @property
    def nbytes(self) -> int:
        """An estimate of the memory the automaton holds."""
        return len(self.children) * _STATE_BYTES

    def step(self, state: int, ch: str) -> int:
        children, fail = self.children, self.fail
        while state and ch not in children[state]:
            state = fail[state]
        return children[state].get(ch, 0)


class StopMatcherCache:
    """Built automata by stop list, least recently used evicted past ``max_bytes``.
    Thread-safe; an automaton is built outside the lock (two threads may build
    the same one; both results are equal)."""

    def __init__(self, max_bytes: int = STOP_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[str, ...], StopMatcher] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, stops: tuple[str, ...]) -> StopMatcher:
        with self._lock:
            found = self._entries.get(stops)
            if found is not None:
                self._entries.move_to_end(stops)
                return found
        built = StopMatcher(stops)
        if built.nbytes > self.max_bytes:
            return built  # used, never kept
        with self._lock:
            if stops not in self._entries:
                self._entries[stops] = built
                self.nbytes += built.nbytes
            while self.nbytes > self.max_bytes:
                _, old = self._entries.popitem(last=False)
                self.nbytes -= old.nbytes
        return built


_CACHE = StopMatcherCache()


def stop_matcher(stop: Sequence[str]) -> StopMatcher | None:
    """The automaton of a stop list (cached), None for no stop strings. Call it
    off the engine thread and hand the result to ``LLMEngine.add_request``."""
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    return _CACHE.get(stops) if stops else None


def _decoder(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """``tokenizer.decode`` over a list of ids. A Hugging Face fast tokenizer
    whose decode does nothing past its Rust backend's (no space clean-up, no
    override) is called through the backend directly: the same text, without
    the Python wrapper, whose cost a decode step pays once or twice per
    sequence."""
    import transformers

    fast = getattr(transformers, "PreTrainedTokenizerFast", None)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (
        fast is not None
        and backend is not None
        and type(tokenizer).decode is fast.decode
        and type(tokenizer)._decode is fast._decode
        and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False
    ):
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Token ids in, text deltas out; never a broken character or a stop string."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        matcher: StopMatcher | None = None,
    ) -> None:
        """``matcher``: ``stop_matcher(stop)``, built already; None builds it here."""
        self._decode_ids = _decoder(tokenizer, skip_special_tokens)
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._start = 0  # window start in _ids
        self._clean = len(self._ids)  # _ids length when the window last ended cleanly
        self._consumed = len(self._decode(0))  # chars of the window already handed on
        self._matcher = matcher if matcher is not None else stop_matcher(stop)
        self._state = 0  # automaton state after all text handed on
        self._held = ""  # text handed on but held back as a possible stop prefix
        self._chunks: list[str] = []
        self._stopped = False

    @property
    def text(self) -> str:
        return "".join(self._chunks)

    @property
    def stopped(self) -> bool:
        return self._stopped

    def add(self, token_id: int) -> DetokenizerUpdate:
        if self._stopped:
            return DetokenizerUpdate("", True)
        self._ids.append(token_id)
        return self._scan(self._new_text(final=False))

    def finish(self) -> str:
        """Flush held text (incomplete characters, possible stop prefixes)."""
        if self._stopped:
            return ""
        update = self._scan(self._new_text(final=True))
        if update.stopped:
            return update.text_delta
        rest, self._held, self._state = self._held, "", 0
        self._chunks.append(rest)
        return update.text_delta + rest

    def _decode(self, start: int) -> str:
        return self._decode_ids(self._ids[start:])

    def _new_text(self, final: bool) -> str:
        """Characters that are complete now and were not handed on before."""
        window = self._decode(self._start)
        ready = window if final else window.rstrip(_REPLACEMENT)
        delta = ready[self._consumed :]
        self._consumed = max(self._consumed, len(ready))
        if len(ready) == len(window):  # ends cleanly: slide the window
            self._start, self._clean = self._clean, len(self._ids)
            self._consumed = len(self._decode(self._start))
        elif len(self._ids) - self._start > _MAX_DIRTY_WINDOW:
            self._cut_dirty_window(len(window) - len(ready))
        return delta

    def _cut_dirty_window(self, pending: int) -> None:
        """Shorten a window that keeps ending in an incomplete character.

        Safe only when the tail is one incomplete character (one U+FFFD of at
        most 3 bytes), which then lies inside the last _DIRTY_KEEP tokens.
        """
        start = len(self._ids) - _DIRTY_KEEP
        window = self._decode(start)
        tail = len(window) - len(window.rstrip(_REPLACEMENT))
        if pending == 1 and tail == 1:
            self._start = self._clean = start
            self._consumed = len(window) - 1

    def _scan(self, delta: str) -> DetokenizerUpdate:
        """Pass new text through the stop-string matcher."""
        m = self._matcher
        if m is None:
            self._chunks.append(delta)
            return DetokenizerUpdate(delta, False)
        pending = self._held + delta
        state = self._state
        for i in range(len(self._held), len(pending)):
            state = m.step(state, pending[i])
            if m.match_len[state]:
                out = pending[: i + 1 - m.match_len[state]]
                self._stopped = True
                self._chunks.append(out)
                return DetokenizerUpdate(out, True)
        self._state = state
        keep = m.depth[state]
        out, self._held = pending[: len(pending) - keep], pending[len(pending) - keep :]
        self._chunks.append(out)
        return DetokenizerUpdate(out, False)
