#!/usr/bin/env bash
# Work longer than one device call (10 min): started in its own process session, it runs on between calls while
# the machine stays held (each call must come within the machine's warm time of the last one).
#   benchmarks/detached.sh start 'cmd; cmd; ...'   run the commands in order under setsid, OUT=$DETACHED (default
#                                                  /tmp/detached), output in $DETACHED/queue.log
#   benchmarks/detached.sh wait SECONDS            wait until the queue ends or SECONDS pass, then pack what it
#                                                  wrote so far into the call's $OUT/detached.tgz (one file: a
#                                                  call brings back at most 8)
set -u
DETACHED=${DETACHED:-/tmp/detached}
case "${1:-}" in
start)
    mkdir -p "$DETACHED/logs"; rm -f "$DETACHED/done"
    OUT="$DETACHED" PYTHONUNBUFFERED=1 setsid nohup bash -c "$2; echo \$? > '$DETACHED/done'" \
        >"$DETACHED/queue.log" 2>&1 < /dev/null &
    echo "started: pid $!" ;;
wait)
    # A fresh machine (the held one was released between calls) has no queue: say so at once, not after SECONDS.
    if [ ! -d "$DETACHED" ]; then echo "no queue in $DETACHED: this machine did not start one" >&2; exit 3; fi
    end=$((SECONDS + ${2:-500}))
    while [ ! -f "$DETACHED/done" ] && [ "$SECONDS" -lt "$end" ]; do sleep 10; done
    if [ -f "$DETACHED/done" ]; then echo "queue done: rc $(cat "$DETACHED/done")"; else echo "queue still running"; fi
    if [ -n "${OUT:-}" ] && [ "$OUT" != "$DETACHED" ]; then tar czf "$OUT/detached.tgz" -C "$DETACHED" .; fi
    tail -c 3000 "$DETACHED/queue.log" ;;
*)
    echo "usage: $0 start 'commands' | wait SECONDS" >&2; exit 2 ;;
esac
