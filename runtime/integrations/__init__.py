"""stagecache.runtime.integrations: optional bridges to serving engines.

Each subpackage imports its engine and fails with an install hint when it is missing
(``stagecache.runtime.integrations.sglang`` -> ``pip install '.[sglang]'`` in a checkout);
nothing else in stagecache imports these.
"""
