"""Stop conditions applied token by token, including several tokens committed at once by a spec round."""

from __future__ import annotations

from dflash.generation.output import OutputSink

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
