"""What the launcher and the ranks both read: the rendezvous store (store.py: the server the
launcher or rank 0 runs, the client a rank's elastic code uses) and host-list notation
(hostlist.py: Slurm's node lists, read by ``bagua-run`` in an allocation and by ranks started by
srun). The ranks import this package, never ``bagua_hvd.runner`` (the launcher)."""
