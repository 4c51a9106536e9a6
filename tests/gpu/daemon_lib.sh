# Sourced by the scripts that start a daemon on a device machine: environment and readiness.

ds4d_setup() {  # OUT (logs, created), PY; installs the carried wheels from .whl/ unless INSTALL=0
  OUT=${OUT:-out}; mkdir -p "$OUT"
  PY=${PY:-python3}
  if [ -d .whl ] && [ "${INSTALL:-1}" = 1 ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      || return 1
    export PYTHONPATH=/tmp/site:.
  else
    export PYTHONPATH=${PYTHONPATH:-.}
  fi
  export PYTHONUNBUFFERED=1
}

ds4d_wait_ready() {  # PORT PID [LIMIT_S]: returns once /health says ok; fails if PID exits or time runs out
  $PY - "$1" "$2" "${3:-400}" <<'PYEOF'
import json, os, sys, time, urllib.request
port, pid, limit = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
deadline = time.time() + limit
while time.time() < deadline:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit("the daemon exited before it was ready")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            if json.loads(r.read()).get("status") == "ok":
                sys.exit(0)
    except OSError:
        pass
    time.sleep(1)
sys.exit(f"daemon not ready after {limit:g} s")
PYEOF
}

ds4d_random_config() {  # DIR FAMILY [LAYERS] [EXPERTS] [WIDTHS]: a config.json for `ds4d serve --load-format random`
  # FAMILY deepseek_v4: V4-Flash widths (WIDTHS=tiny: small ones), LAYERS its compress ratios (default 0,0,4,128);
  # deepseek_v41: V4.1-Flash widths, LAYERS its layer modes (default 0,0,2,2,1,1), EXPERTS routed experts (384)
  mkdir -p "$1"
  $PY - "$1" "$2" "${3:-}" "${4:-384}" "${5:-flash}" <<'PYEOF'
import json, sys
directory, family, layers, experts, widths = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
if family == "deepseek_v41":
    from ds4d.bench.dsv41 import bench_config
    config, _ = bench_config([int(x) for x in (layers or "0,0,2,2,1,1").split(",")], widths == "tiny", experts, 262_144)
else:
    from ds4d.bench.random_v4 import base_config
    ratios = [int(x) for x in (layers or "0,0,4,128").split(",")]
    config = {**base_config(widths == "tiny"), "num_hidden_layers": len(ratios), "compress_ratios": ratios}
open(directory + "/config.json", "w").write(json.dumps(config))
PYEOF
}
