"""stagecache.runtime.transfer"""
