#!/usr/bin/env bash
# The prepared GPU check (benchmarks/gpu_check.py says what each part runs and writes).
#   bash benchmarks/gpu_check.sh              # part 1, about 7.5 minutes on an H200
#   bash benchmarks/gpu_check.sh --part 2     # the rest, a second call
#   bash benchmarks/gpu_check.sh --dry-run    # the same steps on the CPU, tiny (make test runs it)
# Results go to $OUT (else build/gpu-check); GPU_WHEELS names another wheels folder. The GPU machine reaches no package registry: the
# wheels it lacks (entmax, the test plugins, AdaSplash) come from `make gpu-wheels`, run where
# the registries are reachable, in benchmarks/wheels, which travels with the checkout. They are
# installed here into a folder of their own, with no index and no dependencies, and put first
# on the path; nothing here reaches a network.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=${GPU_WHEELS:-benchmarks/wheels}
SITE=$(mktemp -d "${TMPDIR:-/tmp}/sharpattn-site.XXXXXX")
trap 'rm -rf "$SITE"' EXIT
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
    --target "$SITE" "$WHEELS"/*.whl \
    || echo "gpu_check: the wheels in $WHEELS did not install; going on without them"
fi
export PYTHONPATH="$SITE:$PWD/src:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
"$PY" benchmarks/gpu_check.py "$@"
exit $?
