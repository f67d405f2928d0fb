"""Stop conditions applied token by token, including several tokens committed at once by a spec round."""

from __future__ import annotations

import random

import pytest

from dflash.generation.output import OutputSink
from dflash.models.gguf_file import GGUFFile
from dflash.tokenizer import Tokenizer
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


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_streamed_text_matches_decoding_everything(seed: int) -> None:
    """Real SmolLM2 tokenizer, token streams mixing word pieces, spaces, code, multi-byte characters split across
    tokens (CJK, emoji, accents: byte tokens), special tokens and random ids. The sink decodes incrementally; what it
    releases is always a prefix of the whole decode, a length finish ends on the whole decode, and a stop string
    ends the text where the whole decode first contains it."""
    tokenizer = Tokenizer.from_gguf_metadata(GGUFFile(smollm2_path()).metadata, source="smollm2")
    text = "def f(x):\n    return x**2  # 平方 ✓ café 😀 naïve\n" * 3 + "Ünïcödé 漢字テスト 🚀🚀 end"
    base = tokenizer.encode(text)
    generator = random.Random(seed)
    stream: list[int] = []
    while len(stream) < 400:
        choice = generator.random()
        if choice < 0.7:
            start = generator.randrange(len(base))
            stream.extend(base[start : start + generator.randint(1, 12)])
        elif choice < 0.85:
            stream.append(generator.randrange(tokenizer.vocab_size))
        else:
            stream.extend(tokenizer.encode(generator.choice(["😀", " 漢", "é", "\n\n", "  ", "<|im_end|>"])))
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
