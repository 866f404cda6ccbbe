"""router.sse: the one line splitter both stream relays use (decode's stream and a migrated continuation)."""

from router.sse import DONE, LineCollector, data_of

STREAM = (b'data: {"choices":[{"delta":{"content":"a\\nb"}}]}\n\n'
          b": keepalive\r\n\r\n"
          b'data:{"choices":[]}\r\n\r\n'
          b"data: [DONE]\n\n")
LINES = [b'data: {"choices":[{"delta":{"content":"a\\nb"}}]}\n', b"\n", b": keepalive\r\n", b"\r\n",
         b'data:{"choices":[]}\r\n', b"\r\n", b"data: [DONE]\n", b"\n"]


def collect(chunks: list[bytes]) -> tuple[list[bytes], bytes]:
    c = LineCollector()
    lines = [line for chunk in chunks for line in c.feed(chunk)]
    return lines, c.flush()


def test_one_chunk_gives_every_line_with_its_ending():
    assert collect([STREAM]) == (LINES, b"")


def test_lines_are_the_same_wherever_the_network_cuts_the_stream():
    for cut in range(1, len(STREAM)):
        assert collect([STREAM[:cut], STREAM[cut:]]) == (LINES, b""), cut
    assert collect([STREAM[i:i + 1] for i in range(len(STREAM))]) == (LINES, b"")


def test_an_unfinished_line_waits_for_its_end():
    c = LineCollector()
    assert c.feed(b'data: {"cho') == []
    assert c.feed(b'ices":[]}') == []
    assert c.feed(b"\ndata: x") == [b'data: {"choices":[]}\n']
    assert c.flush() == b"data: x"
    assert c.flush() == b""  # flushed once


def test_a_crlf_split_between_chunks_is_one_line_ending():
    assert collect([b"data: 1\r", b"\ndata: 2\r\n"]) == ([b"data: 1\r\n", b"data: 2\r\n"], b"")


def test_data_of_reads_data_lines_only():
    assert data_of(b'data: {"a":1}\n') == b'{"a":1}'
    assert data_of(b'data:{"a":1}\r\n') == b'{"a":1}'
    assert data_of(b"data: [DONE]\n") == DONE
    assert data_of(b": keepalive\n") is None
    assert data_of(b"\n") is None
    assert data_of(b"event: message\n") is None
