"""The KV transfer plane's public API (UCX via ucxx), importable as one module.

Import order: `configure_ucx_env` must run before ucxx is imported; importing this module runs it
with the defaults first (through `transfer.worker`), so a caller that wants other settings calls
`transfer.env.configure_ucx_env(...)` before importing this module, or at the latest before the
first receiver/sender starts (UCX reads most settings when a context is created).
"""

from __future__ import annotations

from transfer.env import configure_ucx_env
from transfer.errors import TransferCancelled, TransferError, TransferReset, TransferTimeout
from transfer.protocol import TransferDestination
from transfer.receiver import KvReceiver, TransferStats
from transfer.sender import KvMessage, KvPush, KvSender

__all__ = [
    "KvMessage",
    "KvPush",
    "KvReceiver",
    "KvSender",
    "TransferCancelled",
    "TransferDestination",
    "TransferError",
    "TransferReset",
    "TransferStats",
    "TransferTimeout",
    "configure_ucx_env",
]
