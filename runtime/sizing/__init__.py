"""stagecache.runtime.sizing: offline sizing -- hit-rate curves over every capacity, bounds, the advice."""
