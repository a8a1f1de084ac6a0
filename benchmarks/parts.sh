# Sourced by the device scripts (gpu_check.sh, planner_check.sh): each runs its work as parts, each part under its own
# time limit, so one that hangs leaves the others their time.
#
# part NAME LIMIT_S COMMAND...: run COMMAND under LIMIT_S seconds with its output in ${logs}/NAME.log, add a line
# "NAME rc=N Ss" to ${summary}, print the log's last lines, and set status=1 where COMMAND failed.
part() {
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    timeout "${limit}" "$@" >"${logs}/${name}.log" 2>&1
    rc=$?
    printf '%-28s rc=%-3s %4ss\n' "${name}" "${rc}" "$(($(date +%s) - start))" | tee -a "${summary}"
    tail -n 3 "${logs}/${name}.log"
    [ "${rc}" -eq 0 ] || status=1
}
