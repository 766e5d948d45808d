"""stagecache.runtime.cache"""
