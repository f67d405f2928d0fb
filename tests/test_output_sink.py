"""Stop conditions applied token by token, including several tokens committed at once by a spec round."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import pytest

from dflash.generation.output import REPLACEMENT, OutputSink
from dflash.models.gguf_file import GGUFFile
from dflash.tokenizer import StreamDecoder, Tokenizer
from tests.loading_helpers import smollm2_path

VOCAB = {1: "a", 2: "b", 3: "c", 4: " STOP", 5: "é"}


def decode(ids: list[int]) -> str:
    return "".join(VOCAB.get(i, "?") for i in ids)


def collect() -> tuple[list[str], OutputSink]:
    pieces: list[str] = []
    return pieces, OutputSink(decode, eos_ids=[0], max_new_tokens=6, stop=[" STOP"],
                              on_text=lambda text, ids: pieces.append(text))


def test_eos_inside_a_block_ends_there() -> None:
    pieces, sink = collect()
    assert sink.push_many([1, 2, 0, 3, 3]) is True
    assert sink.token_ids == [1, 2, 0] and sink.text == "ab"
    assert sink.finish_reason == "stop" and sink.stop_reason == "eos"
    assert "".join(pieces) == "ab"


def test_max_tokens_inside_a_block() -> None:
    _, sink = collect()
    assert sink.push_many([1, 1, 1, 1]) is False
    assert sink.push_many([2, 2, 2, 2]) is True
    assert sink.token_ids == [1, 1, 1, 1, 2, 2] and sink.finish_reason == "length"


def test_stop_string_inside_a_block_is_cut_and_never_streamed() -> None:
    pieces, sink = collect()
    assert sink.push_many([1, 2, 4, 3]) is True
    assert sink.text == "ab" and sink.stop_reason == " STOP" and sink.finish_reason == "stop"
    assert "STOP" not in "".join(pieces)


def test_prefix_of_a_stop_string_is_held_back_then_released() -> None:
    pieces: list[str] = []
    sink = OutputSink(decode, eos_ids=[0], max_new_tokens=10, stop=["ab!"], on_text=lambda t, i: pieces.append(t))
    sink.push(1)
    sink.push(2)
    assert "".join(pieces) == ""  # "ab" could still become "ab!"
    sink.push(3)
    assert "".join(pieces) == "abc"


def test_pushes_after_finish_are_ignored() -> None:
    _, sink = collect()
    sink.push(0)
    assert sink.push(1) is True and sink.token_ids == [0]


def _mixed_stream(tokenizer: Tokenizer, base: list[int], generator: random.Random, length: int,
                  pieces: list[str]) -> list[int]:
    """At least `length` ids: slices of `base` (word pieces, spaces, multi-byte characters split over byte tokens),
    random ids, and the ids of `pieces`."""
    stream: list[int] = []
    while len(stream) < length:
        choice = generator.random()
        if choice < 0.7:
            start = generator.randrange(len(base))
            stream.extend(base[start : start + generator.randint(1, 12)])
        elif choice < 0.85:
            stream.append(generator.randrange(tokenizer.vocab_size))
        else:
            stream.extend(tokenizer.encode(generator.choice(pieces)))
    return stream


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_streamed_text_matches_decoding_everything(seed: int) -> None:
    """Real SmolLM2 tokenizer, token streams mixing word pieces, spaces, code, multi-byte characters split across
    tokens (CJK, emoji, accents: byte tokens), special tokens and random ids. The sink decodes incrementally; what it
    releases is always a prefix of the whole decode, a length finish ends on the whole decode, and a stop string
    ends the text where the whole decode first contains it."""
    tokenizer = Tokenizer.from_gguf_metadata(GGUFFile(smollm2_path()).metadata, source="smollm2")
    text = "def f(x):\n    return x**2  # 平方 ✓ café 😀 naïve\n" * 3 + "Ünïcödé 漢字テスト 🚀🚀 end"
    stream = _mixed_stream(tokenizer, tokenizer.encode(text), random.Random(seed), 400,
                           ["😀", " 漢", "é", "\n\n", "  ", "<|im_end|>"])
    whole = [tokenizer.decode(stream[: i + 1]) for i in range(len(stream))]  # the reference: decode everything

    pieces: list[str] = []
    sink = OutputSink(tokenizer.decode, eos_ids=(), max_new_tokens=len(stream), on_text=lambda t, i: pieces.append(t))
    for i, token in enumerate(stream):
        sink.push(token)
        assert whole[i].startswith(sink.text)
    assert sink.finish_reason == "length" and sink.text == whole[-1] == "".join(pieces)

    stop = "平方 ✓"
    first = next(i for i, decoded in enumerate(whole) if stop in decoded)
    sink = OutputSink(tokenizer.decode, eos_ids=(), max_new_tokens=len(stream), stop=[stop])
    assert sink.push_many(stream)
    assert sink.stop_reason == stop and len(sink.token_ids) == first + 1
    assert sink.text == whole[first][: whole[first].find(stop)]


def test_single_id_decodes_are_remembered_and_equal_the_backend_s() -> None:
    """Streaming decodes each committed token alone once: the tokenizer keeps those texts. Every id (special
    tokens kept, as `decode` keeps them) gives the backend's text, the first time and from memory."""
    tokenizer = Tokenizer.from_gguf_metadata(GGUFFile(smollm2_path()).metadata, source="smollm2")
    ids = [*range(0, 49152, 97), 0, 1, 2, *tokenizer.eos_token_ids]
    for token in ids:
        expected = tokenizer.backend.decode([token], skip_special_tokens=False)
        assert tokenizer.decode([token]) == expected == tokenizer.decode([token])
    assert tokenizer.decode([2], skip_special_tokens=True) == tokenizer.backend.decode([2], skip_special_tokens=True)
    assert tokenizer.decode([2]) != tokenizer.decode([2], skip_special_tokens=True)  # <|im_end|> is special


class WholeTextSink:
    """The sink as first written, kept as the reference: every push re-examines the whole text streamed so far
    (stop strings searched from len(stop) characters before the released text's end, the hold-back computed over
    the whole text). `OutputSink` looks at the new text and a short tail only; it must behave exactly the same."""

    def __init__(self, decode: Callable[[list[int]], str], *, eos_ids: Sequence[int], max_new_tokens: int,
                 stop: Sequence[str] = (), on_text: Callable[[str, list[int]], None] | None = None) -> None:
        self.decode, self.eos_ids, self.max_new_tokens = decode, frozenset(eos_ids), max_new_tokens
        self.stop = tuple(s for s in stop if s)
        self.on_text = on_text
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: str | None = None
        self._unreleased_ids: list[int] = []
        self._text_ids: list[int] = []
        self._stream = StreamDecoder(decode)
        self._streamed = ""

    def push(self, token: int) -> bool:
        if self.finish_reason is not None:
            return True
        self.token_ids.append(token)
        self._unreleased_ids.append(token)
        if token in self.eos_ids:
            self._finish("stop", "eos", self.decode(self._text_ids))
            return True
        self._text_ids.append(token)
        self._streamed += self._stream.push(token)
        full = self._streamed
        for stop in self.stop:
            index = full.find(stop, max(0, len(self.text) - len(stop)))
            if index >= 0:
                self._finish("stop", stop, full[:index])
                return True
        if len(self.token_ids) >= self.max_new_tokens:
            self._finish("length", None, full + self._stream.flush())
            return True
        safe = full.rstrip(REPLACEMENT)
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(safe)), 0, -1):
                if safe.endswith(stop[:k]):
                    safe = safe[: len(safe) - k]
                    break
        if len(safe) > len(self.text) and safe.startswith(self.text):
            delta, self.text = safe[len(self.text) :], safe
            ids, self._unreleased_ids = self._unreleased_ids, []
            if self.on_text is not None:
                self.on_text(delta, ids)
        return False

    def finish_cancelled(self) -> None:
        if self.finish_reason is None:
            self._finish("cancelled", None, self.decode(self._text_ids))

    def _finish(self, reason: str, stop_reason: str | None, final_text: str) -> None:
        self.finish_reason, self.stop_reason = reason, stop_reason
        final_text = final_text.rstrip(REPLACEMENT) if reason != "length" else final_text
        delta = ""
        if final_text.startswith(self.text):
            delta, self.text = final_text[len(self.text) :], final_text
        ids, self._unreleased_ids = self._unreleased_ids, []
        if self.on_text is not None and (delta or ids):
            self.on_text(delta, ids)


# letters that make periodic and overlapping stop strings, a multi-byte character, a newline, a replacement
# character (as a decoder writes for invalid bytes) and EOS (0)
TRICKY = {1: "a", 2: "b", 3: "!", 4: "é", 5: "\n", 6: "\ufffd", 7: "ab", 8: "ba", 9: "a!"}


def tricky_decode(ids: list[int]) -> str:
    return "".join(TRICKY.get(i, "") for i in ids)


def run_both(decode: Callable[[list[int]], str], stream: list[int], *, stop: Sequence[str], eos: Sequence[int],
             max_new: int, cancel_at: int | None) -> None:
    """Push `stream` into both sinks one token at a time (cancelling after `cancel_at` tokens): every callback,
    return value and the final state must agree."""
    calls: tuple[list[tuple[str, list[int]]], list[tuple[str, list[int]]]] = ([], [])
    sinks = (
        OutputSink(decode, eos_ids=eos, max_new_tokens=max_new, stop=stop,
                   on_text=lambda text, ids: calls[0].append((text, list(ids)))),
        WholeTextSink(decode, eos_ids=eos, max_new_tokens=max_new, stop=stop,
                      on_text=lambda text, ids: calls[1].append((text, list(ids)))),
    )
    for index, token in enumerate(stream):
        if cancel_at is not None and index == cancel_at:
            for sink in sinks:
                sink.finish_cancelled()
            break
        finished = [sink.push(token) for sink in sinks]
        assert finished[0] == finished[1]
        assert calls[0] == calls[1] and sinks[0].text == sinks[1].text, (stop, stream[: index + 1])
    new, reference = sinks
    assert calls[0] == calls[1]
    assert (new.text, new.token_ids, new.finish_reason, new.stop_reason) == (
        reference.text, reference.token_ids, reference.finish_reason, reference.stop_reason)


@pytest.mark.parametrize("seed", range(6))
def test_the_sink_releases_exactly_what_rereading_the_whole_text_would(seed: int) -> None:
    """Periodic and overlapping stop strings ("aba", "abab", "aa", "a!" beside "!"), held-back prefixes that end in
    an earlier prefix, replacement characters, EOS, length and cancellation: the same callbacks, in the same
    pieces with the same ids, and the same final text and reasons as the whole-text reference."""
    generator = random.Random(seed)
    stop_pool = ["aba", "abab", "aa", "a!", "!", "ba\n", "éé", "b\ufffd", "\ufffda", "ab!ab", "\n\n"]
    for _ in range(150):
        stop = generator.sample(stop_pool, generator.randint(0, 3))
        stream = [generator.choice([1, 1, 2, 2, 3, 4, 5, 6, 7, 8, 9]) for _ in range(generator.randint(1, 60))]
        if generator.random() < 0.2:
            stream.insert(generator.randrange(len(stream)), 0)  # EOS
        cancel_at = generator.randrange(len(stream)) if generator.random() < 0.2 else None
        run_both(tricky_decode, stream, stop=stop, eos=[0], max_new=generator.randint(1, 70), cancel_at=cancel_at)


@pytest.mark.parametrize("seed", [0, 1])
def test_the_sink_matches_the_reference_on_real_tokens(seed: int) -> None:
    """SmolLM2's tokenizer: multi-byte characters split over byte tokens, special tokens, random ids, and stop
    strings made of the text's own pieces (so they are found, and their prefixes held back, mid-token)."""
    tokenizer = Tokenizer.from_gguf_metadata(GGUFFile(smollm2_path()).metadata, source="smollm2")
    text = "def f(x):\n    return x**2  # 平方 ✓ café 😀 naïve\n" * 3 + "Ünïcödé 漢字テスト 🚀🚀 end"
    base = tokenizer.encode(text)
    generator = random.Random(seed)
    for _ in range(20):
        stream: list[int] = []
        while len(stream) < 200:
            if generator.random() < 0.8:
                start = generator.randrange(len(base))
                stream.extend(base[start : start + generator.randint(1, 12)])
            else:
                stream.append(generator.randrange(tokenizer.vocab_size))
        start = generator.randrange(len(text) - 8)
        stop = [text[start : start + generator.randint(1, 6)], generator.choice(["😀", "\n", "x**", "é n"])]
        run_both(tokenizer.decode, stream, stop=stop, eos=tokenizer.eos_token_ids, max_new=len(stream), cancel_at=None)


def _round_sizes(generator: random.Random, total: int) -> list[int]:
    """Round sizes (1-16 tokens, as linear and DDTree rounds commit) covering `total` tokens."""
    sizes: list[int] = []
    while sum(sizes) < total:
        sizes.append(generator.randint(1, 16))
    return sizes


@pytest.mark.parametrize("seed", range(4))
def test_rounds_pushed_at_once_give_what_one_token_at_a_time_gives(seed: int) -> None:
    """`push_many` takes a round's tokens at once where no stop string is asked for (one decode of the window, one
    release): SmolLM2's tokenizer with multi-byte characters split over byte tokens, random ids, EOS inside a round
    and the token limit inside a round give the same tokens, final text, reasons and streamed text as pushing every
    token alone; with a stop string both go one at a time, and agree too."""
    tokenizer = Tokenizer.from_gguf_metadata(GGUFFile(smollm2_path()).metadata, source="smollm2")
    text = "def f(x):\n    return x**2  # 平方 ✓ café 😀 naïve\n" * 3 + "Ünïcödé 漢字テスト 🚀🚀 end"
    base = tokenizer.encode(text)
    eos = tokenizer.eos_token_ids
    generator = random.Random(seed)
    for case in range(30):
        stream = _mixed_stream(tokenizer, base, generator, 120, ["😀", " 漢", "é", "🚀🚀"])
        if case % 3 == 0:
            stream.insert(generator.randrange(len(stream)), eos[0])
        stop = ["x**"] if case % 5 == 4 else []
        max_new = generator.randint(1, len(stream) + 5)
        pieces: tuple[list[str], list[str]] = ([], [])
        alone = OutputSink(tokenizer.decode, eos_ids=eos, max_new_tokens=max_new, stop=stop,
                           on_text=lambda t, i, into=pieces[0]: into.append(t))
        rounds = OutputSink(tokenizer.decode, eos_ids=eos, max_new_tokens=max_new, stop=stop,
                            on_text=lambda t, i, into=pieces[1]: into.append(t))
        at = 0
        for size in _round_sizes(generator, len(stream)):
            chunk = stream[at : at + size]
            at += size
            assert any([alone.push(t) for t in chunk]) == rounds.push_many(chunk)
            assert "".join(pieces[0]).startswith("".join(pieces[1])) or "".join(pieces[1]).startswith(
                "".join(pieces[0]))
        for sink in (alone, rounds):
            sink.finish_cancelled()
        assert (rounds.token_ids, rounds.text, rounds.finish_reason, rounds.stop_reason) == (
            alone.token_ids, alone.text, alone.finish_reason, alone.stop_reason)
        assert "".join(pieces[1]) == "".join(pieces[0]) == rounds.text


def test_a_round_ending_in_an_incomplete_character_is_held_back() -> None:
    """A round whose last token leaves a character incomplete releases nothing of that character (one push each,
    as the window would end in U+FFFD); the next round completes it."""
    tokenizer = Tokenizer.from_gguf_metadata(GGUFFile(smollm2_path()).metadata, source="smollm2")
    ids = tokenizer.encode("ok 😀 done")
    whole = [tokenizer.decode(ids[: i + 1]) for i in range(len(ids))]
    cut = next(i for i, decoded in enumerate(whole) if decoded.endswith(REPLACEMENT))  # inside the emoji
    pieces: list[str] = []
    sink = OutputSink(tokenizer.decode, eos_ids=(), max_new_tokens=100, on_text=lambda t, i: pieces.append(t))
    assert sink.push_many(ids[: cut + 1]) is False
    assert REPLACEMENT not in "".join(pieces) and "😀" not in "".join(pieces)
    assert sink.push_many(ids[cut + 1 :]) is False
    sink.finish_cancelled()
    assert "".join(pieces) == sink.text == "ok 😀 done"
