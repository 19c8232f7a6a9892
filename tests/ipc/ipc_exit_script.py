"""Run as a script by test_ipc_lifecycle: ends that are never closed must still leave no segment
and no resource_tracker complaint when the processes exit normally.

usage: python ipc_exit_script.py INSTANCE
"""

import multiprocessing as mp
import sys

from ipc import Channel, Ring


def child(ring_spec, channel_spec):
    ring = ring_spec.open()
    ring.send(b"hi")
    channel = channel_spec.open()
    channel.send(42)
    # exit without closing either end: the finalizers mark them closed at exit


if __name__ == "__main__":
    instance = sys.argv[1]
    reader = Ring.create("exit-ring", 4096, role="reader", instance=instance)
    chan = Channel.create("exit-chan", msg_type=int, capacity=4096, role="reader",
                          instance=instance)
    never_opened = Ring.create("exit-unopened", 4096, role="writer", instance=instance)
    proc = mp.get_context("spawn").Process(target=child, args=(reader.spec(), chan.spec()))
    proc.start()
    proc.join(30)
    assert proc.exitcode == 0
    assert bytes(reader.recv(5)) == b"hi"
    reader.release()
    assert chan.recv(5).msg == 42
    print("ok", flush=True)
    # exit with all three ends still open (never_opened never had an opener)
