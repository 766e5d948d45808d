"""stagecache runtime: model spec, PP partition, stage layer maps, pools, transfers."""

__version__ = "0.1.0"
