"""mossvox ipc layer: shared-memory SPSC rings, doorbells and typed channels between processes.

``Ring`` moves variable-length byte records; ``Channel`` adds a msgspec codec for one union of
wire records (``ipc/messages.py``) plus an optional raw array payload per record. ``Doorbell``
and ``wait_any`` let a process sleep until data (or a peer's death) arrives.

Typical use (the owner creates, the spawned process opens)::

    inbox = Channel.create("talker-in", msg_type=TalkerInbox, capacity=1 << 20,
                           role="writer", instance=instance)          # owner, writing end
    proc = mp.get_context("spawn").Process(target=work, args=(inbox.spec(),)); proc.start()
    inbox.watch_peer(proc.pid)                                        # PeerGone if it dies early
    inbox.send(Submit(...), codes)                                    # codes: np.ndarray

    def work(spec):                                                   # in the child
        inbox = spec.open()                                           # reading end
        with inbox.recv(timeout=1.0) as got:                          # or try_recv / recv_async
            codes = got.array(np.int64, (got.msg.frames, n_vq))       # zero-copy until release
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
