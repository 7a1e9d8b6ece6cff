"""Stored responses, for `GET /v1/responses/{id}` and `previous_response_id`: in this node's
memory, bounded in bytes and in entries, least recently used evicted first.

Each entry keeps the response object's JSON and the conversation up to and including its output
(the chat messages the next turn starts from), so a chain of turns costs the sum of its
conversations: the byte bound is what keeps that finite. An entry belongs to the credential that
created it (a SHA-256 of its Authorization header, never the key itself); another credential is
told it does not exist. Nothing survives a restart, and another node does not see it (the proxy
asks each replica in turn).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_ENTRIES = 10_000


def owner_of(authorization: str | None) -> str:
    return hashlib.sha256((authorization or "").encode()).hexdigest()


@dataclass(frozen=True)
class StoredResponse:
    owner: str
    body: bytes  # the response object, as GET answers it
    conversation: bytes  # JSON: the chat messages after this response (instructions aside)

    @property
    def size(self) -> int:
        return len(self.body) + len(self.conversation) + len(self.owner)

    def messages(self) -> list[dict[str, Any]]:
        return json.loads(self.conversation)


class ResponseStore:
    def __init__(
        self, max_bytes: int = DEFAULT_MAX_BYTES, max_entries: int = DEFAULT_MAX_ENTRIES
    ) -> None:
        self.max_bytes, self.max_entries = max_bytes, max_entries
        self.bytes = 0
        self.entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, rid: str, entry: StoredResponse) -> bool:
        """Keep `entry`, evicting the least recently used ones; False if it alone is too big."""
        if entry.size > self.max_bytes or self.max_entries == 0:
            if self.max_bytes and self.max_entries:  # not an operator's "keep none"
                log.warning("response %s (%d bytes) exceeds the store's bound", rid, entry.size)
            return False
        self.delete(rid, entry.owner)
        while self.entries and (
            self.bytes + entry.size > self.max_bytes or len(self.entries) >= self.max_entries
        ):
            _, evicted = self.entries.popitem(last=False)
            self.bytes -= evicted.size
        self.entries[rid] = entry
        self.bytes += entry.size
        return True

    def get(self, rid: str, owner: str) -> StoredResponse | None:
        entry = self.entries.get(rid)
        if entry is None or entry.owner != owner:
            return None
        self.entries.move_to_end(rid)
        return entry

    def delete(self, rid: str, owner: str) -> bool:
        entry = self.entries.get(rid)
        if entry is None or entry.owner != owner:
            return False
        del self.entries[rid]
        self.bytes -= entry.size
        return True
