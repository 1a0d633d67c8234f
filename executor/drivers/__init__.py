"""Drivers at the edge: the code that does I/O around the sans-I/O core.

`mooncake` wraps the transfer engine (one-sided writes, polled without blocking),
`control` is the ZMQ control plane (receiver frames in, statuses out, never
blocking), `receiver` the reference prefill receiver, which may run as its own
process. Code here may open sockets, start threads or processes and call
engines; it drives `epd_ring.executor.core` and may import it, never the tools.
"""
