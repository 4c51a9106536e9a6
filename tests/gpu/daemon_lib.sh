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
