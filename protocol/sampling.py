"""Per-request sampling parameters: what a client asks for, validated.

Torch-free, so that the router (which validates every request's
parameters) and the workers share one definition. The batched sampler that
applies them is engine/sampling.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GREEDY_EPS = 1e-5
MAX_TEMPERATURE = 100.0
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 4096
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOTAL_CHARS = 65536  # the router's limits.max_stop_bytes is tighter
MAX_STOP_TOKEN_IDS = 4096
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1


def _check_int(name: str, value: object, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {type(value).__name__}")
    if value < lo or (hi is not None and value > hi):
        allowed = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {allowed}, got {value}")
    return value


def _check_float(name: str, value: object, lo: float, hi: float, *, lo_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {type(value).__name__}")
    ok = (lo < value if lo_open else lo <= value) and value <= hi
    if not ok:  # also catches NaN
        raise ValueError(
            f"{name} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {value!r}"
        )
    return float(value)


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {type(value).__name__}")
    return value


@dataclass
class SamplingParams:
    """How to pick each token of one request. Every field is validated."""

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, 1)
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens)
        self.temperature = _check_float("temperature", self.temperature, 0, MAX_TEMPERATURE)
        self.top_p = _check_float("top_p", self.top_p, 0, 1, lo_open=True)
        _check_int("top_k", self.top_k, -1)  # 0 and -1 both mean off
        self.min_p = _check_float("min_p", self.min_p, 0, 1)
        self.repetition_penalty = _check_float(
            "repetition_penalty", self.repetition_penalty, 0, 2, lo_open=True
        )
        self.frequency_penalty = _check_float("frequency_penalty", self.frequency_penalty, -2, 2)
        self.presence_penalty = _check_float("presence_penalty", self.presence_penalty, -2, 2)
        if self.seed is not None:
            _check_int("seed", self.seed, _SEED_MIN, _SEED_MAX)
        self.stop = self._checked_stop(self.stop)
        self.stop_token_ids = self._checked_stop_token_ids(self.stop_token_ids)
        _check_bool("ignore_eos", self.ignore_eos)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        _check_bool("skip_special_tokens", self.skip_special_tokens)

    @staticmethod
    def _checked_stop(stop: object) -> list[str]:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list | tuple) or not all(isinstance(s, str) for s in stops):
            raise ValueError("stop must be a str or a list of str")
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"stop must hold at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
        for s in stops:
            if not 1 <= len(s) <= MAX_STOP_STRING_CHARS:
                raise ValueError(
                    f"stop strings must have 1 to {MAX_STOP_STRING_CHARS} characters, got {len(s)}"
                )
        total = sum(len(s) for s in stops)
        if total > MAX_STOP_TOTAL_CHARS:
            raise ValueError(
                f"stop strings must hold at most {MAX_STOP_TOTAL_CHARS} characters, got {total}"
            )
        return list(stops)

    @staticmethod
    def _checked_stop_token_ids(ids: object) -> list[int]:
        if not isinstance(ids, list | tuple):
            raise ValueError("stop_token_ids must be a list of int")
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"stop_token_ids must hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}"
            )
        for t in ids:
            _check_int("stop_token_ids", t, 0)
        return list(ids)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Raise ValueError if a stop token id is outside the model's vocabulary."""
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids must be < vocab_size={vocab_size}, got {bad[:8]}")
