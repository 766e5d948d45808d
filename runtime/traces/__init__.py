"""stagecache.runtime.traces: request traces -- formats (tokens, Mooncake), generators, bounded readers."""
