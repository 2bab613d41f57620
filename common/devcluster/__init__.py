"""kvferry on one machine, for development, tests and benchmarks: every part is a subprocess started the way a
pod starts it (`kvferry prefill|decode|router`), on free ports, logging to files.

- process.py: one supervised subprocess (`ManagedProcess`) and the wait for parts to answer /ready;
- redis_server.py: a throwaway in-memory redis-server for the prefix index;
- cluster.py: Redis, prefill and decode workers and a router as one `LocalCluster` (`start_local_cluster`);
- up.py: the `kvferry up` command (`make up`).
"""
