"""No secret reaches a log line: the values of every URL query are masked.

Browsers cannot set headers on a WebSocket, so clients pass keys in the query (``?api_key=``,
ElevenLabs' ``?xi-api-key=``), and the ASGI server logs each WebSocket's path with its query,
accepted or refused. :class:`QueryRedaction`, a filter on the log handlers of every mossvox
process (``api.server.setup_logging``), rewrites each record's message so that every
``?name=value`` and ``&name=value`` in it reads ``name=<redacted>``: the names stay, for
debugging; no value does, a key or not, right or wrong.
"""

from __future__ import annotations

import logging
import re

MASK = "<redacted>"
_QUERY_VALUE = re.compile(r"([?&][^=&\s\"'#?]+=)[^&\s\"'#]*")


def redact_queries(text: str) -> str:
    """``text`` with the value of every query parameter masked."""
    return _QUERY_VALUE.sub(lambda m: m.group(1) + MASK, text) if "=" in text else text


class QueryRedaction(logging.Filter):
    """A handler filter: each record's message with its query values masked (``redact_queries``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        redacted = redact_queries(message)
        if redacted != message:
            record.msg, record.args = redacted, ()
        return True


def redact_handlers(logger: logging.Logger | None = None) -> None:
    """Put a ``QueryRedaction`` on each handler of ``logger`` (the root logger by default) that
    has none yet."""
    for handler in (logger or logging.getLogger()).handlers:
        if not any(isinstance(f, QueryRedaction) for f in handler.filters):
            handler.addFilter(QueryRedaction())
