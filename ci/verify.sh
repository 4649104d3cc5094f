#!/usr/bin/env bash
# Verification layers beyond the unit/integration tests (called by .ci/run):
#
#   loom  - model checks of the concurrency protocols (tests/loom.rs, and the lib's
#           blocks::index::loom_tests), every interleaving of 2-3 threads up to a preemption
#           bound; retired objects are poisoned, not freed.
#   miri  - undefined-behaviour check (Tree Borrows) of the lib unit tests and a selection of
#           integration tests (sizes shrink under cfg!(miri)).
#   asan  - AddressSanitizer + LeakSanitizer over the multi-threaded stress tests, the block
#           index suite (tests/blocks.rs) and the tear-down tests (tests/drop.rs), with
#           crossbeam's small bags so reclamation runs.
#   fuzz  - each cargo-fuzz target for $FUZZ_SECONDS (default 30) seconds:
#           tree_ops (PrefixTree vs the reference model), block_index_ops (BlockIndex vs a
#           HashMap model), kv_event_decode (vLLM msgpack decoder), snapshot_restore
#           (PrefixTree::read_snapshot and BlockIndex::read_snapshot on arbitrary bytes).
#
# Usage: ci/verify.sh [loom] [miri] [asan] [fuzz]     (no argument: all four)
#
# Every stage runs even if an earlier one failed; the script exits non-zero if any failed.
# Stage names and elapsed seconds are printed. Two or more stages run in two lanes at once
# (miri's single-threaded half alone; loom, asan, miri's multi-threaded half, then fuzz), since
# each lane is mostly one busy core (an interpreter, a model checker, a fuzzer): on 2 cores
# that halves the wall time. The lanes are balanced by measured time (see the lanes below).
# Each lane's output is printed when both are done; VERIFY_LANES=1 runs the stages one after
# another instead.
#
# Environment:
#   VERIFY_TARGET_BASE     where the per-stage target dirs live (default: target/verify), as
#                          target-loom, target-miri, target-asan, target-fuzz. None of them is
#                          the default target dir, so the normal build cache is untouched.
#                          On the shared dev machine: VERIFY_TARGET_BASE=/work.
#   LOOM_MAX_PREEMPTIONS   loom preemption bound (default 2: the per-node-lock models take
#                          minutes each at 3; run LOOM_MAX_PREEMPTIONS=3 locally for depth).
#   FUZZ_SECONDS           seconds per fuzz target (default 30).
#   VERIFY_LANES           1: run the stages one after another (default 2, see above).
#
# Long fuzzing runs (one hour per target), from the repository root:
#   cd fuzz
#   cargo +nightly fuzz run tree_ops        -- -max_total_time=3600
#   cargo +nightly fuzz run block_index_ops -- -max_total_time=3600
#   cargo +nightly fuzz run kv_event_decode -- -max_total_time=3600
#   cargo +nightly fuzz run snapshot_restore -- -max_total_time=3600
# (or FUZZ_SECONDS=3600 ci/verify.sh fuzz). New interesting inputs then land in
# fuzz/corpus/<target>/; a crash is saved under fuzz/artifacts/<target>/ and replays with
#   cargo +nightly fuzz run <target> fuzz/artifacts/<target>/<file>
# Here the runs write new inputs to a scratch corpus and only read the committed seeds.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
export CARGO_TERM_COLOR=never
BASE="${VERIFY_TARGET_BASE:-$ROOT/target/verify}"
FUZZ_SECONDS="${FUZZ_SECONDS:-30}"
HOST=x86_64-unknown-linux-gnu

elapsed() { echo $(($(date +%s) - $1)); }

ensure_nightly() {
    if ! rustup run nightly rustc --version >/dev/null 2>&1; then
        rustup toolchain install nightly --profile minimal
    fi
}

# --------------------------------------------------------------------------------------------
stage_loom() {
    export CARGO_TARGET_DIR="$BASE/target-loom"
    export RUSTFLAGS="--cfg loom --cfg crossbeam_loom"
    export LOOM_MAX_PREEMPTIONS="${LOOM_MAX_PREEMPTIONS:-2}"
    # No debug info: the release build of the crate and all its dev-dependencies is most of
    # this stage's time, and line tables add about a tenth (a failing model still names its
    # assertion).
    export CARGO_PROFILE_RELEASE_DEBUG="${CARGO_PROFILE_RELEASE_DEBUG:-0}"
    cargo test --release --test loom --no-run
    # One process per model: a failing model aborts its process (loom panics again while
    # unwinding), so running them separately reports every failure and each model's time.
    local failed=() t out rc
    for t in $(cargo test -q --release --test loom -- --list 2>/dev/null | sed -n 's/: test$//p'); do
        set +e
        out=$(cargo test -q --release --test loom -- --exact --nocapture "$t" 2>&1)
        rc=$?
        set -e
        # The model's summary line, or the failure without the backtraces.
        printf '%s\n' "$out" |
            grep -vE '^ +[0-9]+: |^ +at |^stack backtrace|^note: |^\s*$|^running|^test result|^\.$' ||
            true
        [ "$rc" -eq 0 ] || failed+=("$t")
    done
    # The lib's own models (the block index's reader protocol, blocks::index::loom_tests). The
    # lib's other unit tests, and every integration test but tests/loom.rs, are compiled out
    # under loom (`cfg(not(loom))`), so this runs just those models.
    if ! cargo test -q --release --lib; then
        failed+=("lib: blocks::index::loom_tests")
    fi
    if [ "${#failed[@]}" -ne 0 ]; then
        echo "loom: FAILED models: ${failed[*]}"
        return 1
    fi
}

# --------------------------------------------------------------------------------------------
# Selected tests. Lib unit tests: all except those too slow when interpreted (filtered by
# name, never edited). Integration tests: the semantics suite, the scripted model sequence,
# the multi-threaded stress tests (their sizes shrink under cfg!(miri)), the drop tests and
# the block index's concurrent writers.
MIRI_LIB_SKIP=(
    # Allocates the slab's last chunk: 8 GiB of address space (pages untouched natively, real
    # memory when interpreted).
    tree::tests::running_out_of_node_ids_is_an_error_and_changes_no_node
    # Over a minute each when interpreted (measured 60-150 s): large randomized or
    # table-filling loops, covered natively by `cargo test` and by the fuzz targets.
    blocks::approx::tests::queue_stays_bounded_under_refreshes
    blocks::index::tests::grows_purges_and_shrinks
    blocks::map::tests::grows_and_shrinks
    events::msgpack::tests::depth_limit
    events::msgpack::tests::garbage_never_panics
    # Safe code only (W1's generator against its recipe: 400 k pseudo-random chars), 385 s
    # when interpreted.
    workload::tests::w1_follows_the_recipe_of_workloads_md
)
# Miri's two halves: the single-threaded API (lib unit tests, the semantics suite, the scripted
# model sequence) and the multi-threaded tests. `miri` runs both; with two lanes, the second
# half runs in the other lane (both use one target dir; cargo's lock covers only the builds).
miri_env() {
    ensure_nightly
    rustup component add --toolchain nightly miri rust-src
    export CARGO_TARGET_DIR="$BASE/target-miri"
    # Tree Borrows: crossbeam-epoch 0.9.21's pin() is UB under Stacked Borrows (fixed
    # upstream, unreleased). The global collector's thread-local handle is never freed.
    export MIRIFLAGS="-Zmiri-tree-borrows -Zmiri-ignore-leaks"
    cargo +nightly miri setup
}
stage_miri_api() {
    miri_env
    local skip=()
    local s
    for s in "${MIRI_LIB_SKIP[@]}"; do skip+=(--skip "$s"); done
    # Every step runs (miri stops a test binary at its first UB); the stage fails if any did.
    local rc=0
    cargo +nightly miri test --lib -- "${skip[@]}" || rc=1
    cargo +nightly miri test --test semantics || rc=1
    cargo +nightly miri test --test model -- scripted_sequence_matches_model || rc=1
    return "$rc"
}
stage_miri_threads() {
    miri_env
    local rc=0
    cargo +nightly miri test --test stress -- mixed_operations_keep_invariants \
        lock_free_inserts_race_with_structural_writers \
        wide_node_children_added_in_place_race_readers || rc=1
    cargo +nightly miri test --test drop -- pending_garbage || rc=1
    cargo +nightly miri test --test concurrent_model || rc=1
    cargo +nightly miri test --test blocks -- concurrent_writers_and_readers_match_sequential_replay \
        || rc=1
    return "$rc"
}
stage_miri() {
    local rc=0
    stage_miri_api || rc=1
    stage_miri_threads || rc=1
    return "$rc"
}

# --------------------------------------------------------------------------------------------
stage_asan() {
    ensure_nightly
    export CARGO_TARGET_DIR="$BASE/target-asan"
    # crossbeam_sanitize: crossbeam-epoch uses bags of 4 and collects eagerly, so retired
    # nodes are really freed while the tests run (use-after-free becomes visible).
    export RUSTFLAGS="-Zsanitizer=address --cfg crossbeam_sanitize"
    export RUSTDOCFLAGS="$RUSTFLAGS"
    export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:detect_stack_use_after_return=1"
    export LSAN_OPTIONS="report_objects=1"
    cargo +nightly test --target "$HOST" --test stress --test drop --test concurrent_model \
        --test churn --test blocks --test kv_race
}

# --------------------------------------------------------------------------------------------
stage_fuzz() {
    ensure_nightly
    if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
        cargo install cargo-fuzz --locked || cargo install cargo-fuzz
    fi
    export CARGO_TARGET_DIR="$BASE/target-fuzz"
    local scratch t t0 rc=0 status
    scratch=$(mktemp -d)
    cd fuzz
    for t in tree_ops block_index_ops kv_event_decode snapshot_restore; do
        t0=$(date +%s)
        echo "-- fuzz $t (${FUZZ_SECONDS}s)"
        mkdir -p "$scratch/$t" "corpus/$t"
        # The first corpus dir receives new inputs (scratch); the committed seeds are only read.
        set +e
        cargo +nightly fuzz run "$t" "$scratch/$t" "corpus/$t" -- \
            -max_total_time="$FUZZ_SECONDS" -print_final_stats=1 >"$scratch/$t.log" 2>&1
        status=$?
        set -e
        grep -E '^#[0-9]+ +DONE|^Done|^stat::(number_of_executed_units|peak_rss_mb)|ERROR|panicked|SUMMARY|Test unit written|^thread|^error' \
            "$scratch/$t.log" | grep -v '^thread.*spawned' || true
        if [ "$status" -ne 0 ]; then
            tail -n 60 "$scratch/$t.log"
            rc=1
        fi
        echo "-- fuzz $t: exit $status in $(elapsed "$t0")s"
    done
    rm -rf "$scratch"
    return "$rc"
}

# --------------------------------------------------------------------------------------------
# The nightly toolchain, miri and cargo-fuzz, installed once before the lanes start (two
# rustup or cargo-install runs at once could trip over each other).
# .ci/run starts this in the background while the tests run (mostly downloads), and this script
# runs it again (then a no-op) before the lanes.
stage_nightly() {
    ensure_nightly
    rustup component add --toolchain nightly miri rust-src
    # Miri's sysroot (a build of the standard library), once.
    cargo +nightly miri setup
    if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
        cargo install cargo-fuzz --locked || cargo install cargo-fuzz
    fi
}

# --------------------------------------------------------------------------------------------
if [ "${1:-}" = "--stage" ]; then
    "stage_$2"
    exit $?
fi

# --------------------------------------------------------------------------------------------
stages=("$@")
[ ${#stages[@]} -ne 0 ] || stages=(loom miri asan fuzz)
start=$(date +%s)

# Runs one stage in a child process (so that `set -e` applies inside it); prints its name and
# time; returns its status.
run_stage() {
    local s=$1 t0
    t0=$(date +%s)
    echo "== verify: $s (at $(elapsed "$start")s)"
    if "$0" --stage "$s"; then
        echo "== verify: $s ok in $(elapsed "$t0")s"
    else
        echo "== verify: $s FAILED after $(elapsed "$t0")s"
        return 1
    fi
}

failed=()
if [ "${VERIFY_LANES:-2}" -ge 2 ] && [ ${#stages[@]} -gt 1 ]; then
    # Lane a: miri's API half. Lane b: loom, asan, miri's threads half, fuzz (in the order
    # given, miri's half before fuzz). Measured on a quiet clean clone, 2 cores (2026-12-07):
    # lane a (miri's lib tests, the semantics suite and the model sequence, with their build)
    # 587 s; lane b: loom 206 s, asan 82 s, miri's threaded tests 112 s, fuzz 189 s (589 s).
    lane_a=() lane_b=() split=""
    case " ${stages[*]} " in *" miri "*) split=1 ;; esac
    for s in "${stages[@]}"; do
        case "$s" in
            miri) lane_a+=(miri_api) ;;
            fuzz)
                [ -z "$split" ] || lane_b+=(miri_threads)
                split=""
                lane_b+=("$s")
                ;;
            *) lane_b+=("$s") ;;
        esac
    done
    [ -z "$split" ] || lane_b+=(miri_threads)
    case " ${stages[*]} " in
        *" miri "* | *" asan "* | *" fuzz "*) run_stage nightly || failed+=(nightly) ;;
    esac
    lanes=$(mktemp -d)
    run_lane() {
        local s
        for s in "$@"; do
            run_stage "$s" || echo "$s" >>"$lanes/failed"
        done
    }
    echo "== verify: lanes [${lane_a[*]}] and [${lane_b[*]}] at once (output follows when both end)"
    run_lane "${lane_a[@]}" >"$lanes/a.log" 2>&1 &
    pid_a=$!
    run_lane "${lane_b[@]}" >"$lanes/b.log" 2>&1 &
    pid_b=$!
    wait "$pid_a" "$pid_b" || true
    cat "$lanes/a.log" "$lanes/b.log"
    if [ -f "$lanes/failed" ]; then
        while read -r s; do failed+=("$s"); done <"$lanes/failed"
    fi
    rm -rf "$lanes"
else
    for s in "${stages[@]}"; do
        run_stage "$s" || failed+=("$s")
    done
fi
echo "== verify: total $(elapsed "$start")s"
if [ ${#failed[@]} -ne 0 ]; then
    echo "== verify: FAILED stages: ${failed[*]}"
    exit 1
fi
