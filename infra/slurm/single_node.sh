#!/bin/bash
# A one-node SLURM cluster on this Debian/Ubuntu machine, for trying `loomax launch --target
# slurm` (and for its integration test). Run as root; running it again is harmless: it
# installs only what is missing, keeps an existing munge key and config, and starts only
# the daemons that are not running.
#
#   sudo infra/slurm/single_node.sh          # then: sinfo; loomax launch --target slurm ...
#
# It installs munge, slurmctld, slurmd and the client commands (apt-get), writes
# /etc/slurm/slurm.conf for this host (its name, CPUs and memory from `slurmd -C`; one
# partition `debug`), creates a munge key, and starts munged, slurmctld and slurmd directly
# (no systemd needed, so it works in containers). There is no slurmdbd: finished jobs are
# written to the job-completion log /var/log/slurm/jobcomp.log (jobcomp/filetxt) and stay
# visible to `scontrol show job` for MinJobAge; `sacct` needs slurmdbd and reports nothing.
set -euo pipefail

if [ "$(id -u)" != 0 ]; then
  echo "single_node.sh: run as root (it installs packages and starts daemons)" >&2
  exit 1
fi

CONF=/etc/slurm/slurm.conf
LOGS=/var/log/slurm
STATE=/var/lib/slurm

missing=0
for bin in sbatch squeue scontrol slurmctld slurmd munged; do
  command -v "$bin" >/dev/null 2>&1 || missing=1
done
if [ "$missing" = 1 ]; then
  # exit code 3: SLURM cannot be installed here (no apt-get, no package mirror)
  command -v apt-get >/dev/null 2>&1 || { echo "single_node.sh: needs apt-get (Debian/Ubuntu)" >&2; exit 3; }
  packages=(munge slurmctld slurmd slurm-client)
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-get install -y -q --no-install-recommends "${packages[@]}"; then
    apt-get update -q || true
    apt-get install -y -q --no-install-recommends "${packages[@]}" || {
      echo "single_node.sh: apt-get could not install ${packages[*]}" >&2
      exit 3
    }
  fi
fi

# munge: one key shared by every daemon and client (one host here)
if [ ! -s /etc/munge/munge.key ]; then
  if command -v mungekey >/dev/null 2>&1; then
    mungekey --create --force
  else
    dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null
  fi
fi
chown munge:munge /etc/munge/munge.key
chmod 400 /etc/munge/munge.key
mkdir -p /run/munge /var/log/munge /var/lib/munge
chown munge:munge /run/munge /var/log/munge /var/lib/munge
if ! pgrep -x munged >/dev/null; then
  runuser -u munge -- /usr/sbin/munged
fi
for _ in $(seq 50); do munge -n >/dev/null 2>&1 && break; sleep 0.1; done

# slurm.conf: this host, as slurmd sees it
mkdir -p /etc/slurm "$LOGS" "$STATE/slurmctld" "$STATE/slurmd"
if [ ! -s "$CONF" ] || ! grep -q "written by loomax infra/slurm/single_node.sh" "$CONF"; then
  host=$(hostname -s)
  node=$(slurmd -C | head -n 1 | sed "s/^NodeName=[^ ]*/NodeName=$host/")
  cat > "$CONF" <<EOF
# written by loomax infra/slurm/single_node.sh: a one-node cluster on $host
ClusterName=loomax
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
StateSaveLocation=$STATE/slurmctld
SlurmdSpoolDir=$STATE/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd.log
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$LOGS/jobcomp.log
MinJobAge=3600
$node State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
fi

pgrep -x slurmctld >/dev/null || slurmctld
pgrep -x slurmd >/dev/null || slurmd

# ready when the node accepts jobs
for _ in $(seq 100); do
  state=$(sinfo -h -N -o %t 2>/dev/null | head -n 1 || true)
  case "$state" in
    idle|mix|alloc) echo "single_node.sh: SLURM is up ($(hostname -s): $state)"; exit 0 ;;
    down*|drain*) scontrol update nodename="$(hostname -s)" state=resume 2>/dev/null || true ;;
  esac
  sleep 0.2
done
echo "single_node.sh: slurmd did not come up; see $LOGS/slurmctld.log and $LOGS/slurmd.log" >&2
exit 1
