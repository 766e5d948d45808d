"""stagecache.runtime.model"""
