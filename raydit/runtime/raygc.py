"""Ray's requests to run Python's garbage collector, switched off on the clusters raydit starts.

A raylet asks every process on its node, the driver included, to run `gc.collect()` (the
LocalGC RPC, src/ray/raylet/node_manager.cc `TryLocalGC` / `DoLocalGC`): when its object store
is more than `plasma_store_usage_trigger_gc_threshold` (0.7; `high_plasma_storage_usage` in
Ray's master) full, at most every `global_gc_min_interval_s` / `local_gc_min_interval_s` (30 s
/ 10 s), and every `local_gc_interval_s` (10 to 90 minutes by Ray version) regardless. In the
driver the request runs Ray's Cython callback `gc_collect` (python/ray/_raylet.pyx) on a core-
worker thread; with the default `start_python_gc_manager_thread` it calls
`global_worker.core_worker.trigger_gc()`, which wakes the driver's PythonGCThread.
`ray.shutdown()` stops that thread and sets it to None (`CoreWorker.shutdown_driver`) before
the core worker stops serving RPCs, so a request arriving in between raises AttributeError
('NoneType' object has no attribute 'trigger_gc') inside the callback. Seen here (Python 3.11,
Ray 2.60) in a bounded loop of ray.init/ray.shutdown with the raylet's requests made frequent
(bench/ray_gc_race.py: 3 errors in 2 of 6 shutdowns); Python 3.11 drops the error silently. On
Python 3.12 Cython's error path in that callback goes through PyTraceBack_Here ->
PyException_GetTraceback, the frame of the SIGSEGV seen on the H200 (issue 39: HandleLocalGC ->
gc_collect -> PyException_GetTraceback); there, inferred from the bench's code, the two results
it held (81 x 480 x 832 uint8 frames, 97 MB each, zero-copy views) kept the Engine's 256 MiB
store over 0.7 up to its ray.shutdown(), so the raylet kept asking.

raydit's own processes need none of these requests: Python's collector still runs in each of
them on its own schedule; the requests only hurry collection of object references held in
reference cycles. An explicit `ray._private.internal_api.global_gc()` still works.
"""

from __future__ import annotations

# _system_config for a cluster raydit starts itself (ray.init(address="local", ...)). A cluster
# the user started keeps its own settings (Ray takes _system_config only when it starts one).
RAYLET_GC_REQUESTS_OFF = {
    # Never "every N seconds": 10**9 s (the raylet multiplies it by 1e9 into an int64 of ns).
    "local_gc_interval_s": 10**9,
    # Never "the store is full": a used fraction of the store far above any it reaches.
    "plasma_store_usage_trigger_gc_threshold": 100.0,
}
