#!/usr/bin/env bash
# Install the OpenCode CLI (npm package opencode-ai, pinned) into a cache directory and
# print the path of its binary.  Idempotent: a second run with the binary present only
# prints the path.
#
#   DS4D_OPENCODE_DIR   where to install (default <repo>/.cache/opencode)
#   OPENCODE_VERSION    the opencode-ai version (default: the one the OpenCode notes were measured with)
#
# Needs npm and the npm registry (or a warm npm cache).  All npm output goes to stderr;
# stdout carries only the binary path.
set -euo pipefail

VERSION=${OPENCODE_VERSION:-1.18.33}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
DIR=${DS4D_OPENCODE_DIR:-$REPO/.cache/opencode}
STAMP=$DIR/.installed-version

find_binary() {
    # opencode-ai's postinstall links the platform build that suits this CPU (AVX2 or
    # baseline) to the package's bin entry
    local binary=$DIR/node_modules/.bin/opencode
    [ -x "$binary" ] && echo "$binary"
}

if [ "$(cat "$STAMP" 2>/dev/null)" = "$VERSION" ] && find_binary >/dev/null; then
    find_binary
    exit 0
fi

command -v npm >/dev/null || { echo "install_opencode.sh: npm is not installed" >&2; exit 1; }
mkdir -p "$DIR"
rm -f "$STAMP"
npm install --prefix "$DIR" --no-audit --no-fund --loglevel=error "opencode-ai@$VERSION" >&2
binary=$(find_binary) || { echo "install_opencode.sh: no opencode binary under $DIR/node_modules" >&2; exit 1; }
"$binary" --version >&2
echo "$VERSION" >"$STAMP"
echo "$binary"
