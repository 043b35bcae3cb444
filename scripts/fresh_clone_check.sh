#!/usr/bin/env bash
# What a newcomer sees: the README's two commands, verbatim, in a fresh clone and a fresh venv, with a clean
# environment (no OMP_NUM_THREADS, no project variables, the venv not activated for the tests: its python is
# called by path). Prints the machine and the time of each command, for the README's claims.
#
#   scripts/fresh_clone_check.sh            # install + demo + tests
#   scripts/fresh_clone_check.sh --no-tests # install + demo only
#   ATEN_CPU_CAPABILITY=default scripts/fresh_clone_check.sh  # the same under another float kernel set
#
# ATEN_CPU_CAPABILITY (default, avx2, avx512) is the one variable passed through: it picks PyTorch's CPU
# kernels, so the parity tolerances are checked under another machine's rounding.
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d /tmp/fresh_clone.XXXXXX)"
trap 'echo "left in $work"' EXIT

# The commands as the README's "Two commands" section gives them (its first two bash blocks).
mapfile -t commands < <(awk '/^## Two commands/{on=1} on && /^```bash/{grab=1; next} grab && /^```/{grab=0; n++; if (n==2) exit; next} grab' "$repo/README.md")
[ "${#commands[@]}" -ge 2 ] || { echo "could not read the two commands from README.md" >&2; exit 2; }
setup_and_demo="${commands[0]}"
tests="${commands[1]}"

echo "machine: $(nproc) CPUs ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)), $(free -g | awk '/Mem:/{print $2}') GiB," \
     "$(python3 --version), $(uname -sr), ATEN_CPU_CAPABILITY=${ATEN_CPU_CAPABILITY:-unset}"
echo "clone:   $work/lightning-3d (from $repo at $(git -C "$repo" rev-parse --short HEAD))"
git clone -q "$repo" "$work/lightning-3d"
python3 -m venv "$work/venv"

run() {  # label, command: run in the clone with a clean environment; print its wall time
  local label="$1" command="$2" start end status
  start=$(date +%s)
  set +e
  (cd "$work/lightning-3d" && env -i HOME="$HOME" LANG=C.UTF-8 TERM=dumb PATH="$3:/usr/local/bin:/usr/bin:/bin" \
     ${ATEN_CPU_CAPABILITY:+ATEN_CPU_CAPABILITY="$ATEN_CPU_CAPABILITY"} bash -c "$command") > "$work/$label.log" 2>&1
  status=$?
  set -e
  end=$(date +%s)
  printf '%-8s %5d s  exit %d  (%s; log: %s)\n' "$label:" $((end - start)) "$status" "$command" "$work/$label.log"
  tail -n 3 "$work/$label.log" | sed 's/^/          /'
  return $status
}

# The first command installs and then trains: time the two halves apart (split at the last '&&').
install="${setup_and_demo% && *}"
demo="${setup_and_demo##* && }"
run install "$install" "$work/venv/bin"
run demo "$demo" "$work/venv/bin"
if [ "${1:-}" != "--no-tests" ]; then
  # Not activated: the venv's python by path, as issue 18 found a newcomer does.
  run tests "${tests/python /$work/venv/bin/python }" "/usr/bin"
fi
