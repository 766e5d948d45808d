"""stagecache.runtime.cache: the runtime prefix cache -- radix tree, HiCache tiers, KV writer, page keys."""
