"""What :mod:`tests.test_forkserver` runs as ``python -m tests.forkprobe ARGS``: prints its
working directory, ``PROBE`` from its environment and its arguments; ``raise``: an uncaught
exception; ``exit N``: ``sys.exit(N)``; a non-daemon thread and an ``atexit`` handler print
after the module returns, as an interpreter runs them at its end."""

import atexit
import os
import sys
import threading

if __name__ == "__main__":
    print(f"cwd={os.getcwd()} probe={os.environ.get('PROBE')} argv={sys.argv[1:]}")
    atexit.register(lambda: print("atexit ran", flush=True))
    threading.Thread(target=lambda: print("thread ran")).start()
    if sys.argv[1:2] == ["raise"]:
        raise RuntimeError("the probe raised")
    if sys.argv[1:2] == ["exit"]:
        sys.exit(int(sys.argv[2]))
