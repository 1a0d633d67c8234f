"""Tools: the `epd-ring` command line, the demos, the benchmarks and the toy
tower they drive. They sit on top: they may import the drivers, the core,
`epd_ring.models` and `epd_ring.fsm`; nothing in the library imports them.
"""
