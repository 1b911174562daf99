"""Gateway logs for ``crosstalk replay``: LiteLLM's ``StandardLoggingPayload``.

LiteLLM (the proxy many deployments put in front of their engines) builds one
``StandardLoggingPayload`` per call (``litellm/types/utils.py``;
``litellm_core_utils/litellm_logging.py`` fills it) and its GCS, S3 and file loggers write
them as newline-delimited JSON. Fields used:

* ``messages`` (the request's messages; a string for text completions) and ``response``
  (the OpenAI-shaped ``ModelResponse``), replayed as a chat or text completion;
* ``startTime`` / ``endTime``: epoch seconds; ``litellm_call_id`` (else ``id``): the id;
* the tenant: the key's team alias, team id, key alias, key hash, the end user, the
  call's ``user`` parameter (first found, ``LITELLM_TENANT_FIELDS``); LiteLLM's unit of
  isolation is the team;
* ``status`` other than ``success``: the call failed (no response expected);
* ``turn_off_message_logging`` writes ``redacted-by-litellm`` in place of the text: such a
  payload holds nothing to scan and counts as not scannable.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson

from proxy.forensics.inputs import (
    NO_TENANT_FIELDS,
    InputFile,
    LoggedExchange,
    OnSkip,
    TenantFrom,
    epoch,
    field_at,
    read_json_lines,
)
from proxy.forensics.replayer import ExchangeRecord

#: Where a LiteLLM payload names the tenant, first found wins: the proxy's key team,
#: alias and hash; then the end user (the proxy's ``user`` of the request) and, for
#: calls made with the SDK (no key metadata), the ``user`` parameter of the call.
LITELLM_TENANT_FIELDS = (
    "metadata.user_api_key_team_alias",
    "metadata.user_api_key_team_id",
    "metadata.user_api_key_alias",
    "metadata.user_api_key_hash",
    "metadata.user_api_key_end_user_id",
    "end_user",
    "model_parameters.user",
)
LITELLM_REDACTED = "redacted-by-litellm"  # turn_off_message_logging
_TEXT_CALLS = ("text_completion", "atext_completion")


def is_litellm_payload(obj: dict) -> bool:
    return "call_type" in obj and "messages" in obj and isinstance(obj.get("metadata"), dict)


def litellm_record(
    obj: Any, position: str, fallback_id: str, tenant_from: TenantFrom = NO_TENANT_FIELDS
) -> ExchangeRecord:
    """One LiteLLM payload as a chat (or text) completion exchange."""
    if not isinstance(obj, dict) or not is_litellm_payload(obj):
        raise ValueError("not a LiteLLM StandardLoggingPayload")
    when = epoch(obj.get("startTime"), "startTime")
    end = epoch(obj["endTime"], "endTime") if obj.get("endTime") is not None else when
    text_call = obj.get("call_type") in _TEXT_CALLS
    messages = obj["messages"]
    if not isinstance(messages, str | list):
        raise ValueError("messages must be a list or a string")
    if text_call:
        # LiteLLM 1.110 logs a text call's prompt as one user message.
        request: dict | None = {
            "prompt": messages if isinstance(messages, str) else _joined(messages)
        }
    elif isinstance(messages, str):
        request = {"messages": [{"role": "user", "content": messages}]}
    else:
        request = {"messages": messages}
    if LITELLM_REDACTED in orjson.dumps(messages).decode():
        request = None
    payload = obj.get("response")
    failed = obj.get("status", "success") != "success" or not isinstance(payload, dict)
    response = (
        payload if not failed and LITELLM_REDACTED not in orjson.dumps(payload).decode() else None
    )
    if text_call and response is not None:
        response = _as_text_completion(response)
    request_id = obj.get("litellm_call_id") or obj.get("id")
    tenant = tenant_from.pick(lambda f: field_at(obj, f), LITELLM_TENANT_FIELDS)
    return LoggedExchange(
        time=when,
        end=end,
        path="/v1/completions" if text_call else "/v1/chat/completions",
        request=request,
        response=response,
        request_id=request_id if isinstance(request_id, str) and request_id else None,
        tenant=tenant,
        tenant_missing="the payload names no key team, alias or hash: give --tenant-from FIELD",
        failed=failed,
        missing_note=(
            "LiteLLM's turn_off_message_logging kept no text"
            if request is None or (not failed and response is None)
            else None
        ),
    ).record(position, "", fallback_id)


def _joined(messages: list) -> str:
    """The text of logged messages, one a line (a text call's prompt): string contents
    and the ``text`` of content parts; anything else holds no prompt text."""
    texts = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else message
        parts = content if isinstance(content, list) else [content]
        for part in parts:
            text = part.get("text") if isinstance(part, dict) else part
            if isinstance(text, str) and text:
                texts.append(text)
    return "\n".join(texts)


def _as_text_completion(response: dict) -> dict:
    """A text completion's response as ``choices[].text``. LiteLLM logs a streamed
    ``atext_completion`` as the chat response it assembled (``"object":
    "chat.completion"``, ``choices[].message.content``): read as a text completion, its
    text would be missed and the exchange called clean."""
    choices = response.get("choices")
    if not isinstance(choices, list):
        return response
    texts = []
    for i, choice in enumerate(choices):
        if not isinstance(choice, dict):
            return response
        text = choice.get("text")
        if text is None and isinstance(choice.get("message"), dict):
            text = choice["message"].get("content")
        texts.append(
            {"index": choice.get("index", i), "text": text if isinstance(text, str) else ""}
        )
    return {**response, "object": "text_completion", "choices": texts}


def read_litellm(source: InputFile, on_skip: OnSkip) -> Iterator[ExchangeRecord]:
    return read_json_lines(
        source, on_skip, lambda obj, pos, fid: litellm_record(obj, pos, fid, source.tenant_from)
    )
