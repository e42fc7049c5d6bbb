"""``json_text`` writes exactly what ``json.dumps(obj, indent=1)`` writes (issue 38 made it faster, not different)."""

from __future__ import annotations

import enum
import json
import random

import pytest

from trainq.watcher.spec.fsutil import json_text


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
