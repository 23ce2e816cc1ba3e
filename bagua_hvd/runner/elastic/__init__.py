"""The launcher side of elastic training (Horovod's ``horovod.runner.elastic``): finding the hosts
a job may use (discovery.py: a user's discovery script or a fixed ``-H`` list), keeping track of
them between polls, with blacklisting of failed hosts and their cooldown, and turning the usable
hosts into rank assignments (hosts.py); the driver that starts, watches and resizes the workers
builds on these (driver.py)."""
