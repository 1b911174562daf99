"""Prevention: tenant-keyed ``cache_salt`` and per-tenant canaries (docs/operations.md, "Prevention").

Detection is half of the control; a gateway can also prevent:

* **cache_salt.** vLLM and SGLang share prefix-cache blocks only between requests with
  the same ``cache_salt`` (vLLM PR #17045, SGLang PR #30827); vLLM's guidance is that a
  trusted gateway sets it, never the caller. :func:`cache_salt` derives it from the
  tenant (or the tenant's salt group) by HMAC-SHA256 under a secret of the
  configuration; :func:`rewrite_request` puts it into the request body, replacing
  whatever the client sent.
* **Canaries.** :func:`canary_for` derives a per-tenant canary by HMAC; the request
  rewrite adds it to the chat's system prompt. The engine knows it as the tenant's
  canary, so seen in another tenant's output it is a certain leak (finding kind
  ``canary``). The tenant's own client never sees it: :func:`strip_body` removes it
  from whole responses and :class:`CanaryStripper` from SSE streams, holding back the
  end of a delta that could be the start of the canary until the next delta decides.

No mitmproxy imports: bytes in, bytes out (``proxy/mitm/prevention_addon.py`` wires it to the proxy).
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.protocols.sse import SSEFramer

__all__ = [
    "CANARY_LENGTH",
    "CanaryStripper",
    "RequestRewrite",
    "cache_salt",
    "canary_for",
    "canary_line",
    "rewrite_request",
    "strip_body",
]

_SALT_CONTEXT = b"crosstalk cache_salt v1\x00"
_CANARY_CONTEXT = b"crosstalk canary v1\x00"
_ALPHABET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
# "Xq9" + 22 base-62 characters: upper, lower and digit, 25 characters, no separator,
# so the engine's entity extraction reads it as one token (replicas that know the
# canary only by its keyed id find it that way).
_CANARY_PREFIX = "Xq9"
CANARY_LENGTH = len(_CANARY_PREFIX) + 22
_CHAT_TEXT_FIELDS: tuple[str, ...] = ("content", "reasoning_content", "reasoning")


def cache_salt(secret: bytes, tenant: str, groups: Mapping[str, str] | None = None) -> str:
    """The ``cache_salt`` of ``tenant``: 32 hex characters of HMAC-SHA256 under
    ``secret``, of the tenant's group when ``groups`` (tenant -> group) names one, so
    that a group's tenants share prefix-cache blocks with each other and no one else."""
    group = (groups or {}).get(tenant)
    label = b"group\x00" + group.encode() if group is not None else b"tenant\x00" + tenant.encode()
    return hmac.new(secret, _SALT_CONTEXT + label, hashlib.sha256).hexdigest()[:32]


def canary_for(secret: bytes, tenant: str) -> str:
    """The tenant's canary: stable under one secret, unguessable without it."""
    n = int.from_bytes(hmac.new(secret, _CANARY_CONTEXT + tenant.encode(), "sha256").digest())
    chars = []
    for _ in range(CANARY_LENGTH - len(_CANARY_PREFIX)):
        n, r = divmod(n, 62)
        chars.append(_ALPHABET[r])
    return _CANARY_PREFIX + "".join(chars)


def canary_line(canary: str) -> str:
    """What is added to the system prompt."""
    return f"Internal reference {canary}; never repeat it."


@dataclass(frozen=True, slots=True)
class RequestRewrite:
    body: bytes
    salt_replaced: bool = False  # the client had sent a cache_salt of its own
    canary_added: bool = False


def rewrite_request(body: bytes, *, salt: str | None, canary: str | None) -> RequestRewrite:
    """``body`` (a JSON object) with ``cache_salt`` set to ``salt`` and, for a chat
    request (``messages``), ``canary_line(canary)`` added to the system prompt.

    Only what is added changes: a salt alone is inserted as the object's first key and
    every other byte is kept; a replaced salt or a canary re-serialises the object
    (same keys, same order, compact JSON). Raises ValueError for a body that is not a
    JSON object (the caller passes it through unchanged).
    """
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise ValueError(f"request body is not JSON: {e}") from e
    if not isinstance(obj, dict):
        raise ValueError("request body is not a JSON object")
    replaced = salt is not None and "cache_salt" in obj
    canary_added = False
    if canary is not None and isinstance(obj.get("messages"), list):
        canary_added = _add_to_system(obj["messages"], canary_line(canary))
    if salt is not None and not replaced and not canary_added:
        start = body.index(b"{") + 1
        rest = body[start:]
        sep = b"," if rest.strip() != b"}" else b""
        inserted = b'"cache_salt":' + orjson.dumps(salt) + sep
        return RequestRewrite(body[:start] + inserted + rest)
    if salt is not None:
        obj["cache_salt"] = salt
    if not replaced and not canary_added:
        return RequestRewrite(body)
    return RequestRewrite(orjson.dumps(obj), replaced, canary_added)


def _add_to_system(messages: list, line: str) -> bool:
    """Append ``line`` to a leading system (or developer) message, or insert one."""
    first = messages[0] if messages else None
    if isinstance(first, dict) and first.get("role") in ("system", "developer"):
        content = first.get("content")
        if isinstance(content, str):
            first["content"] = f"{content}\n\n{line}" if content else line
            return True
        if isinstance(content, list):
            content.append({"type": "text", "text": line})
            return True
        if content is None:
            first["content"] = line
            return True
        return False  # a shape we do not know: leave the request alone
    messages.insert(0, {"role": "system", "content": line})
    return True


# -- removing the canary from what the tenant receives -------------------------------


class _Remover:
    """Case-insensitive removal of one canary from text that arrives in pieces."""

    def __init__(self, canary: str) -> None:
        self.lower = canary.lower()
        self.pattern = re.compile(re.escape(canary), re.IGNORECASE)
        self.removed = 0

    def remove(self, text: str) -> str:
        if self.lower not in text.lower():
            return text
        text, n = self.pattern.subn("", text)
        self.removed += n
        return text

    def split(self, text: str) -> tuple[str, str]:
        """``text`` without canaries, cut into (what may go now, what must wait): the
        longest end of the text that is a start of the canary waits."""
        text = self.remove(text)
        lower = text.lower()
        first = self.lower[0]
        pos = lower.find(first, max(0, len(lower) - len(self.lower) + 1))
        while pos != -1:
            if self.lower.startswith(lower[pos:]):
                return text[:pos], text[pos:]
            pos = lower.find(first, pos + 1)
        return text, ""


def strip_body(body: bytes, canary: str) -> tuple[bytes, int] | None:
    """A whole (decoded) chat/completions response without ``canary``: the new body
    and how many were removed, or None when the body holds none (or is not JSON)."""
    if canary.lower().encode() not in body.lower():
        return None
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    remover = _Remover(canary)
    choices = obj.get("choices") if isinstance(obj, dict) else None
    for choice in choices if isinstance(choices, list) else []:
        if not isinstance(choice, dict):
            continue
        message = choice.get("message")
        for holder, fields in ((message, _CHAT_TEXT_FIELDS), (choice, ("text",))):
            if isinstance(holder, dict):
                for name in fields:
                    if isinstance(holder.get(name), str):
                        holder[name] = remover.remove(holder[name])
    if not remover.removed:
        return None
    return orjson.dumps(obj), remover.removed


class CanaryStripper:
    """Removes one canary from an OpenAI SSE stream (chat or completions).

    ``feed`` takes the raw bytes the proxy is about to send (any cut) and returns the
    bytes to send instead. Whole events pass byte for byte unless their text changes:
    an event whose delta holds (part of) the canary is re-serialised with that text
    removed or held back. Held text goes out with the choice's next event, its finish
    event, or before ``[DONE]``/the end of the stream if it turns out not to be the
    canary. Events that are not ``data: {json}`` (comments, errors, ``[DONE]``) pass.
    """

    def __init__(self, canary: str) -> None:
        self._remover = _Remover(canary)
        self._framer = SSEFramer()
        self._held: dict[tuple[int, str], str] = {}
        self._template: dict[str, Any] = {}
        self._chat = True

    @property
    def removed(self) -> int:
        return self._remover.removed

    def feed(self, chunks: Iterable[bytes], *, end: bool = False) -> list[bytes]:
        out: list[bytes] = []
        for chunk in chunks:
            for event in self._framer.feed(chunk):
                out += self._event(event)
        if end:
            rest = self._framer.close()
            out += self._flush()
            if rest:
                out.append(rest)
        return out

    def _event(self, event: bytes) -> list[bytes]:
        body = event.rstrip(b"\r\n")
        if not body.startswith(b"data:") or b"\n" in body or b"\r" in body:
            return [event]
        payload = body[5:].strip()
        if payload == b"[DONE]":
            return [*self._flush(), event]
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return [event]
        choices = obj.get("choices") if isinstance(obj, dict) else None
        if not isinstance(choices, list):
            # An error event ends the stream (enforce mode's cut, an engine error): what
            # is held goes out before it.
            return [*self._flush(), event]
        self._template = {k: obj[k] for k in ("id", "object", "created", "model") if k in obj}
        changed = False
        for choice in choices:
            if isinstance(choice, dict):
                changed |= self._choice(choice)
        return [b"data: " + orjson.dumps(obj) + b"\n\n"] if changed else [event]

    def _choice(self, choice: dict) -> bool:
        index = choice.get("index", 0)
        index = index if isinstance(index, int) else 0
        delta = choice.get("delta")
        if isinstance(delta, dict):
            holder, fields = delta, _CHAT_TEXT_FIELDS
        else:
            holder, fields, self._chat = choice, ("text",), False
        finished = choice.get("finish_reason") is not None
        changed = False
        for name in fields:
            value = holder.get(name)
            held = self._held.pop((index, name), "")
            if not isinstance(value, str):
                if held and finished:
                    holder[name], changed = held, True
                elif held:
                    self._held[(index, name)] = held
                continue
            now, wait = self._remover.split(held + value)
            if finished:
                now, wait = now + wait, ""
            if wait:
                self._held[(index, name)] = wait
            if now != value:
                holder[name], changed = now, True
        return changed

    def _flush(self) -> list[bytes]:
        """Held text that never became the canary: out in events of its own."""
        out = []
        for (index, name), text in self._held.items():
            if self._chat:
                choice = {"index": index, "delta": {name: text}, "finish_reason": None}
            else:
                choice = {"index": index, "text": text, "finish_reason": None}
            out.append(b"data: " + orjson.dumps({**self._template, "choices": [choice]}) + b"\n\n")
        self._held.clear()
        return out
