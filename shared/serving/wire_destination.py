"""A transfer's destination on the node-to-node wire (prefill.proto's `KvDestination`): issued
by the node that receives (a decode node's KV blocks, a prefill node's embedding landing area),
carried by the gRPC call that asks for the push."""

from __future__ import annotations

from proto.pdserve.v1 import prefill_pb2
from transfer.protocol import TransferDestination


def destination_to_proto(
    dest: TransferDestination, first_block: int = 0
) -> prefill_pb2.KvDestination:
    return prefill_pb2.KvDestination(
        ucx_address=dest.address,
        transfer_id=dest.transfer_id,
        transfer_token=dest.token,
        block_ids=list(dest.block_ids),
        first_block_index=first_block,
        layout_fingerprint=dest.layout_fingerprint,
        skipped_blocks=list(dest.skipped),
        prefill_instance_id=dest.sender_instance,
        decode_instance_id=dest.receiver_instance,
    )


def destination_from_proto(d: prefill_pb2.KvDestination) -> TransferDestination:
    """Raises ValueError for a malformed destination (address, token, ids)."""
    return TransferDestination(
        address=d.ucx_address,
        transfer_id=d.transfer_id,
        token=bytes(d.transfer_token),
        block_ids=tuple(d.block_ids),
        layout_fingerprint=d.layout_fingerprint,
        skipped=tuple(d.skipped_blocks),
        sender_instance=d.prefill_instance_id,
        receiver_instance=d.decode_instance_id,
    )
