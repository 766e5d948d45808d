"""The sglang flag arithmetic of the advice (the report itself is tested through the CLI)."""

from __future__ import annotations

from hypothesis import example, given
from hypothesis import strategies as st
from stagecache.runtime.sizing.advice import hicache_ratio_for


@given(st.integers(1, 10**7), st.integers(1, 10**6))
@example(83077, 5)  # 83077 / 5 * 100 is a hair above 1661540 in floats: 16615.41 was advised
def test_hicache_ratio_is_the_smallest_hundredth_that_holds_the_host_pages(host, device):
    """sglang floors ``device x ratio``: the ratio must survive the floor, a hundredth less not."""
    ratio = hicache_ratio_for(host, device)
    want = max(host, device)
    assert int(device * ratio) >= want
    assert ratio == round(ratio, 2) and (ratio <= 1.0 or int(device * round(ratio - 0.01, 2)) < want)
