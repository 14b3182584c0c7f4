"""wowd's benchmarks: ``python -m bench [--quick]`` runs them all and writes
``bench/RESULTS.md``.

Modules, one per benchmark:

- :mod:`bench.ceiling`: the bare synchronous SQLite loop (the limit to approach).
- :mod:`bench.peer_aps3` / :mod:`bench.peer_aps4`: APScheduler 3 (and 4 when installed) on SQLite.
- :mod:`bench.wowd_timers`: ``wowd run`` processes on the SQLite file (burst, steady load).
- :mod:`bench.growth`: due-read cost as stored timers and aggregate types grow.
- :mod:`bench.sink`: ``ElasticsearchEventSink.write`` against ``async_bulk``.
- :mod:`bench.failover`: SIGKILL of a slot holder to the first fire by its standby.

Each measured system runs in its own process (``python -m bench.worker``), so that its peak RSS
and CPU seconds are its own.
"""
