"""stagecache.runtime.live: a stage's live numbers (typed), the run directory that carries them, and the
liveness verdict over them -- what serve writes and the exporters, the dashboard and the sglang
integration read, below all of them."""
