"""The cluster's shared state in Redis: the instance registry (registry.py: each engine's heartbeat record, read by
the gateway and the launcher) and the prefix-cache index (prefix_index.py: engines publish their KV events, the
gateway's router reads which instance holds which block hashes). Only the services use these; the engine does not.
"""
