"""stagecache.exporters"""
