"""stagecache.runtime.plan: the one frozen plan of a run (``plan.build_plan``)."""
