"""``stagecache check --sglang-storage`` where sglang 0.5.23 is installed: the answers are computed
by calling sglang's own key builders, and must equal the documented table.

Runs in ``.venv-sglang`` (tests/integrations/test_sglang_venv.py launches it with the other
comparisons with the pinned release's own objects), in the pytest process that has sglang imported
already: the command runs in-process.  Without sglang, tests/integrations/test_storage_keys.py
checks the table's own answers.
"""

from __future__ import annotations

import json

import pytest

sglang = pytest.importorskip("sglang", reason="sglang not installed (runs in .venv-sglang)")
if sglang.__version__ != "0.5.23":  # the release the table was read from
    pytest.skip(f"the table is read from sglang 0.5.23, this is {sglang.__version__}", allow_module_level=True)

from stagecache.runtime.cli.main import main  # noqa: E402
from stagecache.runtime.integrations.storage_keys import TABLE  # noqa: E402


def test_sglangs_own_key_functions_agree_with_the_table(capsys):
    code = main(["check", "--pp-size", "4", "--sglang-storage", "file", "--sglang-storage", "mooncake",
                 "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err[-2000:]
    found = {f["backend"]: f for f in json.loads(out)["sglang_storage"]}
    assert sorted(found) == ["file", "mooncake"]
    assert found["file"]["how"] == "sglang", found["file"]
    for backend, f in found.items():
        row = TABLE[backend]
        assert [f[p] for p in ("pp_rank", "model", "dtype", "layout")] == \
            [row.pp_rank, row.model, row.dtype, row.layout], backend
        if f["how"] != "sglang":  # the Mooncake wheel is optional there
            assert backend == "mooncake" and f["table_because"]
