"""``python -m stagecache``: the ``stagecache`` command, for a shell where the script is not on
PATH (a virtualenv that is not activated)."""

from stagecache.runtime.cli.main import entry

entry()
