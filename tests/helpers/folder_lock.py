"""Another process that holds a run folder's lock, as a second ``petfunc train`` into
that folder would meet it."""

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import petfunc


ROOT = Path(petfunc.__file__).resolve().parents[1]

HOLDER_COMMAND = "petfunc train holder.yaml -o run"

# takes the lock with petfunc's own code, says so, and holds it until killed
HOLDER = (
    "import sys, time\n"
    "from petfunc.trainer.lock import lock_folder\n"
    f"lock_folder(sys.argv[1], command={HOLDER_COMMAND!r})\n"
    "print('locked', flush=True)\n"
    "time.sleep(600)\n"
)


@contextlib.contextmanager
def holding_process(folder):
    """A process that holds the lock of ``folder`` while the block runs (then killed);
    yields its :class:`subprocess.Popen`."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    process = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(folder)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        line = process.stdout.readline()
        assert line == "locked\n", f"the lock holder did not start (exit status {process.poll()})"
        yield process
    finally:
        process.kill()
        process.wait()
        process.stdout.close()
