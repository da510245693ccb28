#!/usr/bin/env bash
# The newest-deps job (`make test-newest`, run by .ci/run): meshkit on Python 3.12 with the
# newest release of every dependency, beside `make test`'s .venv (the machine's python3: on
# 3.11 jax stops at 0.10.2, the lower bound). It creates .venv-newest itself, installs
# '.[test]' with --upgrade (no pins but the project's own: torch==2.13.0), prints the
# versions it got and runs the tests marked `smoke` (train, resume, sharded == unsharded,
# Grain's batches, Hugging Face parity, a TPU compile, one served request): 12 tests in two
# processes, ~1-2 minutes on 2 cores after an install of 3-5 minutes (torch's CUDA build).
#
#   bash scripts/dev/ci_newest.sh           the install, then the smoke tests
#   bash scripts/dev/ci_newest.sh install   the install only
#   bash scripts/dev/ci_newest.sh smoke     the smoke tests only, in the venv an install made
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${NEWEST_VENV:-.venv-newest}
phase=${1:-all}
case "$phase" in
  all|install|smoke) ;;
  *) echo "error: scripts/dev/ci_newest.sh $phase: choose install, smoke or nothing (both)" >&2; exit 2 ;;
esac

# Pyenv's newest 3.12 where pyenv is installed, else a python3.12 on PATH.
python=""
if command -v pyenv >/dev/null 2>&1; then
  python=$(ls -d "$(pyenv root)"/versions/3.12.*/bin/python3.12 2>/dev/null | sort -V | tail -n 1 || true)
fi
if [[ -z "$python" ]] && command -v python3.12 >/dev/null 2>&1; then
  python=$(command -v python3.12)
fi
if [[ -z "$python" ]] || ! "$python" -c pass 2>/dev/null; then
  echo "error: the newest-deps job needs Python 3.12: install it with pyenv (pyenv install 3.12) or put python3.12 on PATH" >&2
  exit 1
fi

install() {
  start=$SECONDS
  if [[ ! -x "$VENV/bin/python" ]]; then
    "$python" -m venv "$VENV"
  fi
  "$VENV/bin/pip" install --quiet --upgrade pip
  # eager: an existing venv moves every dependency to its newest release too, not only meshkit.
  "$VENV/bin/pip" install --quiet --upgrade --upgrade-strategy eager -e '.[test]'
  echo "newest-deps: $("$VENV/bin/python" --version) venv ready in $((SECONDS - start)) s"

  "$VENV/bin/python" - <<'EOF'
from importlib import metadata
names = ["jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain", "tensorstore", "libtpu",
         "transformers", "torch"]
def version(name):
  try:
    return metadata.version(name)
  except metadata.PackageNotFoundError:
    return "not installed"
print("newest-deps: " + ", ".join(f"{name} {version(name)}" for name in names))
EOF
}

if [[ "$phase" != smoke ]]; then
  install
fi
if [[ "$phase" == install ]]; then
  exit 0
fi
if [[ ! -x "$VENV/bin/python" ]]; then
  echo "error: $VENV has no python: run bash scripts/dev/ci_newest.sh install first" >&2
  exit 1
fi
# Transparent huge pages for malloc, as the Makefile's commands have them (scripts/bench/bench_hugepages.py).
case ":${GLIBC_TUNABLES:-}" in
  *:glibc.malloc.hugetlb=*) ;;
  *) export GLIBC_TUNABLES="${GLIBC_TUNABLES:+$GLIBC_TUNABLES:}glibc.malloc.hugetlb=1" ;;
esac
start=$SECONDS
status=0
"$VENV/bin/python" -m pytest -n 2 -m smoke --durations=10 ${PYTEST_ARGS:-} || status=$?
echo "newest-deps: smoke tests took $((SECONDS - start)) s"
exit $status
