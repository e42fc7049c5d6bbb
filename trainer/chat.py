"""Chat rows to token ids and labels, with the loss on assistant turns only (``train_on: assistant``) or on all.

Three ways to find the assistant tokens, tried in this order:

1. The tokenizer's chat template marks them with ``{% generation %}``: transformers'
   ``apply_chat_template(..., return_assistant_tokens_mask=True)`` gives the mask.
2. Any other chat template (the fallback): render the conversation prefix by prefix. For each assistant turn
   ``i``, ``render(messages[:i], add_generation_prompt=True)`` must be a prefix of
   ``render(messages[:i + 1])``, which must be a prefix of the whole rendering; the characters between the
   two are that turn (with its end-of-turn marker). Tokens overlapping those character spans (fast tokenizer
   offsets) are trained on, the same overlap rule transformers uses for ``{% generation %}``.
   A template whose renderings are not prefixes of each other cannot be masked: ``UnmaskableTemplate``.
3. No chat template: ``role: content`` lines; the assistant contents, each followed by an eos, are trained on.

The template's text is tokenized as it is: trainq adds no BOS/EOS of its own to templated rows (a template that
writes ``{{ bos_token }}`` would otherwise get it twice).
"""

from __future__ import annotations

import json
import re

#: label value the loss ignores (transformers' convention)
IGNORE_INDEX = -100
#: a Jinja ``{% generation %}`` block (with or without whitespace control)
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class UnmaskableTemplate(Exception):
    """Raised when the chat template gives no way to tell assistant tokens from the rest."""


def has_generation_tags(tokenizer) -> bool:
    """True when the chat template marks assistant output with ``{% generation %}``."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and bool(_GENERATION_TAG.search(template))


def masking_method(tokenizer) -> str:
    """``generation`` | ``prefix`` | ``plain``: how assistant tokens are found for this tokenizer."""
    if not getattr(tokenizer, "chat_template", None):
        return "plain"
    return "generation" if has_generation_tags(tokenizer) else "prefix"


def _render(tokenizer, messages: list[dict], generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _plain_content(msg: dict) -> str:
    """A message's text for ``role: content`` lines; tool calls are written as JSON after it."""
    calls = msg.get("tool_calls")
    if not calls:
        return msg["content"]
    return msg["content"] + json.dumps([c.get("function", c) for c in calls], ensure_ascii=False)


def _plain(messages: list[dict], tokenizer) -> tuple[list[int], list[bool]]:
    """``role: content`` lines, bos first; every assistant turn ends with eos (trained), so a model learns to stop
    after each of its turns, not only after the last one; a conversation ending on another role ends with an
    untrained eos."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids, mask = list(bos), [False] * len(bos)
    text, spans = "", []
    for i, msg in enumerate(messages):
        head = ("\n" if text or i else "") + f"{msg['role']}: "
        content = _plain_content(msg)
        start = len(text) + len(head)
        text += head + content
        if msg["role"] != "assistant":
            continue
        spans.append((start, start + len(content)))
        piece_ids, piece_mask = _tokenize_spans(text, spans, tokenizer)
        ids += piece_ids + eos
        mask += piece_mask + [True] * len(eos)
        text, spans = "", []
    if text or messages[-1]["role"] != "assistant":
        piece_ids, piece_mask = _tokenize_spans(text, spans, tokenizer) if text else ([], [])
        ids += piece_ids + eos
        mask += piece_mask + [False] * len(eos)
    return ids, mask


def prefix_spans(messages: list[dict], tokenizer) -> tuple[str, list[tuple[int, int]]]:
    """The whole rendering and each assistant turn's character span, found by rendering prefix by prefix."""
    whole = _render(tokenizer, messages)
    spans = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], generation_prompt=True) if i else ""
        through = _render(tokenizer, messages[: i + 1])
        if not through.startswith(before) or not whole.startswith(through):
            raise UnmaskableTemplate(
                f"the chat template does not render conversations prefix by prefix (turn {i + 1}), so assistant "
                "tokens cannot be told apart; add {% generation %} tags to the template or set train_on: all"
            )
        spans.append((len(before), len(through)))
    return whole, spans


def _mask_from_offsets(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[bool]:
    """Tokens overlapping any span (both lists in order)."""
    mask, k = [], 0
    for start, end in offsets:
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        mask.append(k < len(spans) and end > spans[k][0] and start < spans[k][1])
    return mask


def _tokenize_spans(text: str, spans: list[tuple[int, int]], tokenizer) -> tuple[list[int], list[bool]]:
    if not getattr(tokenizer, "is_fast", False):
        raise UnmaskableTemplate(
            "masking assistant turns needs a fast tokenizer (character offsets); set train_on: all"
        )
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return encoded["input_ids"], _mask_from_offsets(encoded["offset_mapping"], spans)


def encode_messages(messages: list[dict], tokenizer, train_on: str) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of one conversation; labels are IGNORE_INDEX outside what ``train_on`` trains."""
    method = masking_method(tokenizer)
    if method == "plain":
        ids, mask = _plain(messages, tokenizer)
    elif train_on == "all":
        ids = tokenizer(_render(tokenizer, messages), add_special_tokens=False)["input_ids"]
        mask = [True] * len(ids)
    elif method == "generation":
        out = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids, mask = list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]
    else:
        ids, mask = _tokenize_spans(*prefix_spans(messages, tokenizer), tokenizer)
    if train_on == "all":
        return ids, list(ids)
    return ids, [t if keep else IGNORE_INDEX for t, keep in zip(ids, mask, strict=False)]
