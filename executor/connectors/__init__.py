"""Adapters that plug epd-ring into an engine's own connector interface.

`vllm.py` is vLLM's encoder-cache (EC) connector: vLLM loads it by module path
(`ec_connector_module_path`), so nothing in vLLM is patched. An adapter sits over the
drivers (it may import core and drivers); nothing in the core, the drivers or the tools
imports an adapter, so the engine's package stays an optional extra (a test checks both).
"""
