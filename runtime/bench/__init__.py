"""stagecache.runtime.bench"""
