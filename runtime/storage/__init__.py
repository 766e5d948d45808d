"""L3: a third cache tier per stage, behind the host tier (storage that outlives one server).

One interface shaped like sglang's ``HiCacheStorage`` (``base.L3Store``), one module per backend
(``memory``: the checked reference; ``file``: the embedded default; ``mooncake``: a cluster),
keys in one place (``keys``), and a probe and manifest written and read back before a stage
serves (``startup``).  docs/l3.md describes them.
"""
