"""The response store: finished responses kept for ``GET /v1/responses/{id}`` and for
``previous_response_id``, each with the conversation it ends (its input items and output items,
as input items), so a continuation renders the same prompt prefix and hits the prefix cache.

Bounded by count and by bytes (of the stored JSON), least recently used evicted first; an
evicted response is as gone as a deleted one. One event loop uses it, so no lock.

Each response belongs to an ``owner`` (the tenant's name with a key file, else None): another
owner's id is looked up, deleted and continued exactly as an unknown one (None / False).
"""
from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from server.config import ResponseStoreConfig


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the Response object as it was returned
    conversation: list[Any]  # input items (pydantic, server.responses.protocol), oldest first
    size: int  # bytes counted against the cap


class ResponseStore:
    def __init__(self, config: ResponseStoreConfig) -> None:
        self.config = config
        self._entries: OrderedDict[tuple[str | None, str], StoredResponse] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict[str, Any], conversation: list[Any], owner: str | None = None) -> bool:
        """Keep ``response`` (under its ``id``); False when it alone exceeds the byte cap."""
        size = len(json.dumps(response, ensure_ascii=False)) + sum(
            len(item.model_dump_json(exclude_none=True)) for item in conversation)
        if size > self.config.max_bytes or self.config.max_responses == 0:
            return False
        self.delete(response["id"], owner)
        self._entries[(owner, response["id"])] = StoredResponse(response, list(conversation), size)
        self.bytes += size
        while len(self._entries) > self.config.max_responses or self.bytes > self.config.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.bytes -= evicted.size
        return True

    def get(self, response_id: str, owner: str | None = None) -> StoredResponse | None:
        entry = self._entries.get((owner, response_id))
        if entry is not None:
            self._entries.move_to_end((owner, response_id))
        return entry

    def delete(self, response_id: str, owner: str | None = None) -> bool:
        entry = self._entries.pop((owner, response_id), None)
        if entry is None:
            return False
        self.bytes -= entry.size
        return True
