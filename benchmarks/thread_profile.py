"""Run a Python module with cProfile in every thread, for servers that serve in threads.

``python benchmarks/thread_profile.py OUT.prof -m module args...``: each thread the
module starts (and the main thread) is profiled, in CPU time of that thread
(``time.thread_time``); at exit their statistics are merged
into OUT.prof (read it with ``pstats``). cProfile alone sees the main thread only.
"""
import atexit
import cProfile
import os
import pstats
import runpy
import sys
import threading
import time

profiles = []
_run = threading.Thread.run


def _profiled_run(self):
    prof = cProfile.Profile(time.thread_time)
    prof.enable()
    try:
        _run(self)
    finally:
        prof.disable()
        profiles.append(prof)


def _dump(path, main):
    main.disable()
    stats = pstats.Stats(main)
    for prof in list(profiles):
        stats.add(prof)
    stats.dump_stats(path)


if __name__ == "__main__":
    if len(sys.argv) < 4 or sys.argv[2] != "-m":
        raise SystemExit("usage: thread_profile.py OUT.prof -m module [args...]")
    out, module = sys.argv[1], sys.argv[3]
    sys.argv = [module] + sys.argv[4:]
    threading.Thread.run = _profiled_run
    main = cProfile.Profile(time.thread_time)
    atexit.register(_dump, out, main)
    _exit = os._exit

    def _dump_then_exit(status):  # distemb.server leaves by os._exit: no atexit there
        _dump(out, main)
        _exit(status)

    os._exit = _dump_then_exit
    main.enable()
    runpy.run_module(module, run_name="__main__", alter_sys=True)
