"""stagecache.runtime.cli"""
