#!/usr/bin/env bash
# A real single-node SLURM cluster on loopback, for tests: munged, slurmctld and slurmd from
# Debian's munge and slurm-wlm, run as root with all state in one folder.
#   scripts/slurm-local.sh start    # prints the SLURM_CONF to export
#   scripts/slurm-local.sh stop
# DTRAIN_SLURM_DIR picks the folder (default /tmp/dtrain-slurm).
set -euo pipefail
STATE=${DTRAIN_SLURM_DIR:-/tmp/dtrain-slurm}
CONF=$STATE/slurm.conf

stop() {
  for pidfile in "$STATE/slurmd.pid" "$STATE/slurmctld.pid" "$STATE/munge/munged.pid"; do
    [ -f "$pidfile" ] && kill "$(cat "$pidfile")" 2>/dev/null || true
  done
  sleep 1
  for pidfile in "$STATE/slurmd.pid" "$STATE/slurmctld.pid" "$STATE/munge/munged.pid"; do
    [ -f "$pidfile" ] && kill -9 "$(cat "$pidfile")" 2>/dev/null || true
    rm -f "$pidfile"
  done
}

start() {
  command -v slurmctld >/dev/null && command -v munged >/dev/null ||
    { echo "slurm-local: install slurm-wlm and munge (scripts/setup.sh --test)" >&2; exit 77; }
  [ "$(id -u)" -eq 0 ] || { echo "slurm-local: must run as root" >&2; exit 77; }
  # slurmd 22.05 will not start without the cgroup file system (a chroot without /sys).
  [ -e /sys/fs/cgroup/cgroup.controllers ] || [ -d /sys/fs/cgroup/cpu ] ||
    { echo "slurm-local: no cgroup file system at /sys/fs/cgroup, which slurmd needs" >&2; exit 77; }
  stop
  rm -rf "$STATE"
  mkdir -p "$STATE/munge" "$STATE/ctld" "$STATE/spool"
  chmod 700 "$STATE/munge"
  head -c 1024 /dev/urandom > "$STATE/munge/munge.key"
  chmod 400 "$STATE/munge/munge.key"
  munged --force --key-file "$STATE/munge/munge.key" --socket "$STATE/munge/munge.socket" \
    --pid-file "$STATE/munge/munged.pid" --log-file "$STATE/munge/munged.log" \
    --seed-file "$STATE/munge/munged.seed"
  local cpus
  cpus=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # (nproc follows them: the test suite sets 1)
  cat > "$CONF" <<CONF
ClusterName=dtrain-local
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=16817
SlurmdPort=16818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$STATE/munge/munge.socket
CredType=cred/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=local Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF
  export SLURM_CONF=$CONF
  slurmctld -f "$CONF"
  slurmd -f "$CONF" -N localhost
  for _ in $(seq 1 60); do
    if sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
      echo "SLURM_CONF=$CONF"
      return 0
    fi
    scontrol update nodename=localhost state=resume >/dev/null 2>&1 || true
    sleep 0.5
  done
  echo "slurm-local: the node did not come up; logs in $STATE" >&2
  tail -5 "$STATE/slurmctld.log" "$STATE/slurmd.log" >&2 || true
  exit 1
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  *) echo "usage: scripts/slurm-local.sh start|stop" >&2; exit 2 ;;
esac
