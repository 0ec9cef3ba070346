"""The results of the benchmarks, as data files the documentation reads.

Every benchmark script writes its run to ``benchmarks/results/<script>.json`` (or to the
file given by ``--results``; ``--results none`` writes nothing). A file maps a result key
to the latest run of one command (``--result-key``; the index, benchmarks/README.md,
gives the command of each key):

.. code-block:: json

    {"main": {"date": "2026-11-26 10:42 UTC", "commit": "4a2b347",
              "machine": "AMD EPYC, 2 cores, VM", "command": "python benchmarks/...",
              "load": "3.0-6.7", "figures": {"adagrad_vs_torch_zipf":
              {"value": 3.61, "text": "3.61x", "what": "..."}}, "output": "..."}}

``figures`` are the named numbers the documentation quotes (docs/results_hook.py puts
``{{ figure bench_step/main/adagrad_vs_torch_zipf }}`` in its place); ``output`` is what
the run printed, its tables. Each record says when, on which commit, on which machine and
by which command it was measured, so a figure exists in one place with its provenance and
its history is the file's history in git.

Example::

    parser = argparse.ArgumentParser()
    results.add_arguments(parser)
    args = parser.parse_args()
    with results.Recorder("bench_x", args) as rec:
        print("| contender | calls/s |")   # printed and recorded
        rec.figure("speedup", 2.5, "{:.2f}x", "distemb vs torch, same run")
"""
import io
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

#: Where the data files live.
RESULTS_DIR = Path(__file__).resolve().parent / "results"
ROOT = RESULTS_DIR.parent.parent
#: Environment variables that change what a benchmark measures: recorded with its command.
ENV_OF_COMMAND = ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "DISTEMB_NUM_THREADS",
                  "DISTEMB_NO_EXT", "DISTEMB_CPU_ISA", "DISTEMB_MALLOC")
#: Fields every record has (the documentation's provenance line is made of them). A
#: record may also have ``load`` (the load average over the run) and ``note``.
FIELDS = ("date", "commit", "machine", "command", "figures", "output")


def add_arguments(parser, key="main"):
    """Add ``--results`` and ``--result-key`` to a benchmark's argument parser (``key``:
    the default key; None: the script derives it from its other options)."""
    parser.add_argument("--results", default=None, metavar="FILE",
                        help="data file of this run (default: benchmarks/results/<script>.json;"
                             " 'none': write nothing)")
    parser.add_argument("--result-key", default=key, metavar="KEY",
                        help="the run's key in that file (default: "
                             + (repr(key) if key else "set by the options")
                             + "; benchmarks/README.md names the key of each command)")


def cpu_model():
    """The CPU's model name as /proc/cpuinfo (lscpu) gives it, else the platform's."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine():
    """CPU model, core count, its widest vector ISA and whether this is a virtual machine
    (one model name covers CPUs with and without AVX-512, which distemb's kernels use)."""
    flags = set()
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((set(line.split(":", 1)[1].split()) for line in f
                          if line.startswith("flags")), set())
    except OSError:
        pass
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else None
    return ", ".join([cpu_model(), f"{os.cpu_count()} cores"] + ([isa] if isa else [])
                     + (["VM"] if "hypervisor" in flags else []))


def commit():
    """The checkout's commit, marked when tracked files differ from it (results aside)."""
    def git(*args):
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True,
                              text=True, timeout=30).stdout.strip()
    try:
        head = git("rev-parse", "--short", "HEAD")
        changed = [ln for ln in git("status", "--porcelain", "--untracked-files=no")
                   .splitlines() if "benchmarks/results/" not in ln]
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"
    if not head:
        return "unknown (not a git checkout)"
    return head + (" + uncommitted changes" if changed else "")


def command(script, argv):
    """The command line of this run as one would type it again (``--results`` left out)."""
    args, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--results":
            skip = True
        elif not a.startswith("--results="):
            args.append(a)
    env = [f"{k}={os.environ[k]}" for k in ENV_OF_COMMAND if k in os.environ]
    return " ".join(env + ["python", f"benchmarks/{script}.py"] + [shlex.quote(a) for a in args])


def path_of(script, args):
    """The data file of a run, or None for ``--results none``."""
    if args.results is None:
        return RESULTS_DIR / f"{script}.json"
    return None if args.results == "none" else Path(args.results)


def load(path):
    """The records of a data file: {key: record} ({} when the file does not exist)."""
    path = Path(path)
    if not path.exists():
        return {}
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected an object of result keys, got {type(data).__name__}")
    return data


def write(path, key, record):
    """Put ``record`` under ``key`` in the data file at ``path`` (other keys kept)."""
    path = Path(path)
    data = load(path)
    data[key] = record
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


class _Tee(io.TextIOBase):
    """Writes to the real stdout and keeps a copy."""

    def __init__(self, out):
        self.out, self.copy = out, io.StringIO()

    def write(self, s):
        self.copy.write(s)
        return self.out.write(s)

    def flush(self):
        self.out.flush()


class Recorder:
    """Records a benchmark run: what it prints, its named figures, and its provenance.

    Used as a context manager around the run; on a clean exit it writes the record to
    the run's data file (``--results``, ``--result-key``). A run that raised writes
    nothing, so a data file never holds a half-run.

    Args:
        script: the script's name without ``.py`` (the data file's default name).
        args: the parsed arguments (with ``results`` and ``result_key``, see
            :func:`add_arguments`).
        argv: the command-line arguments (default: ``sys.argv[1:]``).

    Example::

        with Recorder("bench_hash", args) as rec:
            rec.figure("foi_load_0.5", 46.7e6, "{:.1f}M keys/s", "find-or-insert, one core")
    """

    def __init__(self, script, args, argv=None):
        self.script, self.path, self.key = script, path_of(script, args), args.result_key
        self.record = {"date": None, "commit": commit(), "machine": machine(),
                       "command": command(script, sys.argv[1:] if argv is None else argv),
                       "load": None, "figures": {}, "output": ""}
        self._tee = None

    def figure(self, name, value, fmt, what):
        """Name a number the documentation may quote.

        Args:
            name: its name in the record (letters, digits, ``_``, ``.``, ``-``).
            value: the number.
            fmt: how it reads, a ``str.format`` pattern (``"{:.2f}x"``).
            what: what it is, in words (the documentation's reader sees it).
        """
        if not name or not all(c.isalnum() or c in "_.-" for c in name):
            raise ValueError(f"figure name: letters, digits, '_', '.', '-' only, got {name!r}")
        value = float(value)
        self.record["figures"][name] = {"value": value, "text": fmt.format(value),
                                        "what": what}

    def device(self, name):
        """Add the accelerator the run used to the machine it ran on."""
        self.record["machine"] += f"; {name}"

    def __enter__(self):
        self._load0 = os.getloadavg()[0]
        self.record["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        self._tee = _Tee(sys.stdout)
        sys.stdout = self._tee
        return self

    def __exit__(self, exc_type, exc, tb):
        sys.stdout = self._tee.out
        if exc_type is not None or self.path is None:
            return False
        self.record["output"] = self._tee.copy.getvalue()
        self.record["load"] = f"{self._load0:.1f}-{os.getloadavg()[0]:.1f}"
        write(self.path, self.key, self.record)
        print(f"# results: {self.path} [{self.key}]")
        return False
