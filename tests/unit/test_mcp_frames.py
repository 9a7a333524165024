"""A stdio MCP server's stdout cut into frames held to a bound, the answer made up for a frame
over it, and the bounded tail of its stderr."""

from __future__ import annotations

import json

from dsh_mesh.mcp._frames import CUT_META, TAIL_BYTES, Frame, FrameReader, answer_for_oversized
from dsh_mesh.mcp._stdio import StderrTail


def test_frames_are_cut_at_newlines_across_chunks() -> None:
    reader = FrameReader(limit=100)
    assert reader.feed(b'{"a":') == []
    frames = reader.feed(b'1}\n\n{"b":2}\n{"c"')
    assert [(f.data, f.whole) for f in frames] == [(b'{"a":1}', True), (b'{"b":2}', True)]
    [last] = reader.feed(b":3}\n")
    assert last.data == b'{"c":3}'


def test_a_frame_over_the_bound_keeps_only_its_head_and_tail() -> None:
    reader = FrameReader(limit=1000)
    head = b'{"jsonrpc":"2.0","id":7,"result":{"content":[{"type":"text","text":"'
    frames: list[Frame] = []
    frames += reader.feed(head)
    for _ in range(200):  # 2 MB in 10 KB chunks: at most the bound is ever held
        frames += reader.feed(b"y" * 10_000)
        assert len(reader._head) <= 1000 and len(reader._tail) <= TAIL_BYTES
    [frame] = reader.feed(b'"}],"isError":false}}\n{"id":8}\n')[:1]
    assert not frame.whole and frame.size == len(head) + 2_000_000 + 21
    assert frame.data.startswith(head) and len(frame.data) == 1000
    assert frame.tail.endswith(b'"isError":false}}')


def oversized(body: bytes, limit: int = 200) -> Frame:
    [frame] = FrameReader(limit).feed(body + b"\n")
    assert not frame.whole
    return frame


def test_an_oversized_answer_to_a_call_is_cut_to_its_start_with_a_note() -> None:
    text = "é" * 5000
    body = json.dumps(
        {"jsonrpc": "2.0", "id": 3, "result": {"content": [{"type": "text", "text": text}]}}
    ).encode()
    answer = answer_for_oversized(oversized(body, 2000), {3: "tools/call"}, 300)
    assert answer is not None and answer["id"] == 3
    result = answer["result"]
    [part] = result["content"]
    assert len(part["text"]) <= 300 and part["text"].startswith("é" * 50)
    assert "output cut" in part["text"] and f"{len(body):,} bytes" in part["text"]
    assert result["_meta"][CUT_META] == {"isError": False, "bytes": len(body)}


def test_the_id_may_come_last_and_an_error_flag_is_kept() -> None:
    body = (
        b'{"result":{"content":[{"type":"text","text":"' + b"z" * 5000 + b'"}],"isError":true},'
        b'"jsonrpc":"2.0","id":"k-1"}'
    )
    answer = answer_for_oversized(oversized(body), {"k-1": "tools/call"}, 100)
    assert answer is not None and answer["result"]["_meta"][CUT_META]["isError"] is True


def test_an_oversized_answer_to_another_request_is_an_error_and_an_unknown_one_none() -> None:
    body = b'{"jsonrpc":"2.0","id":4,"result":{"tools":[' + b" " * 5000 + b"]}}"
    answer = answer_for_oversized(oversized(body), {4: "tools/list"}, 100)
    assert answer is not None and "tools/list" in answer["error"]["message"]
    assert answer_for_oversized(oversized(body), {5: "tools/call"}, 100) is None
    notification = b'{"jsonrpc":"2.0","method":"notifications/message","params":{"data":"'
    assert answer_for_oversized(oversized(notification + b"n" * 5000 + b'"}}'), {}, 100) is None


def test_stderr_keeps_its_last_bytes_from_a_whole_line() -> None:
    tail = StderrTail(size=1000)
    for n in range(1000):
        tail.add(f"line {n}\n".encode())
    kept = tail.text()
    assert len(kept.encode()) <= 1000 and kept.startswith("line ") and kept.endswith("line 999\n")
    assert tail.last_lines(2) == "line 998 | line 999"
