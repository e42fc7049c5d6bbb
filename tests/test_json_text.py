"""``json_text`` writes exactly what ``json.dumps(obj, indent=1)`` writes (issue 38 made it faster, not different)."""

from __future__ import annotations

import enum
import json
import os
import random

import pytest

from trainq.watcher.spec import fsutil
from trainq.watcher.spec.fsutil import json_text, read_json, read_kernel_file


def _reference(obj: object, ensure_ascii: bool = False) -> str:
    return json.dumps(obj, indent=1, ensure_ascii=ensure_ascii) + "\n"


_LEAVES = [0, -5, 10**30, 1.25, 1e-9, -0.0, 1e300, None, True, False, "", "héllo", "a\tb\n\"\\", "\x01", "\u2028",
           "\ud800", "\U0001f600", float("nan"), float("inf"), float("-inf")]  # fmt: skip


def _random_value(rng: random.Random, depth: int) -> object:
    pick = rng.random()
    if depth > 4 or pick < 0.4:
        return rng.choice(_LEAVES)
    if pick < 0.7:
        keys = ["k", "é", "a b", "\n", "", "\U0001f600"]
        return {rng.choice(keys) + str(i): _random_value(rng, depth + 1) for i in range(rng.randint(0, 4))}
    items = [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return items if pick < 0.85 else tuple(items)


@pytest.mark.parametrize("ensure_ascii", [False, True])
def test_same_text_as_json_dumps(ensure_ascii):
    rng = random.Random(38)
    values = [{}, [], (), {"a": []}, {"a": {}}, [[]], {"env": {"PATH": "/usr/bin", "LANG": "C.UTF-8"}}]
    values += [_random_value(rng, 0) for _ in range(3000)]
    for value in values:
        assert json_text(value, ensure_ascii=ensure_ascii) == _reference(value, ensure_ascii), value


class _Level(enum.IntEnum):
    HIGH = 2


def test_what_it_does_not_encode_itself_goes_to_json_dumps():
    for value in ({1: "int key"}, {"level": _Level.HIGH}, {None: 1, 2.5: [True]}, [_Level.HIGH]):
        assert json_text(value) == _reference(value)
    with pytest.raises(TypeError, match="not JSON serializable"):
        json_text({"when": object()})
    looped: dict = {}
    looped["self"] = looped
    with pytest.raises(ValueError, match="Circular reference"):
        json_text(looped)


#: strings redact_text changes (credential shapes, a URL's password) and strings with a marker it leaves alone
_SECRETS = ["hf_" + "a1B2" * 6, "ghp_" + "Z9y8" * 9, "https://user:hunter2@example.com/x", "sk-" + "q" * 30,
            "AKIA" + "ABCDEFGHIJKLMNOP", "eyJhbGciOiJI.eyJzdWIiOiIx.c2lnbmF0dXJl", "the night is high", "see http://x",
            'quoted "hf_' + "x" * 24 + '"', "line\nhf_" + "Y" * 22 + "\tend"]  # fmt: skip


def test_redacted_text_is_the_text_of_the_redacted_values():
    """run.json's text skips the walk when no marker appears in it: the same text either way, secrets redacted."""
    from trainq.watcher.spec.fsutil import redacted_json_text
    from trainq.watcher.spec.text import REDACTED, redact_strings

    rng = random.Random(3838)
    for n in range(3000):
        value = _random_value(rng, 0)
        if n % 2:
            value = {"run": value, "evidence": rng.choice(_SECRETS), "nested": [{"e": rng.choice(_SECRETS)}]}
        assert redacted_json_text(value) == json_text(redact_strings(value)), value
    text = redacted_json_text({"error": "token hf_" + "a1B2" * 6 + " refused", "url": "https://u:pw@h/"})
    assert "a1B2" not in text and "pw@" not in text and text.count(REDACTED) == 2


def test_redacted_values_read_the_same_as_the_walked_ones():
    """The snapshot's config.json: ``redacted`` skips the walk when the value's repr holds no marker."""
    from trainq.watcher.spec.text import redact_strings, redacted

    rng = random.Random(83)
    for n in range(3000):
        value = _random_value(rng, 0)
        if n % 2:
            value = {"command": [rng.choice(_SECRETS), "--x"], "cwd": value, "sweep": (rng.choice(_SECRETS),)}
        assert json_text(redacted(value)) == json_text(redact_strings(value)), value


def test_every_credential_shape_holds_a_marker_and_plain_paths_and_urls_do_not():
    """The cheap test before the credential regexes must never miss a shape they catch; a folder named
    "throughput" or a GitHub URL without a password sent every run.json through the slow walk when "gh" and "://"
    were markers."""
    from trainq.watcher.spec.text import may_hold_secret, redact_text

    shapes = ["hf_" + "a" * 20, "ghp_" + "b" * 30, "gho_" + "b" * 30, "ghu_" + "b" * 30, "ghs_" + "b" * 30,
              "ghr_" + "b" * 30, "github_pat_" + "c" * 40, "sk-" + "d" * 24, "sk-proj-" + "d" * 24,
              "sk-ant-api03-" + "d" * 24, "sk_live_" + "e" * 16, "rk_test_" + "e" * 16, "AKIA" + "F" * 16,
              "ASIA" + "F" * 16, "xoxb-" + "1" * 10, "glpat-" + "g" * 20, "AIza" + "h" * 35, "npm_" + "i" * 36,
              "pypi-" + "j" * 50, "eyJ" + "k" * 8 + ".eyJ" + "l" * 8 + "." + "m" * 8, "https://me:pw@host/x",
              "git+ssh://git:tok3n@example.org"]  # fmt: skip
    for shape in shapes:
        text = f"a {shape} b"
        assert redact_text(text) != text, shape  # the regexes catch it...
        assert may_hold_secret(text), shape  # ...and the cheap test lets them look
    for plain in ["/dev/shm/bench/throughput/q/done/t-0001", "https://github.com/trainq/trainq", "high night",
                  "http://localhost:8080/status", "user@host:/path"]:  # fmt: skip
        assert not may_hold_secret(plain), plain


def test_read_json_reads_what_the_file_holds_and_nothing_a_job_could_swap_in(tmp_path, monkeypatch):
    """read_json reads the size fstat gives (issue 38: a read of the whole 16 MiB bound allocated it every time):
    a record of any size up to the bound reads whole; a FIFO (even one with a writer), a symlink, a folder, junk
    and a file past the bound read as None, at once."""
    record = {"attempt": 3, "text": "x" * 200_000, "nested": {"a": [1, 2.5, None]}}
    (tmp_path / "big.json").write_text(json.dumps(record))
    assert read_json(tmp_path / "big.json") == record
    (tmp_path / "small.json").write_text('{"a": 1}')
    assert read_json(str(tmp_path / "small.json")) == {"a": 1}
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    writer = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)  # a writer holding data: still not read, never waited on
    os.write(writer, b'{"a": 1}')
    try:
        assert read_json(fifo) is None
    finally:
        os.close(writer)
    (tmp_path / "link.json").symlink_to(tmp_path / "small.json")
    assert read_json(tmp_path / "link.json") is None
    (tmp_path / "folder.json").mkdir()
    assert read_json(tmp_path / "folder.json") is None
    (tmp_path / "junk.json").write_bytes(b"\xff\xfe\x00junk")
    assert read_json(tmp_path / "junk.json") is None
    assert read_json(tmp_path / "missing.json") is None
    monkeypatch.setattr(fsutil, "MAX_JSON_BYTES", 1000)  # past the bound: cut there, so not a JSON object
    assert read_json(tmp_path / "big.json") is None
    assert read_json(tmp_path / "small.json") == {"a": 1}


def test_read_kernel_file_reads_a_proc_file_whole_though_it_says_size_0(tmp_path):
    """/proc and /sys files report size 0: ``read_kernel_file`` reads until a read is empty, up to its limit."""
    assert os.stat("/proc/self/cmdline").st_size == 0
    text = read_kernel_file("/proc/self/cmdline")
    with open("/proc/self/cmdline", "rb") as f:
        assert text == f.read() and text.endswith(b"\0")
    big = tmp_path / "big"
    big.write_bytes(b"y" * 200_000)
    assert read_kernel_file(big) == b"y" * 200_000
    assert read_kernel_file(big, limit=70_000) == b"y" * 70_000
