# The device checks' steps (sourced by benchmarks/gpu_check.sh and benchmarks/tpu_check.sh): each
# step runs under its own limit and never more than the budget has left, its output in OUT/NAME.log,
# its outcome (and OUT/NAME/bench.json's cells) recorded the moment it ends by
# benchmarks/gpu_report.py into OUT/$CHECK.json and OUT/$CHECK.md. Needs: PY, CHECK, budget, start, out.

# check_args MODE OUT "$@": the scripts' flags into mode (MODE, dry or prepare), budget and out
# (--out, else $OUT, else OUT); --help prints the calling script's header
check_args() {
    mode="$1" budget="" out="${OUT:-$2}"; shift 2
    while [ $# -gt 0 ]; do
        case "$1" in
            --dry) mode=dry ;;
            --prepare) mode=prepare ;;
            --budget) budget="$2"; shift ;;
            --out) out="$2"; shift ;;
            -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
            *) echo "$(basename "$0"): unknown argument '$1' (--dry, --prepare, --budget SECONDS," \
                    "--out DIR)" >&2
               exit 2 ;;
        esac
        shift
    done
}

# step NAME LIMIT WHAT -- COMMAND...: run COMMAND under min(LIMIT, what the budget has left), then
# record it; one with under 20 s left is recorded as skipped, saying so
step() {
    local name="$1" limit="$2" what="$3"; shift 4
    local left=$((budget - ($(date +%s) - start)))
    [ "$limit" -gt "$left" ] && limit=$left
    if [ "$limit" -lt 20 ]; then
        skip "$name" "$what" "out of time (${left}s of the ${budget}s budget left)"
        return
    fi
    echo "== $name (up to ${limit}s): $what"
    local t0 rc ms
    t0=$(date +%s%N)
    timeout -k 10 "$limit" "$@" > "$out/$name.log" 2>&1
    rc=$?
    ms=$((($(date +%s%N) - t0) / 1000000))
    tail -n 15 "$out/$name.log"
    "$PY" benchmarks/gpu_report.py record --check "$CHECK" --out "$out" --step "$name" --what "$what" \
        --rc "$rc" --seconds "$((ms / 1000)).$(printf %03d $((ms % 1000)))" --bench "$out/$name"
}

skip() {
    echo "== $1: skipped ($3)"
    "$PY" benchmarks/gpu_report.py record --check "$CHECK" --out "$out" --step "$1" --what "$2" --skip "$3"
}
