"""L3: a third cache tier per stage, behind the host tier (storage that outlives one server).

One interface shaped like sglang's ``HiCacheStorage`` (``base.L3Store``: batch exists / get /
set by key, zero-copy variants into registered host buffers), one module per backend:

* ``memory`` -- an in-memory dict, the checked reference the other backends are tested against;
* ``file``   -- the embedded default: a private directory per deployment, atomic writes, a size
  bound with LRU eviction, a CRC-32C per object verified on every read;
* ``mooncake`` -- Mooncake Store (``mooncake-transfer-engine-non-cuda``) for a cluster, with
  ``master`` starting a local ``mooncake_master`` on loopback when no cluster master is given.

Keys are defined in one place (``keys``): every key names the deployment (the plan's fingerprint
digest), the TP rank, the stage (PP rank and its layer range), the pool kind and the page, so no
two stages or deployments can read each other's bytes; ``startup`` writes and reads back a probe
and a manifest of the fingerprint before a stage serves.
"""
