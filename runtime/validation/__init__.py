"""stagecache.runtime.validation"""
