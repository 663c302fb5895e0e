#!/usr/bin/env bash
# Everything a lent GPU is for, in one device call (the `device` tool's `run`): the fast test suite on CUDA
# (issue 23 item 4), then benchmarks/gpu_suite.py within a time budget. Logs and tables go to $OUT.
#
# The GPU machine has torch, transformers, peft, accelerate and pytest-xdist, and no package registry. Before the
# call, on the CPU machine, fetch the other wheels the tests import into .whl/ (git ignores it; carry it):
#   pip download --no-deps --only-binary :all: --python-version 3.12 --platform manylinux2014_x86_64 \
#       -d .whl -r benchmarks/gpu_lease_wheels.txt
# then, for example, two calls of up to 10 minutes each (a lease has 15 minutes in all, the machine's start included):
#   run(command="COMMIT=<sha> bash benchmarks/gpu_lease.sh", carry=[".whl"], timeout_s=540)
#   run(command="COMMIT=<sha> PYTEST_S=0 SUITE='--prompts 32 --no-demo --budget-minutes 4' bash benchmarks/gpu_lease.sh", ...)
# (the first: 240 s of tests, then the batched paths' fraction of the limit at 32 and 200 prompts, 5 rounds; the
# second: every path at 32 prompts, the paper's loop included, as many rounds as 4 minutes take. The lease's 900 s
# also pay for the machine's start.)
#
# Settings (environment):
#   PYTEST_S  seconds for the tests (default 240; 0 skips them). At the cap pytest gets SIGINT, which makes it
#             print its summary; -v names every test's outcome as it ends, so a run cut short still names its failures.
#   WORKERS   pytest-xdist workers (default 8: 15 made a load of 19, where timing-bound tests fail for the load;
#             0: no xdist)
#   TESTS     what pytest runs (default tests)
#   SUITE     gpu_suite.py's arguments (default: the batched paths and the limit, 32 and 200 prompts, 5 rounds, no
#             demo, a 4-minute budget; the one-member-at-a-time paths take ~130 of a round's ~145 s at 32 prompts)
#   COMMIT    the commit measured, written into the table (the machine's copy of the tree has no .git)
#   PYTHON    the interpreter (default python3)
#   WHEELS    the folder of wheels to install first, if it has any (default .whl)
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to a folder for the logs and tables (the device tool sets it)}"
mkdir -p "$OUT" || exit 1
PYTHON=${PYTHON:-python3} PYTEST_S=${PYTEST_S:-240} WORKERS=${WORKERS:-8} TESTS=${TESTS:-tests}
T0=$SECONDS
WHEELS=${WHEELS:-.whl}
if compgen -G "$WHEELS/*.whl" > /dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/esft-site "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=/tmp/esft-site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
if command -v nvidia-smi > /dev/null; then nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader; fi
"$PYTHON" -c "import torch, transformers; print('torch', torch.__version__, '| CUDA', torch.cuda.is_available(), '| transformers', transformers.__version__)"

if [ "$PYTEST_S" != 0 ]; then
  echo "== tests: $TESTS, $WORKERS workers, at most $PYTEST_S s, load $(cut -d' ' -f1-3 /proc/loadavg)"
  workers=(-n "$WORKERS"); [ "$WORKERS" = 0 ] && workers=()
  # shellcheck disable=SC2086  # TESTS may name several paths
  COLUMNS=250 timeout -s INT "$PYTEST_S" "$PYTHON" -m pytest "${workers[@]}" -v -rfE -p no:cacheprovider $TESTS > "$OUT/pytest.log" 2>&1
  code=$?
  echo "pytest exit $code after $((SECONDS - T0)) s$([ $code = 124 ] && echo ": cut at the cap, the counts below are of the tests that ended")"
  echo "passed $(grep -c ' PASSED ' "$OUT/pytest.log"), failed $(grep -c ' FAILED ' "$OUT/pytest.log"), errors $(grep -c ' ERROR ' "$OUT/pytest.log"), skipped $(grep -c ' SKIPPED ' "$OUT/pytest.log")"
  grep -E ' (FAILED|ERROR) ' "$OUT/pytest.log" | sed -E 's/^\[gw[0-9]+\] \[ *[0-9]+%\] //' | sort -u
  grep -E '^(FAILED|ERROR) ' "$OUT/pytest.log" | cut -c1-300  # -rfE: each one's first error line
fi

echo "== gpu_suite after $((SECONDS - T0)) s, load $(cut -d' ' -f1-3 /proc/loadavg)"
# shellcheck disable=SC2086  # SUITE is a list of arguments
"$PYTHON" benchmarks/gpu_suite.py ${SUITE:---prompts 32,200 --paths default,preset,limit --rounds 5 --no-demo --budget-minutes 4} --out "$OUT/gpu_suite" \
  ${COMMIT:+--commit "$COMMIT"} > "$OUT/gpu_suite.log" 2>&1
code=$?
echo "gpu_suite exit $code after $((SECONDS - T0)) s"
[ $code = 0 ] || tail -20 "$OUT/gpu_suite.log"
cat "$OUT/gpu_suite/gpu_suite.md" 2>/dev/null
