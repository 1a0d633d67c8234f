"""Which engine moves the bytes: chosen by name, so a deployment's configuration picks it.

Both engines stand behind the core's `Transport` seam with the same promises (docs/transports.md);
each is imported only when named, since each is an optional extra (`mooncake`, `nixl`).
"""

from __future__ import annotations

from typing import Any

TRANSPORTS = ("mooncake", "nixl")


def make_transport(kind: str, hostname: str = "127.0.0.1", **settings: Any) -> Any:
    """The encoder's transport named `kind` ("mooncake" or "nixl"), built with `settings` (its
    constructor's keywords: `notifier`, `connect_timeout`, ...); a name it does not know is a ValueError."""
    if kind == "mooncake":
        from .mooncake import MooncakeTransport

        return MooncakeTransport(hostname, **settings)
    if kind == "nixl":
        from .nixl import NixlTransport

        return NixlTransport(hostname, **settings)
    raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {kind!r}")
