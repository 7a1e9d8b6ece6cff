"""How much KV a node keeps below its pool: host memory, then local disk (both off by default).

`model_id` is what the node serves (its --model): with the pool's block shape, dtype and block
size it makes a tier's keys, so no block is ever reused across incompatible configurations.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30


@dataclass(frozen=True)
class OffloadConfig:
    cpu_bytes: int = 0
    disk_dir: str = ""
    disk_bytes: int = 0
    model_id: str = ""
    # at shutdown, the time the disk tier gets to keep what host memory and the pool hold
    # (a stop within a pod's termination grace; what is not written by then is recomputed)
    persist_s: float = 10.0

    @classmethod
    def from_gb(cls, cpu_gb: float, disk_dir: str, disk_gb: float, model_id: str) -> OffloadConfig:
        config = cls(int(cpu_gb * GIB), disk_dir, int(disk_gb * GIB), model_id)
        config.validate()
        return config

    @property
    def enabled(self) -> bool:
        return self.cpu_bytes > 0

    def validate(self) -> None:
        if self.cpu_bytes < 0 or self.disk_bytes < 0:
            raise ValueError("--kv-offload-cpu-gb and --kv-offload-disk-gb must be >= 0")
        if bool(self.disk_dir) != (self.disk_bytes > 0):
            raise ValueError("--kv-offload-disk-dir and --kv-offload-disk-gb go together")
        if self.disk_dir and not self.cpu_bytes:
            raise ValueError(
                "--kv-offload-disk-dir needs --kv-offload-cpu-gb: disk blocks are written from "
                "and read back through the host tier"
            )
