"""stagecache.integrations: optional bridges to serving engines.

Each submodule imports its engine and fails with an install hint when it is missing
(``stagecache.integrations.sglang`` -> ``pip install 'stagecache[sglang]'``); nothing
here is imported by the core package.
"""
