#!/usr/bin/env bash
# How docs/bench/transfer-h200*.json were produced on the lent H200 (device tool, $OUT = results).
# The device image has torch/triton but no network: the package is put on the path via symlinks
# instead of `pip install -e` (which would need build dependencies).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
mkdir -p /tmp/pkg/stagecache
for d in runtime exporters dashboard integrations; do [ -d "$d" ] && ln -sfn "$PWD/$d" "/tmp/pkg/stagecache/$d"; done
export PYTHONPATH=/tmp/pkg
{ nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
# call the bench module directly: the full CLI imports every subcommand (some need packages
# the device image lacks)
cat > /tmp/bench_main.py <<'PY'
import argparse, sys
from stagecache.runtime import bench_transfer
p = argparse.ArgumentParser(); sub = p.add_subparsers()
bench_transfer.register(sub)
a = p.parse_args(["transfer", *sys.argv[1:]]); sys.exit(a.func(a))
PY
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py tests/test_kernels_interpret.py \
  tests/test_controller_roundtrip.py tests/test_allocator_page.py > "$OUT/pytest-gpu.log" 2>&1
echo "pytest rc=$?"; tail -5 "$OUT/pytest-gpu.log"
timeout 200 python3 /tmp/bench_main.py --out "$OUT/transfer-h200.json" > /dev/null 2> "$OUT/bench.err"; echo "bench rc=$?"
timeout 120 python3 /tmp/bench_main.py --mib 64 --out "$OUT/transfer-h200-64mib.json" > /dev/null 2>> "$OUT/bench.err"
echo "bench64 rc=$?"
# auto's size threshold: small transfers into one host run, staged vs direct
for m in 4 16; do timeout 40 python3 /tmp/bench_main.py --mib $m --pool swa --pool c4_state --pool c128 --pattern run \
  --out "$OUT/transfer-h200-${m}mib.json" > /dev/null 2>> "$OUT/bench.err"; done
echo "bench4 rc=$?"; tail -5 "$OUT/bench.err"
python3 - "$OUT/transfer-h200.json" "$OUT/transfer-h200-64mib.json" "$OUT/transfer-h200-4mib.json" "$OUT/transfer-h200-16mib.json" <<'PY'
import json, sys
for path in sys.argv[1:]:
    try:
        d = json.load(open(path))
    except Exception as e:
        print(path, "missing", e); continue
    print(path, json.dumps(d["summary"]))
    for r in d["results"]:
        sc = r["stagecache"]
        def cell(m, k):
            v = sc.get(m, {}).get(k)
            return f'{v["gbps"]:.1f}' if isinstance(v, dict) else "-"
        print(f'{r["pool"][:8]:8s} {r["layout"][:5]} {r["host_pattern"][:4]} {r["mib"]:5.0f} c {r["ceiling_gbps"]["d2h"]:.1f}/{r["ceiling_gbps"]["h2d"]:.1f}'
              f' l {r["loop_gbps"]["d2h"]:.1f}/{r["loop_gbps"]["h2d"]:.1f} A {cell("auto","d2h")}/{cell("auto","h2d")}'
              f' {sc.get("auto",{}).get("d2h",{}).get("path","")[7:]} D {cell("direct","d2h")}/{cell("direct","h2d")}'
              f' S {cell("staged","d2h")}/{cell("staged","h2d")} ok={int(r["bit_exact"])}')
PY
