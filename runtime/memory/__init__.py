"""stagecache.runtime.memory"""
