"""stagecache.dashboard"""
