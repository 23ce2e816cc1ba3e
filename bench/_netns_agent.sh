#!/bin/sh
# mpirun's remote-start agent for bench/hosts.py --mpi (mpirun --mca plm_ssh_agent THIS): called
# as "THIS HOST COMMAND...", as ssh would be, it runs COMMAND in the network namespace of
# bench/_netns.py whose interface holds the address HOST, instead of over ssh, with the
# namespace's name as host name (Open MPI takes processes on hosts of one name for one node's).
while [ "${1#-}" != "$1" ]; do shift; done  # ssh-style options, if any
host=$1
shift
for ns in $(ip netns list | cut -d' ' -f1); do
  if ip -n "$ns" -4 -o addr show | grep -q "inet $host/"; then
    exec ip netns exec "$ns" unshare --uts sh -c "hostname $ns && $*"
  fi
done
echo "bench/_netns_agent.sh: no namespace has the address $host" >&2
exit 255
