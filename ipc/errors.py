"""Errors raised by the ipc layer (anyio-style: one exception per way a channel can stop)."""


class IpcError(Exception):
    """Base class of every ipc error."""


class RingClosed(IpcError):
    """This end of the ring or channel was closed; it can no longer be used."""


class EndOfStream(IpcError):
    """The writer closed its end and every record it committed has been read."""


class WouldBlock(IpcError):
    """A non-blocking operation could not complete now (ring full)."""


class PeerGone(IpcError):
    """The peer went away: its process died, or (seen by a writer) the reader closed its end.

    A reader sees this only after it has drained every record the dead writer committed.
    """


class ChannelTimeout(IpcError, TimeoutError):
    """A blocking send or receive did not complete within its timeout."""
