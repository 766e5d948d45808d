"""stagecache.runtime.serve"""
