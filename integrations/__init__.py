"""stagecache.integrations"""
