# Sourced by scripts/test.sh, scripts/sanitize.sh and .ci/run: timed stages, and at the end one
# report of where the time went (each stage's wall time, CTest's and pytest's ten slowest
# entries). The outermost script owns the report; the scripts it calls add their stages to it.
#
#   stage NAME CMD [ARGS...]   runs CMD, records NAME's wall time and status, returns CMD's status
#   stage_log NAME             a file for a stage's output (ctest-*.log and pytest*.log are read
#                              by the report)
#   stage_report               prints the report (only in the script that owns it)
if [ -z "${CTXPAR_STAGES:-}" ]; then
  CTXPAR_REPORT_DIR=$(mktemp -d "${TMPDIR:-/tmp}/ctxpar-stages.XXXXXX")
  export CTXPAR_REPORT_DIR CTXPAR_STAGES="$CTXPAR_REPORT_DIR/stages.tsv"
  : > "$CTXPAR_STAGES"
  ctxpar_stages_owner=1
else
  ctxpar_stages_owner=0
fi

stage() {
  local name=$1 t0=$SECONDS rc=0
  shift
  echo "== stage $name" >&2
  "$@" || rc=$?
  printf '%s\t%s\t%s\n' "$name" "$((SECONDS - t0))" "$([ $rc -eq 0 ] && echo ok || echo "FAILED (exit $rc)")" \
    >> "$CTXPAR_STAGES"
  return $rc
}

stage_log() { echo "$CTXPAR_REPORT_DIR/$1.log"; }

stage_report() {
  [ "$ctxpar_stages_owner" -eq 1 ] || return 0
  echo
  echo "== where the time went ($(getconf _NPROCESSORS_ONLN) cores, $(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1))"
  awk -F'\t' 'BEGIN { printf "%-28s %8s  %s\n", "stage", "wall s", "status" }
    { printf "%-28s %8d  %s\n", $1, $2, $3; total += $2 }
    END { printf "%-28s %8d\n", "total", total }' "$CTXPAR_STAGES"
  local f
  for f in "$CTXPAR_REPORT_DIR"/ctest-*.log; do
    [ -f "$f" ] || continue
    echo
    echo "-- $(basename "$f" .log): the ten slowest entries (s)"
    sed -nE 's/^ *[0-9]+\/[0-9]+ Test +#[0-9]+: ([^ ]+) .* ([0-9.]+) sec$/\2 \1/p' "$f" |
      sort -rn | head -10 | awk '{ printf "%8.1f  %s\n", $1, $2 }'
  done
  for f in "$CTXPAR_REPORT_DIR"/pytest*.log; do
    [ -f "$f" ] || continue
    echo
    echo "-- $(basename "$f" .log): the ten slowest tests (s)"
    sed -n '/slowest .*durations/,/^=\{3,\}/p' "$f" | grep -E '^[0-9.]+s ' | head -10
  done
}
