#!/usr/bin/env bash
# Record the speed history of the main line on the pinned machine, into
# asv_benchmarks/results/<machine>/ (committed).  Each commit is built and installed in
# asv's own virtualenv (asv.conf.json), so any commit can be recorded from any checkout.
#
#   asv_benchmarks/record_history.sh            # every commit of the history not yet recorded
#   asv_benchmarks/record_history.sh --list     # print the commits, record nothing
#   asv_benchmarks/record_history.sh COMMIT...  # these commits (recorded again if present)
#
# The history: every fifth first-parent commit since the benchmarks began (FIRST), the
# tip, and every first-parent commit that changes a kernel (attnnb/cpu, attnnb/cuda and
# the neutral modules they compile in).  Rerun it after merging a kernel change: commits
# already recorded are skipped.  Environment: ATTNNB_ASV_MACHINE (the machine name),
# ATTNNB_ASV_BRANCH (default main).
set -euo pipefail
cd "$(dirname "$0")/.."

MACHINE="${ATTNNB_ASV_MACHINE:-amd-epyc-zen4-2core}"
BRANCH="${ATTNNB_ASV_BRANCH:-main}"
FIRST=908f2b6  # the first commit with asv benchmarks
STEP=5
KERNEL_PATHS=(attnnb/cpu attnnb/cuda attnnb/_core/codes.py attnnb/_core/scalars.py attnnb/_core/selection.py)

# The recorded subset: fast float32 cpu `time_` benchmarks (their setup compiles or loads
# the kernels, so the timed calls are steady state), matched against asv's
# "name(param, ...)"; a benchmark of a function a commit lacks fails there (no point).
# Each commit compiles its kernels afresh, about 2 minutes for these on the shared
# 2-core machine; diff_attention's kernel alone took 110 s more and is left out.
BENCH=(
    -b "^bench_attention\.Attention\.time_attention\('cpu', \d+, 'float32'"
    -b "^bench_sparse\.SparseAttention\.time_sparse_attention\('cpu'"
    -b "^bench_sparse\.TopkAttention\.time_topk_attention\('cpu'"
    -b "^bench_tome\.TomeStep\.time_match_merge\('cpu'"
)
# One process, five samples per point, commits one after the other (asv's default of two
# interleaved rounds would install, and so compile, every commit twice).
MEASURE=(-a rounds=1 -a repeat=5 --no-interleave-rounds)

history_commits() {
    # Newest first: asv discovers the benchmarks with the first commit given.
    {
        git rev-parse "$BRANCH"
        git rev-list --first-parent --reverse "$FIRST^..$BRANCH" | awk -v s="$STEP" 'NR % s == 1'
    } | awk '!seen[$0]++' | sort_newest_first
}

kernel_commits() {
    git rev-list --first-parent "$FIRST^..$BRANCH" -- "${KERNEL_PATHS[@]}"
}

sort_newest_first() {
    # Order the given commits as the first-parent line does, newest first.
    local wanted
    wanted="$(cat)"
    git rev-list --first-parent "$FIRST^..$BRANCH" | grep -Fx -f <(printf '%s\n' "$wanted")
}

if [ "${1:-}" = "--list" ]; then
    { history_commits; kernel_commits; } | awk '!seen[$0]++' | sort_newest_first
    exit 0
fi
if ! grep -q "\"$MACHINE\"" "$HOME/.asv-machine.json" 2>/dev/null; then
    echo "record_history: describe this machine to asv first (once), e.g." >&2
    echo "  asv machine --yes --machine $MACHINE --cpu \"AMD EPYC family 25 model 17 ...\"" >&2
    exit 2
fi

# A busy core doubles a parallel kernel's time (docs/notes/performance.md, "The sparse point
# that doubled"): say so before recording.
load="$(cut -d' ' -f1 /proc/loadavg 2>/dev/null || echo 0)"
if awk -v l="$load" 'BEGIN { exit !(l > 0.5) }'; then
    echo "record_history: load average $load: other work is running, and the points will" \
         "show it; record on a quiet machine" >&2
fi

list="$(mktemp)"
trap 'rm -f "$list"' EXIT

run() {
    # asv exits 2 when a benchmark failed, which older commits do by design (a function
    # they lack): report it and go on, as asv has saved every point it measured.
    local status=0
    nice -n 10 asv run --machine "$MACHINE" --show-stderr "${MEASURE[@]}" "${BENCH[@]}" "$@" \
        || status=$?
    if [ "$status" -ne 0 ]; then
        echo "record_history: asv exited $status (some benchmarks failed; see above)" >&2
    fi
}

if [ "$#" -gt 0 ]; then
    git rev-parse "$@" > "$list"
    run "HASHFILE:$list"
    exit 0
fi
# The every-fifth line first, so that an interrupted recording still covers the whole span.
history_commits > "$list"
run --skip-existing-commits "HASHFILE:$list"
{ git rev-parse "$BRANCH"; kernel_commits; } | awk '!seen[$0]++' > "$list"
run --skip-existing-commits "HASHFILE:$list"
