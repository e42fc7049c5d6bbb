"""Text that people read (watcher.log, the terminal view): never a forged line, never a terminal escape;
and text the records keep (snapshot/, run.json, events.jsonl): never a secret (``redact_*`` below)."""

from __future__ import annotations

import logging
import math
import re
from collections import Counter
from collections.abc import Mapping
from typing import overload

#: C0 controls, DEL and C1 controls (ESC starts terminal escapes; CR and LF start forged log lines)
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def printable(text: str) -> str:
    """``text`` with control characters escaped (``\\n``, ``\\x1b``) and lone surrogates shown as U+FFFD."""
    if not text.isascii():
        text = text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    if not _CONTROL.search(text):
        return text
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


@overload
def printable_tree(value: dict) -> dict: ...
@overload
def printable_tree(value: object) -> object: ...
def printable_tree(value: object) -> object:
    """Every string in a JSON-like tree (keys too) made ``printable``."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {printable_tree(k): printable_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [printable_tree(v) for v in value]
    return value


class PrintableFormatter(logging.Formatter):
    """A Formatter whose messages hold no control characters: one record is one line of watcher.log.

    A job's file name, name or error text reaches log messages; escaping here keeps every record on
    one line whatever a message's arguments hold. Tracebacks (exc_info) stay multi-line.
    """

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = printable(record.message)
        return super().formatMessage(record)


# -- redaction ------------------------------------------------------------------------------------------
# Secrets never reach the records (docs/records.md): redaction by name and by value.
#
# Two strengths, because records hold hashes and ids that look random too:
#
# - ``redact_text`` replaces *credential shapes* wherever they appear in a string: prefixed tokens
#   (``hf_``, ``ghp_``/``github_pat_``, ``sk-``, ``AKIA``, ``xox[abprs]-``, ``glpat-``, ``AIza``, ``npm_``,
#   ``pypi-``, Stripe's ``sk_live_``), JSON Web Tokens, and the password of a URL's userinfo
#   (``https://user:PASS@host``). None of these can be a hex digest, so it is safe on every string a
#   record carries: run.json and events.jsonl pass through it.
# - ``redact_value`` is for values a user typed into ``env`` or a command line (snapshot/config.json,
#   snapshot/environment.json): it also replaces a whole value (or the part after ``=`` of
#   ``--opt=VALUE``) that is a long hex or high-entropy base64 token. Hashes the records are made of
#   (code.json's commit, sources.json's sha256, job ids) never pass through it.
#
# Names count too (``SECRET_NAME``): a variable called ``*TOKEN*``, ``*PASSW*``, ... is redacted whatever
# its value. Dependency-free (the supervisor and the trainer may import it).

#: what a redacted value reads
REDACTED = "<redacted>"
#: environment variable names whose values are never written
SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSW|API_?KEY|ACCESS_?KEY|PRIVATE|CREDENTIAL|AUTH|COOKIE|SESSION", re.I)
#: credential shapes, found anywhere in a string (each needs enough random-looking characters that a word,
#: a path or a job id does not match)
CREDENTIAL = re.compile(
    r"""
    \bhf_[A-Za-z0-9]{20,}                             # Hugging Face
    | \bgh[pousr]_[A-Za-z0-9]{30,}                     # GitHub classic tokens
    | \bgithub_pat_[A-Za-z0-9_]{40,}                   # GitHub fine-grained tokens
    | \bsk-(?:proj-|ant-[a-z0-9]+-)?[A-Za-z0-9_-]{24,}  # OpenAI, Anthropic
    | \b[sr]k_(?:live|test)_[A-Za-z0-9]{16,}           # Stripe
    | \b(?:AKIA|ASIA)[0-9A-Z]{16}\b                    # AWS access key ids
    | \bxox[abprs]-[A-Za-z0-9-]{10,}                   # Slack
    | \bglpat-[A-Za-z0-9_-]{20,}                       # GitLab
    | \bAIza[0-9A-Za-z_-]{35}                          # Google API keys
    | \bnpm_[A-Za-z0-9]{36}                            # npm
    | \bpypi-[A-Za-z0-9_-]{50,}                        # PyPI
    | \beyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}  # JSON Web Tokens
    """,
    re.X,
)
#: substrings one of which every credential shape holds, each as narrow as its shape allows (the cheap test before the
#: regexes; "gh" alone matched every path through a folder named "throughput" or "github"); a URL password is
#: tested by its ``://user:`` ... ``@`` frame
_MARKERS = (
    "hf_",
    "ghp_",
    "gho_",
    "ghu_",
    "ghs_",
    "ghr_",
    "_pat_",
    "sk-",
    "k_live_",
    "k_test_",
    "AKIA",
    "ASIA",
    "xox",
    "glpat-",
    "AIza",
    "npm_",
    "pypi-",
    "eyJ",
)
#: a URL's userinfo password: scheme://user:PASSWORD@host (the password group is replaced)
URL_PASSWORD = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*://[^\s:/@]*:)([^\s/@]+)(@)")
#: a whole value that is a long hex string (API keys such as W&B's 40 hex digits)
LONG_HEX = re.compile(r"[0-9a-fA-F]{32,}")
#: a whole value that may be base64/url-safe base64 (checked for entropy too)
LONG_BASE64 = re.compile(r"[A-Za-z0-9+/_-]{32,}={0,2}")
#: bits per character above which a base64-looking value counts as random (32 random base64 characters
#: measure 4.1-4.9; a long word-made name also passes, hence WORDY)
MIN_BASE64_ENTROPY = 4.2
#: six lower-case letters in a row (a word) and a path or name separator: a name, not a key
WORDY = re.compile(r"[a-z]{6}")
SEPARATOR = re.compile(r"[/_-]")


#: the markers as one pattern: one scan in C per string (``any(m in text ...)`` cost ~1.5 µs a string, and every
#: string of every run.json and event passes here)
_ANY_MARKER = re.compile("|".join([*(re.escape(marker) for marker in _MARKERS), r"://[^\s:/@]*:[^\s/@]+@"]))


def may_hold_secret(text: str) -> bool:
    """Whether ``text`` holds a substring every credential shape or URL password has (``redact_text`` may change it)."""
    return _ANY_MARKER.search(text) is not None


def redact_text(text: str) -> str:
    """``text`` with every credential shape and URL password replaced by ``<redacted>``."""
    if not text or _ANY_MARKER.search(text) is None:
        return text  # most strings a record holds (times, paths, states): one scan, no credential regex
    text = CREDENTIAL.sub(REDACTED, text)
    return URL_PASSWORD.sub(lambda m: m.group(1) + REDACTED + m.group(3), text)


def is_token(value: str) -> bool:
    """A whole value that is a long hex string or a high-entropy base64 string (not a path)."""
    if LONG_HEX.fullmatch(value):
        return True
    if not LONG_BASE64.fullmatch(value) or value.startswith("/") or "//" in value:
        return False
    if WORDY.search(value) and SEPARATOR.search(value):
        return False  # runs/Experiment_2024_lora: words between separators, a name rather than a key
    classes = sum(bool(re.search(p, value)) for p in ("[a-z]", "[A-Z]", "[0-9]"))
    return classes == 3 and _entropy(value.rstrip("=")) > MIN_BASE64_ENTROPY


def redact_value(value: str) -> str:
    """A value typed into ``env`` or an argv item: a whole token, the ``VALUE`` of ``--opt=VALUE``, or a
    credential shape inside it, read ``<redacted>``."""
    if is_token(value):
        return REDACTED
    head, sep, tail = value.partition("=")
    if sep and tail and is_token(tail):
        return head + sep + REDACTED
    return redact_text(value)


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with secret-looking names' values, and secret-looking values, replaced by ``<redacted>``."""
    return {k: REDACTED if SECRET_NAME.search(k) else redact_value(str(v)) for k, v in env.items()}


def redacted(value: object) -> object:
    """``redact_strings(value)``, or ``value`` itself when no string in it can hold a secret: one scan of its repr,
    which escapes none of the markers' characters (a tuple then stays a tuple; JSON writes both alike)."""
    return redact_strings(value) if may_hold_secret(repr(value)) else value


def redact_strings(value: object) -> object:
    """Every string inside ``value`` (dicts, lists, nested) through ``redact_text``; keys are kept."""
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, dict):
        return {k: redact_strings(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_strings(v) for v in value]
    return value


def _entropy(text: str) -> float:
    counts = Counter(text)
    return -sum(n / len(text) * math.log2(n / len(text)) for n in counts.values())
