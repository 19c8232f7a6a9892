"""mossvox ipc layer: shared-memory SPSC rings, doorbells and typed channels between processes.

``Ring`` moves variable-length byte records; ``Channel`` adds a msgspec codec for one union of
wire records (``ipc/messages.py``) plus an optional raw array payload per record. ``Doorbell``
and ``wait_any`` let a process sleep until data (or a peer's death) arrives.
"""

from ipc.channel import Channel, ChannelSpec, ChannelStatistics, Received
from ipc.doorbell import Doorbell, wait_any
from ipc.errors import (ChannelTimeout, EndOfStream, IpcError, PeerGone, RingClosed,
                        WouldBlock)
from ipc.peer import Peer
from ipc.ring import Ring, RingSpec, RingStatistics, record_footprint
from ipc.shm import new_instance_id, sweep_orphans

__all__ = [
    "Channel", "ChannelSpec", "ChannelStatistics", "ChannelTimeout", "Doorbell", "EndOfStream",
    "IpcError", "PeerGone", "Received", "Ring", "RingClosed", "RingSpec", "RingStatistics",
    "WouldBlock", "new_instance_id", "Peer", "record_footprint", "sweep_orphans", "wait_any",
]
