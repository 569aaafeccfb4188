"""Incremental detokenizer: text equals a full decode, no broken characters,
stop strings found across token boundaries and never emitted."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.detokenizer import DetokenizerUpdate, IncrementalDetokenizer, StopMatcher

pytestmark = pytest.mark.unit

_CORPUS = [
    "héllo wörld 日本語 🙂 the quick brown fox jumps over the lazy dog. " * 3,
    "Ünïcödé ß café naïve résumé — “quotes” 中文 한국어 ελληνικά русский. ",
    "The answer is 42. END of story. Stop here, or keep going until the end. ",
    "def add(a, b):\n    return a + b\n\n# tabs\tand  spaces   matter\n",
] * 20


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def sentencepiece_style():
    """Llama-2/Mistral style: Metaspace, byte-fallback tokens <0xNN>, a decoder that strips
    the leading space of the decoded string."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    def configure(tok: Tokenizer) -> Tokenizer:
        tok.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
        tok.decoder = decoders.Sequence(
            [
                decoders.Replace("▁", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )
        return tok

    base = configure(Tokenizer(models.BPE(unk_token="<unk>")))
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    base.train_from_iterator(_CORPUS, trainer)
    model = json.loads(base.to_str())["model"]
    vocab = dict(model["vocab"])
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = configure(Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True)))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


class ChunkTokenizer:
    """Token id i is the byte string chunks[i]; decode is lossy UTF-8, like byte-level BPE.

    Lets a test split bytes anywhere, and records the longest window decoded.
    """

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks
        self.longest_decode = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.longest_decode = max(self.longest_decode, len(ids))
        return b"".join(self.chunks[i] for i in ids).decode("utf-8", errors="replace")


def _chunked(data: bytes, sizes: list[int]) -> list[bytes]:
    chunks, pos, i = [], 0, 0
    while pos < len(data):
        chunks.append(data[pos : pos + sizes[i % len(sizes)]])
        pos += len(chunks[-1])
        i += 1
    return chunks


def _run(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], bool]:
    deltas = []
    for t in ids:
        update = detok.add(t)
        deltas.append(update.text_delta)
        if update.stopped:
            return deltas, True
    deltas.append(detok.finish())
    return deltas, False


def _reference_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """Cut before the stop string that completes first (longest one if several end there)."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            return text[: end - max(map(len, hits))], True
    return text, False


# ---------------------------------------------------------------- decoding


@pytest.mark.parametrize(
    "text",
    [
        "héllo wörld 日本語 🙂",
        "The quick brown fox 🦊 jumps 𝄞 over 中文 text.",
        "   leading spaces\n\nand newlines\t",
        "Ünïcödé ß café naïve résumé — “quotes” 한국어",
    ],
)
@pytest.mark.parametrize("prompt", ["", "Prompt: 日"])
def test_concatenated_deltas_equal_full_decode(tokenizer, text, prompt):
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas, stopped = _run(detok, ids)
    assert not stopped
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert detok.text == text


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(max_size=40), prompt=st.text(max_size=10))
def test_random_unicode_roundtrip(tokenizer, text, prompt):
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, _ = _run(IncrementalDetokenizer(tokenizer, prompt_ids), ids)
    assert "".join(deltas) == tokenizer.decode(ids)
    if "\ufffd" not in text:
        assert all("\ufffd" not in d for d in deltas)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ids=st.lists(st.integers(0, 389), max_size=30))
def test_random_token_ids_match_full_decode(tokenizer, ids):
    """Arbitrary ids may form invalid UTF-8; the lossy result must still match."""
    deltas, _ = _run(IncrementalDetokenizer(tokenizer, [5, 6]), ids)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(alphabet="ab cdé日本語🙂𝄞中文\n", max_size=25), prompt=st.text(max_size=6))
def test_sentencepiece_style_roundtrip_in_context(sentencepiece_style, text, prompt):
    """Byte-fallback pieces and a decoder that strips the leading space: the output keeps
    the space the prompt context gives it, as decoding prompt + output would."""
    tok = sentencepiece_style
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    ids = tok.encode(text, add_special_tokens=False)
    deltas, _ = _run(IncrementalDetokenizer(tok, prompt_ids), ids)
    in_context = tok.decode(prompt_ids + ids)[len(tok.decode(prompt_ids)) :]
    assert "".join(deltas) == in_context
    if "\ufffd" not in prompt:
        assert all("\ufffd" not in d for d in deltas)


def test_special_tokens_skipped_or_kept(tokenizer):
    ids = [*tokenizer.encode("ab", add_special_tokens=False), tokenizer.eos_token_id]
    skipped, _ = _run(IncrementalDetokenizer(tokenizer, []), ids)
    kept, _ = _run(IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False), ids)
    assert "".join(skipped) == "ab"
    assert "".join(kept) == "ab</s>"


def test_split_multibyte_character_never_emitted_broken(tokenizer):
    text = "a 𝄞 b 🦋 c"  # characters absent from the corpus: one token per byte
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any(tokenizer.decode([t]) == "\ufffd" for t in ids), "fixture must split a character"
    detok = IncrementalDetokenizer(tokenizer, [])
    deltas = [detok.add(t).text_delta for t in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.finish() == text
    assert "".join(deltas).endswith("c")  # nothing left waiting once the text is complete


@given(
    text=st.text(min_size=1, max_size=30),
    sizes=st.lists(st.integers(1, 5), min_size=1, max_size=6),
)
@settings(max_examples=150, deadline=None)
def test_any_byte_split_never_emits_replacement_char(text, sizes):
    data = text.encode()
    tok = ChunkTokenizer(_chunked(data, sizes))
    detok = IncrementalDetokenizer(tok, [])
    deltas = [detok.add(i).text_delta for i in range(len(tok.chunks))]
    if "\ufffd" not in text:
        assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.finish() == text


@given(data=st.binary(max_size=80), sizes=st.lists(st.integers(1, 3), min_size=1, max_size=4))
@settings(max_examples=150, deadline=None)
def test_arbitrary_bytes_match_lossy_decode(data, sizes):
    tok = ChunkTokenizer(_chunked(data, sizes))
    deltas, _ = _run(IncrementalDetokenizer(tok, []), list(range(len(tok.chunks))))
    assert "".join(deltas) == data.decode("utf-8", errors="replace")


def test_long_run_of_invalid_bytes_is_kept_exact():
    data = b"ab" + b"\x80" * 40 + "日".encode()[:2] + b"\xbf" * 30 + "ok 🙂".encode()
    tok = ChunkTokenizer(_chunked(data, [1]))
    deltas, _ = _run(IncrementalDetokenizer(tok, []), list(range(len(tok.chunks))))
    assert "".join(deltas) == data.decode("utf-8", errors="replace")


def test_characters_straddling_every_token_keep_window_short():
    """No token ends on a character boundary, so the window never ends cleanly."""
    text = "日本語の文章" * 100
    tok = ChunkTokenizer(_chunked(text.encode(), [1, *[3] * 1000]))
    detok = IncrementalDetokenizer(tok, [])
    deltas = [detok.add(i).text_delta for i in range(len(tok.chunks))]
    assert "".join(deltas) + detok.finish() == text
    assert all("\ufffd" not in d for d in deltas)
    assert sum(1 for d in deltas if d) > len(deltas) // 2  # text flows, not held to the end
    assert tok.longest_decode <= 20


def test_window_stays_short_on_long_output(tokenizer):
    ids = tokenizer.encode(_CORPUS[0] * 5, add_special_tokens=False)
    calls: list[int] = []

    class Spy:
        def decode(self, window, skip_special_tokens=True):
            calls.append(len(window))
            return tokenizer.decode(window, skip_special_tokens=skip_special_tokens)

    detok = IncrementalDetokenizer(Spy(), tokenizer.encode("ctx", add_special_tokens=False))
    deltas, _ = _run(detok, ids)
    assert "".join(deltas) == _CORPUS[0] * 5
    assert max(calls) <= 8
    assert len(calls) <= 2 * len(ids) + 3  # two per token, one at start, two in finish


# ---------------------------------------------------------------- stop strings


def test_stop_string_spanning_tokens_is_found_and_excluded():
    tok = ChunkTokenizer([b"Hel", b"lo W", b"orld", b" again"])
    detok = IncrementalDetokenizer(tok, [], stop=["lo Wo"])
    updates = [detok.add(i) for i in range(3)]
    assert [u.text_delta for u in updates] == ["He", "l", ""]  # "l" might start the stop
    assert [u.stopped for u in updates] == [False, False, True]
    assert detok.text == "Hel"
    assert detok.add(3).stopped and detok.finish() == ""


def test_stop_string_in_real_tokenizer_output(tokenizer):
    text = "The answer is 42. END of story."
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.decode([t]) for t in ids]
    # a stop string that starts in one token and ends in the next
    i = next(i for i, p in enumerate(pieces) if len(p) >= 2 and i + 1 < len(pieces))
    stop = pieces[i][-1] + pieces[i + 1][:1]
    deltas, stopped = _run(IncrementalDetokenizer(tokenizer, [], stop=[stop]), ids)
    assert stopped
    assert "".join(deltas) == text[: text.index(stop)]
    deltas, stopped = _run(IncrementalDetokenizer(tokenizer, [], stop=["xyz", " END"]), ids)
    assert stopped and "".join(deltas) == "The answer is 42."


def test_held_back_prefix_released_by_finish():
    tok = ChunkTokenizer([b"abc ", b"EN"])
    detok = IncrementalDetokenizer(tok, [], stop=["END"])
    assert detok.add(0).text_delta == "abc "
    update = detok.add(1)
    assert update.text_delta == "" and not update.stopped
    assert detok.finish() == "EN"
    assert detok.text == "abc EN"


def test_partial_stop_prefix_that_breaks_off_is_emitted():
    tok = ChunkTokenizer([b"x", b"ab", b"a", b"b", b"d", b"!"])
    detok = IncrementalDetokenizer(tok, [], stop=["abc", "abd!?"])
    deltas = [detok.add(i).text_delta for i in range(6)]
    # "ab" may become "abc"; "aba" breaks "abc" but "ab"+"d!" may become "abd!?"
    assert deltas == ["x", "", "ab", "", "", ""]
    assert detok.finish() == "abd!"
    assert detok.text == "xababd!"


def test_stop_at_first_character_and_overlapping_stops():
    tok = ChunkTokenizer([b"ab", b"cd"])
    detok = IncrementalDetokenizer(tok, [], stop=["bcd", "c"])
    assert detok.add(0).text_delta == "a"
    update = detok.add(1)
    assert update.stopped and update.text_delta == "b"  # "c" completes before "bcd"
    detok = IncrementalDetokenizer(ChunkTokenizer([b"stop"]), [], stop=["stop"])
    assert detok.add(0) == DetokenizerUpdate("", True)
    assert detok.add(0) == DetokenizerUpdate("", True) and detok.finish() == ""


@given(
    text=st.text(alphabet="abcé日 ", max_size=30),
    stops=st.lists(st.text(alphabet="abcé日 ", min_size=1, max_size=4), min_size=1, max_size=6),
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=4),
)
@settings(max_examples=200, deadline=None)
def test_stop_strings_match_reference(text, stops, sizes):
    tok = ChunkTokenizer(_chunked(text.encode(), sizes))
    detok = IncrementalDetokenizer(tok, [], stop=stops)
    deltas, stopped = _run(detok, list(range(len(tok.chunks))))
    expected, expected_stopped = _reference_stop(text, stops)
    assert ("".join(deltas), stopped) == (expected, expected_stopped)
    emitted = ""
    for d in deltas:
        emitted += d
        assert not any(s in emitted for s in stops)


def test_thousands_of_stop_strings():
    stops = [f"<stop{i}>" for i in range(3000)] + ["never", "neverland"]
    text = "we will never stop <stop2999 here <stop1234> tail"
    tok = ChunkTokenizer(_chunked(text.encode(), [2, 3]))
    deltas, stopped = _run(
        IncrementalDetokenizer(tok, [], stop=stops), list(range(len(tok.chunks)))
    )
    assert stopped and "".join(deltas) == "we will "
    stops.remove("never")
    deltas, stopped = _run(
        IncrementalDetokenizer(tok, [], stop=stops), list(range(len(tok.chunks)))
    )
    assert stopped and "".join(deltas) == "we will never stop <stop2999 here "


def test_stop_matcher_holdback_is_longest_stop_prefix_suffix():
    m = StopMatcher(["abcd", "bce", "xyz"])
    state = 0
    for ch in "zzabc":
        state = m.step(state, ch)
    assert m.depth[state] == 3 and m.match_len[state] == 0  # "abc" may still become "abcd"
    state = m.step(state, "e")
    assert m.match_len[state] == 3  # "bce" found through the failure link


def _refuse(*args, **kwargs):
    raise AssertionError("the Python wrapper was called")


def test_fast_tokenizers_decode_through_their_backend(tokenizer, sentencepiece_style, monkeypatch):
    from engine.detokenizer import _decoder

    ids = [*tokenizer.encode(_CORPUS[1]), tokenizer.eos_token_id]
    for tok in (tokenizer, sentencepiece_style):
        skipped, kept = (tok.decode(ids, skip_special_tokens=s) for s in (True, False))
        with monkeypatch.context() as m:
            m.setattr(tok, "decode", _refuse)  # the fast path never reaches it
            assert _decoder(tok, skip_special_tokens=True)(ids) == skipped
            assert _decoder(tok, skip_special_tokens=False)(ids) == kept


def test_a_tokenizer_that_cleans_up_spaces_keeps_its_own_decode(tokenizer, monkeypatch):
    from engine.detokenizer import _decoder

    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", True)
    monkeypatch.setattr(tokenizer, "decode", _refuse)
    with pytest.raises(AssertionError, match="wrapper was called"):
        _decoder(tokenizer, skip_special_tokens=True)([5, 6])
