"""faces/stream.py: the lines and records `trainq serve` sends, at exact byte offsets (no server here)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from trainq.watcher.daemon.starting import _banner
from trainq.watcher.faces.stream import (
    ATTEMPT,
    LINE,
    MAX_LINE_BYTES,
    PROGRESS,
    clean,
    find_job,
    read_from,
    resume_offset,
    split_log,
    split_records,
    sse,
    tail_offset,
)


def _texts(data: bytes, final: bool = False) -> list[tuple[str, str]]:
    return [(p.kind, p.text) for p in split_log(data, 0, final)[0]]


def test_a_partial_line_is_held_until_it_ends() -> None:
    pieces, used = split_log(b"one\ntw", 100)
    assert [(p.end, p.text) for p in pieces] == [(104, "one")] and used == 4
    pieces, used = split_log(b"two\n", 104)
    assert [(p.end, p.text) for p in pieces] == [(108, "two")] and used == 4
    # the job ended: its last words count even without a newline
    assert [(p.end, p.text) for p in split_log(b"bye", 108, final=True)[0]] == [(111, "bye")]


def test_ansi_escapes_and_control_bytes_are_stripped() -> None:
    raw = (
        b"\x1b[1;31mred\x1b[0m \x1b]0;title\x07tab\there\x1b]8;;http://x\x1b\\link\x1b]8;;\x1b\\ \x07bell\x00 \xc3\xbc"
    )
    assert clean(raw) == "red tab\therelink bell ü"
    assert clean(b"bad \xff byte") == "bad \ufffd byte"


def test_crlf_is_one_end_and_a_lone_cr_is_a_progress_redraw() -> None:
    assert _texts(b"a\r\nb\n10%\r50%\rdone\r\n") == [
        (LINE, "a"),
        (LINE, "b"),
        (PROGRESS, "10%"),
        (PROGRESS, "50%"),
        (LINE, "done"),
    ]
    # a CR at the very end may be the first half of CRLF: held until the next byte says which
    pieces, used = split_log(b"x\r", 0)
    assert pieces == [] and used == 0
    assert _texts(b"x\r", final=True) == [(PROGRESS, "x")]


def test_the_supervisors_attempt_banner_is_its_own_event_type() -> None:
    banner = _banner("job-1", 2, 1_700_000_000.0, "/q/running/job-1/checkpoints/step-4")
    assert _texts(f"before\n{banner}\nafter\n".encode()) == [(LINE, "before"), (ATTEMPT, banner), (LINE, "after")]


def test_a_line_longer_than_the_bound_goes_out_in_cuts_that_keep_characters_whole() -> None:
    data = ("é" * MAX_LINE_BYTES).encode() + b"x"  # 2 bytes a character, 2 bounds and a byte, no end yet
    pieces, used = split_log(data, 0)
    assert used == 2 * MAX_LINE_BYTES and [p.end for p in pieces] == [MAX_LINE_BYTES, 2 * MAX_LINE_BYTES]
    assert all(p.text == "é" * (MAX_LINE_BYTES // 2) for p in pieces)
    odd = b"a" + data  # now every bound falls inside a character: the cut moves back one byte
    pieces, used = split_log(odd, 0)
    assert [len(p.text.encode()) for p in pieces] == [MAX_LINE_BYTES - 1, MAX_LINE_BYTES] and used == len(odd) - 3
    assert "\ufffd" not in "".join(p.text for p in pieces)


_LOG_BYTES = st.lists(st.sampled_from([b"a", b"\xc3\xbc", b"\n", b"\r", b"\r\n", b"\x1b[31m", b" "]), max_size=60)


@settings(max_examples=200, deadline=None)
@given(chunks=_LOG_BYTES, cuts=st.lists(st.integers(0, 200), max_size=8))
def test_any_write_boundaries_give_the_same_pieces_and_every_id_resumes_exactly(chunks, cuts) -> None:
    """What a reader following the file as it grows sends equals reading it whole; each id resumes the rest."""
    data = b"".join(chunks)
    whole = split_log(data, 0, final=True)[0]
    sent, offset = [], 0
    for size in [*sorted({min(c, len(data)) for c in cuts}), len(data)]:
        pieces, used = split_log(data[offset:size], offset, final=size == len(data))
        sent += pieces
        offset += used
    assert sent == whole and offset == len(data)
    for i, piece in enumerate(whole):
        assert split_log(data[piece.end :], piece.end, final=True)[0] == whole[i + 1 :]


def test_metrics_records_skip_bad_lines_and_carry_non_finite_numbers_as_strings() -> None:
    data = b'{"step": 1, "loss": NaN}\nnot json\n[1, 2]\n{"step": 2, "loss": Infinity, "x": [-Infinity]}\n{"step": 3'
    records, used = split_records(data, 10)
    assert [(end, json.loads(r)) for end, r in records] == [
        (10 + 25, {"step": 1, "loss": "NaN"}),
        (10 + data.index(b'{"step": 3'), {"step": 2, "loss": "Infinity", "x": ["-Infinity"]}),
    ]
    assert used == data.index(b'{"step": 3')  # the unfinished record is held
    assert [json.loads(r) for _, r in split_records(b'{"step": 3}', 0, final=True)[0]] == [{"step": 3}]


def test_tail_offset_and_resume_offset(tmp_path: Path) -> None:
    log = tmp_path / "output.log"
    log.write_bytes(b"1\n22\n333\n4444\npartial")
    assert tail_offset(log, 2) == len(b"1\n22\n") and tail_offset(log, 10) == 0 and tail_offset(log, 0) == 14
    size = log.stat().st_size
    assert resume_offset("5", "end", log) == 5  # Last-Event-ID (a reconnect) wins over the URL
    assert resume_offset(None, "end", log) == size and resume_offset(None, "2", log) == 2
    assert resume_offset(str(size + 1), None, log) == 0  # past the end: a different file, start over
    assert resume_offset("x1", None, log) == 0 and resume_offset(None, None, log, tail="1") == len(b"1\n22\n333\n")
    assert resume_offset(None, None, tmp_path / "missing.log") == 0


def test_ids_are_looked_up_in_the_state_folders_only(queue_dir: Path, tmp_path: Path) -> None:
    (queue_dir / "running" / "a").mkdir()
    (tmp_path / "secret").mkdir()
    os.symlink(tmp_path / "secret", queue_dir / "done" / "linked")
    place = find_job(queue_dir, "a")
    assert place and place.state == "running" and not place.ended
    for bad in ("..", ".", "../secret", "a/../../secret", "", "x" * 65, "linked", "inbox", "a\x00", "nope"):
        assert find_job(queue_dir, bad) is None, bad


def test_a_symlinked_log_is_not_followed(tmp_path: Path) -> None:
    (tmp_path / "secret").write_text("password\n")
    os.symlink(tmp_path / "secret", tmp_path / "output.log")
    assert read_from(tmp_path / "output.log", 0) == b""


def test_sse_format() -> None:
    assert sse("x", LINE, 5) == "id: 5\ndata: x\n\n"
    assert sse("y", ATTEMPT, 9) == "event: attempt\nid: 9\ndata: y\n\n"
    assert sse("{}", "watcher") == "event: watcher\ndata: {}\n\n"
