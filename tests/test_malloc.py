"""distemb.malloc: a step's large buffers are reused, not faulted in again every step.

The oracle is the kernel's count of minor page faults of a fresh process that allocates
and frees two 2 MiB arrays per iteration (the looked-up rows and their gradients of a
4,096 x 128 step): with glibc's adaptive thresholds each iteration faults both buffers in
again; tuned, none.
"""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHURN = """
import resource, sys
import numpy as np
if sys.argv[1] == "1":
    import distemb, distemb.malloc
    print("tuned", distemb.malloc.tune())
def churn(n):
    for _ in range(n):
        a = np.ones(1 << 19, np.float32)
        b = np.ones(1 << 19, np.float32)
        del a, b
churn(10)
r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
churn(100)
print("faults", resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0)
"""


def run_churn(import_distemb, **env):
    out = subprocess.run(
        [sys.executable, "-c", CHURN, "1" if import_distemb else "0"], check=True,
        capture_output=True, text=True, timeout=120,
        env=dict(os.environ, PYTHONPATH=ROOT, **env)).stdout.split("\n")
    words = dict(line.split() for line in out if line)
    return words.get("tuned"), int(words["faults"])


def glibc():
    try:
        return os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
    except (AttributeError, ValueError, OSError):
        return False


pytestmark = pytest.mark.skipif(not glibc(), reason="glibc malloc only")


def test_untuned_process_faults_the_buffers_in_every_iteration():
    # the behaviour distemb.malloc removes, shown on this machine's glibc
    _, faults = run_churn(False)
    assert faults >= 100 * 512  # at least one 2 MiB buffer (512 pages) per iteration


def test_importing_distemb_reuses_the_buffers():
    tuned, faults = run_churn(True)
    assert tuned == "True"
    assert faults < 100  # against >= 51,200 untuned


@pytest.mark.parametrize("env", [{"DISTEMB_MALLOC": "default"},
                                 {"MALLOC_ARENA_MAX": "4"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"}])
def test_a_user_choice_is_left_alone(env):
    tuned, faults = run_churn(True, **env)
    assert tuned == "False"
    assert faults >= 100 * 512  # glibc's own behaviour, untouched
