from __future__ import annotations

from ds4d.engine.output import IncrementalDetokenizer, StopMatcher


class ByteTokenizer:
    """Each id is one UTF-8 byte, so multi-byte characters span several ids."""

    eos_token_ids = frozenset()

    def decode(self, ids, *, skip_special_tokens=False):
        return bytes(ids).decode("utf-8", errors="replace")


def test_detokenizer_holds_incomplete_characters():
    detok = IncrementalDetokenizer(ByteTokenizer())
    data = "héllo ✓!".encode()
    pieces = [detok.add([b]) for b in data]
    assert "".join(pieces) + detok.flush() == "héllo ✓!"
    assert all("\ufffd" not in p for p in pieces)


def test_stop_matcher_holds_partial_and_cuts():
    m = StopMatcher(["STOP", "\n\n"])
    out = []
    for piece in ["ab", "cS", "TO", "xyz S", "TOP tail"]:
        text, stopped = m.feed(piece)
        out.append(text)
        if stopped:
            break
    assert "".join(out) == "abcSTOxyz "
    assert m.stopped


def test_stop_matcher_flushes_undecided_tail():
    m = StopMatcher(["STOP"])
    text, stopped = m.feed("abcST")
    assert (text, stopped) == ("abc", False)
    assert m.flush() == "ST"
