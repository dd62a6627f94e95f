#!/usr/bin/env bash
# Create .venv with a Python >= 3.12 (emerging-optimizers needs it) and install optzoo into it.
# Idempotent: reinstalls only when pyproject.toml changed since the last install.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${OPTZOO_VENV:-.venv}

is_312() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; }

find_python() {
    local candidate
    for candidate in "${PYTHON:-}" python3.12 python3.13 python3.14 python3; do
        [ -n "$candidate" ] || continue
        if command -v "$candidate" >/dev/null 2>&1 && is_312 "$candidate"; then
            command -v "$candidate"; return 0
        fi
    done
    # pyenv installs versions that its shims hide unless selected: ask it directly.
    if command -v pyenv >/dev/null 2>&1; then
        local version
        for version in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.(1[2-9])(\.[0-9]+)?$' | sort -V); do
            candidate="$(pyenv root)/versions/$version/bin/python"
            if is_312 "$candidate"; then echo "$candidate"; return 0; fi
        done
    fi
    return 1
}

if [ ! -x "$VENV/bin/python" ] || ! is_312 "$VENV/bin/python"; then
    if ! PY=$(find_python); then
        echo "optzoo: no Python >= 3.12 found (tried \$PYTHON, python3.12, python3.13, python3.14, python3, pyenv);" \
             "install one or set PYTHON=/path/to/python3.12" >&2
        exit 1
    fi
    echo "optzoo: creating $VENV with $PY" >&2
    rm -rf "$VENV"
    "$PY" -m venv "$VENV"
fi

STAMP="$VENV/.optzoo-installed"
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
    echo "optzoo: installing optzoo[test] into $VENV (first run downloads torch, a few minutes)" >&2
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    "$VENV/bin/python" -m pip install --quiet -e ".[test]"
    touch "$STAMP"
fi
