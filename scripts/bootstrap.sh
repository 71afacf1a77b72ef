#!/usr/bin/env bash
# Creates .venv from a Python >= 3.12 found on this machine and installs the project.
# Looks on PATH first, then among pyenv's installed versions (which pyenv may not select).
set -euo pipefail
cd "$(dirname "$0")/.."

ok_python() {  # prints the path if $1 runs and is >= 3.12
  "$1" -c 'import sys; raise SystemExit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1 && echo "$1"
}

find_python() {
  local c
  for c in python3.13 python3.12 python3 python; do
    if command -v "$c" >/dev/null 2>&1 && ok_python "$(command -v "$c")"; then return 0; fi
  done
  local root="${PYENV_ROOT:-$HOME/.pyenv}"
  if command -v pyenv >/dev/null 2>&1; then root="$(pyenv root)"; fi
  for c in $(ls -d "$root"/versions/3.1[2-9]*/bin/python3 "$root"/versions/3.[2-9][0-9]*/bin/python3 2>/dev/null | sort -rV); do
    if ok_python "$c"; then return 0; fi
  done
  return 1
}

stamp=.venv/.installed
if [ -x .venv/bin/python ] && [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ]; then
  exit 0
fi
if [ ! -x .venv/bin/python ]; then
  if ! py="$(find_python)"; then
    echo "error: no Python >= 3.12 found on PATH or among pyenv versions." >&2
    echo "Install Python 3.12 or newer (e.g. 'pyenv install 3.12') and retry." >&2
    exit 1
  fi
  echo "bootstrap: creating .venv with $py ($("$py" --version))"
  "$py" -m venv .venv
fi
echo "bootstrap: installing the project and its test/plot extras into .venv"
# The installed packages are byte-compiled, but by compileall on every core rather than by
# pip, which compiles file by file on one (about 19 s of a fresh set-up on two cores; 11 s
# this way). Where PYTHONDONTWRITEBYTECODE is set, as on the development machines, nothing
# writes .pyc files later, and every process (each test worker, server and experiment
# subprocess) would compile jax and the rest from source: `import jax` 4.1 s against 1.8 s.
.venv/bin/python -m pip install --quiet --no-compile --upgrade pip
.venv/bin/python -m pip install --quiet --no-compile -e ".[tests,plots]"
site="$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# A file that does not compile (a package's template or test data) is only left to be read
# from source, as pip leaves it: compileall's exit status is not an error here.
.venv/bin/python -m compileall -q -j 0 "$site" >/dev/null || true
touch "$stamp"
