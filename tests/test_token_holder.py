"""A token holder cannot crash a server or change a row with a refused request (issue 18).

A fuzzer that has said a valid Hello (it holds the job token, as any trainer or any bug
in one does) sends every request kind with hostile fields: wrong dtypes and ranks,
negative and huge ids, huge shapes and counts, NaN and infinite hyperparameters and
initial values, bad and reserved names, mismatched lengths, request slots handed over as
descriptors that are not sealed memory files of their declared size (files of a disk or
of /dev/shm, unsealed or half-sealed memfds, directories, pipes, sockets, devices,
O_PATH and write-only descriptors, too many descriptors in a frame, descriptors on
frames that take none), hostile layouts in a real slot, the old protocol's slot paths,
and loads of damaged checkpoints (a corrupt late block, half or double coverage, missing,
truncated or renamed segments, lying manifests, and, every CRC right, a key the hash
index reserves, an entry whose shape contradicts its records, state without its weight).
Requests a server once took or refused only by accident or late (issue 37: an unknown
optimizer option, a spec's initialiser of another dim, state written to a key the table
lacks, a 2-d ``have``, an exact update of a reserved key) are sent as they are, and
their errors must name what is wrong. Every message is built to be invalid,
so the oracle is exact: each must be answered with an error, the server process must
stay up, every row and optimizer state of the tables it attacks must be the same, bit
for bit, afterwards (checked after each kind), and the server must hold no descriptor
more than before. The seed is fixed.

A second test races truncations of a slot against the server's reads of it, through the
old protocol's named files and through descriptors: the server must answer every
request and stay up (it died of SIGBUS)."""
import os
import signal
import sys
import time

import numpy as np
import pytest

from mp_helper import ProcessGroup
from test_hostile import Server, SpecCreate, ask
from test_shm_writes import hostile_fd, sealed
from token_attacks import (DIM, KEYS, KINDS, NAMED, NAMED_DAMAGE, PER_KIND, ROWS,
                           damaged_checkpoints, ids, in_shm, in_shm_messages)

from distemb.stores.dense import DenseSpec
from distemb.kernels.half import BFLOAT16
from distemb.stores.spec import HashTableSpec
from distemb.transport.messages import (Create, Hello, Load, OptInit, Pull, Push, Service,
                                        Export, Info, Update, VersionedPull)
from distemb.transport.base import Frame, close_fds

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


def open_fds(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


# --- the test ------------------------------------------------------------------------


class Holder:
    """A connection of a token holder (Hello as rank 1), remade when the server hangs up."""

    def __init__(self, srv):
        self.srv, self.conn = srv, srv.connect(hello_rank=1, local=True)

    def ask(self, msg):
        """The answer to ``msg`` (a message, or a frame whose descriptors are closed here
        once sent: the server has its own)."""
        try:
            frame = ask(self.conn, msg)
        finally:
            if isinstance(msg, Frame):
                close_fds(msg)
        if frame is None or (frame.service == Service.ERROR and frame.fields.get("kind") in
                             ("TransportError", "RefusedError")):
            self.conn.close()
            self.conn = self.srv.connect(hello_rank=1, local=True)
        return frame

    def ok(self, msg):
        frame = self.ask(msg)
        assert frame is not None and frame.service == Service.REPLY, \
            (type(msg).__name__, frame and frame.fields)
        return frame

    def state(self):
        """Every row, state row and key of the attacked tables, as bytes."""
        out = {}
        for name in ("keep", "keep~opt~sum", "half"):
            rows = self.ok(Pull(name=name, parts=[0], counts=[ROWS], ids=np.arange(ROWS)))
            out[name] = (rows.arrays[0].dtype, rows.arrays[0].tobytes())
        exp = self.ok(Export(name="dyn", part=0, start=0, count=1000, columns=[]))
        order = np.argsort(exp.arrays[0])
        out["dyn"] = [exp.fields["columns"]] + [a[order].tobytes() for a in exp.arrays]
        info = self.ok(Info(name="dyn"))
        out["dyn_info"] = (info.fields["size"], info.fields["columns"])
        vp = self.ok(VersionedPull(name="keep", parts=[0], counts=[ROWS], ids=np.arange(ROWS),
                                   have=np.full(ROWS, -2, np.int64), states=["sum"]))
        out["versions"] = [a.tobytes() for a in vp.arrays]
        return out


def short(msg):
    """A message, for an assertion's text (fields cut to 80 characters)."""
    return f"{type(msg).__name__}({ {k: str(v)[:80] for k, v in vars(msg).items()} })"


def settled(pid, want, timeout=10.0):
    """The number of descriptors of ``pid`` once it is ``want`` (connections the fuzzer
    left are closed by their threads a moment later), or after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while open_fds(pid) != want and time.monotonic() < deadline:
        time.sleep(0.05)
    return open_fds(pid)


def _resolve(kw, paths, tmp_path):
    for k, v in kw.items():
        if isinstance(v, str) and v.startswith("<") and v.endswith(">"):
            kw[k] = str(tmp_path / "saves") if v == "<tmp>" else paths[v]
    return kw


def messages_of(cls, rng, paths, tmp_path, token):
    """``(message, what its error must name or None)``: PER_KIND invalid messages of
    ``cls`` (its base with 1 to 3 distinct mutations), then its :data:`NAMED` ones."""
    base, mutations = KINDS[cls]
    for _ in range(PER_KIND):
        kw = dict(base)
        picks = rng.choice(len(mutations), size=min(len(mutations), int(rng.integers(1, 4))),
                           replace=False)
        touched = set()
        for i in picks:  # mutations of distinct fields: a later one never undoes another
            if touched.isdisjoint(mutations[i]):
                kw.update(mutations[i])
                touched.update(mutations[i])
        if cls is Hello and kw["token"] is None:
            kw["token"] = token
        yield cls(**_resolve(kw, paths, tmp_path)), None
    for mutation, expect in NAMED.get(cls, ()):
        yield cls(**_resolve(dict(base, **mutation), paths, tmp_path)), expect
    if cls is Load:  # every damaged checkpoint of "keep" and of "dyn", as it is
        for key in sorted(k for k in paths if k.startswith("<ck_keep:")):
            # the weight alone, which "keep"'s checkpoint holds: each damage is looked at
            # (every column would be refused first for the state it lacks)
            yield (cls(**dict(base, directory=paths[key], columns=["weight"])),
                   NAMED_DAMAGE.get(key))
        for key in sorted(k for k in paths if k.startswith("<ck_dyn:")):
            yield cls(**dict(base, name="dyn", directory=paths[key])), NAMED_DAMAGE.get(key)


def test_a_token_holder_cannot_crash_the_server_or_change_a_row(tmp_path, monkeypatch):
    rng = np.random.default_rng(20261126)
    paths = damaged_checkpoints(tmp_path, monkeypatch)
    (tmp_path / "saves").mkdir()
    with ProcessGroup() as group:
        srv = Server(tmp_path, group, shared_memory=True, timeout_s=2.0)
        holder = Holder(srv)
        # The attacked tables, made by the holder itself (valid requests).
        holder.ok(Create.of_spec("keep", DenseSpec((ROWS, DIM), "float32")))
        holder.ok(Push(name="keep", parts=[0], counts=[ROWS], ids=np.arange(ROWS),
                       values=rng.standard_normal((ROWS, DIM)).astype(np.float32)))
        holder.ok(OptInit(name="keep", rule="adagrad",
                          options={"initial_accumulator_value": 0.1}, parts=[0]))
        holder.ok(Update(name="keep", rule="adagrad", hyper={"clr": 0.1, "eps": 1e-10},
                         seq=1, exact=False, parts=[0], counts=[3], ids=ids(0, 4, 9),
                         grads=rng.standard_normal((3, DIM)).astype(np.float32)))
        holder.ok(Create.of_spec("half", DenseSpec((ROWS, DIM), "bfloat16")))
        holder.ok(Push(name="half", parts=[0], counts=[ROWS], ids=np.arange(ROWS),
                       values=np.arange(ROWS * DIM, dtype=np.uint16).reshape(ROWS, DIM)
                       .view(BFLOAT16)))
        holder.ok(SpecCreate(name="dyn", **HashTableSpec(DIM).fields()))
        holder.ok(OptInit(name="dyn", rule="adagrad",
                          options={"initial_accumulator_value": 0.25}, parts=[0]))
        holder.ok(Push(name="dyn", parts=[0], counts=[len(KEYS)], ids=KEYS,
                       values=rng.standard_normal((len(KEYS), DIM)).astype(np.float32)))
        before = holder.state()
        fds = open_fds(srv.proc.pid)
        sent, errors = {}, {}
        kinds = [(cls.__name__, messages_of(cls, rng, paths, tmp_path, srv.cfg.job_token))
                 for cls in KINDS] + [("InShm", ((m, None) for m in in_shm_messages(
                     srv.cfg.job_id, tmp_path)))]
        for kind, msgs in kinds:
            for msg, expect in msgs:
                frame = holder.ask(msg)
                sent[kind] = sent.get(kind, 0) + 1
                assert srv.proc.poll() is None, f"server died on {short(msg)}"
                assert frame is not None, f"no answer to {short(msg)}"
                assert frame.service == Service.ERROR, \
                    f"accepted: {short(msg)} -> {str(frame.fields)[:200]}"
                assert expect is None or expect in frame.fields["message"], \
                    f"{short(msg)} refused for another reason: {frame.fields['message']}"
                errors[kind] = errors.get(kind, 0) + 1
            after = holder.state()
            assert after == before, \
                f"refused {kind}s changed {[k for k in before if after[k] != before[k]]}"
        # Every descriptor a frame brought was closed (the holder's one connection, its
        # slot and the tables' files are what the server holds, as before).
        holder.conn.close()
        holder.conn = srv.connect(hello_rank=1, local=True)
        assert settled(srv.proc.pid, fds) == fds, (fds, os.listdir(f"/proc/{srv.proc.pid}/fd"))
        print(f"token-holder fuzz: {sum(sent.values())} messages, {sum(errors.values())} "
              f"errors; per kind {sent}")
        assert sent == errors and len(sent) == len(KINDS) + 1
        # Legitimate requests of both real trainers still work afterwards.
        srv.init_data("w", 4, 2)
        srv.real.push("w", np.array([1]), np.ones((1, 2), np.float32))
        assert srv.real.pull("w", np.array([1])).tolist() == [[1.0, 1.0]]
        holder.conn.close()
        srv.finish(group)


# --- the truncation race -------------------------------------------------------------

#: Shrinks a file (a path, or /proc/<pid>/fd/<n>) to nothing and regrows it, as fast as
#: it can until SIGTERM, then prints how many shrinks the kernel allowed and refused.
TRUNCATOR = """
import os, signal, sys
fd = os.open(sys.argv[1], os.O_RDWR)
size, done = int(sys.argv[2]), [0, 0]
signal.signal(signal.SIGTERM, lambda *_: (print(*done, flush=True), os._exit(0)))
print("GO", flush=True)
while True:
    try:
        os.ftruncate(fd, 0)
        done[0] += 1
        os.ftruncate(fd, size)
    except PermissionError:
        done[1] += 1
"""
RACE_IDS = 1 << 17  # 1 MiB of ids: the server reads them for a while
RACE_REQUESTS = 300


def race(group, srv, conn_of, target, frame_of):
    """Send RACE_REQUESTS InShm pushes (``frame_of()`` each) while a truncator works on
    ``target``; every answer must be an error and the server must live.

    Returns:
        (shrinks allowed, shrinks refused).
    """
    size = 16 * RACE_IDS
    trunc = group.spawn([sys.executable, "-c", TRUNCATOR, target, str(size)], expect=None)
    assert trunc.stdout.readline().strip() == "GO"
    conn = conn_of()
    try:
        for i in range(RACE_REQUESTS):
            frame = frame_of()
            reply = ask(conn, frame)
            close_fds(frame)
            assert srv.proc.poll() is None, \
                f"the server died (signal {-srv.proc.returncode}) at request {i}"
            assert reply is not None and reply.service == Service.ERROR, (i, reply)
            if reply.fields.get("kind") in ("TransportError", "RefusedError"):
                conn.close()  # it hung up on the malformed frame
                conn = conn_of()
    finally:
        conn.close()
        trunc.send_signal(signal.SIGTERM)
        counts = trunc.stdout.readline().split()
        trunc.wait(10)
    return tuple(int(c) for c in counts)


def test_a_token_holder_racing_truncations_of_its_slot_cannot_crash_the_server(tmp_path):
    """A co-located token holder shrinks and regrows its request slot in a tight loop
    while it sends pushes through it (1 MiB of ids whose last is out of range: each is
    read in full, then refused). Through the old protocol's named file in /dev/shm the
    server read a slot truncated between its size check and its read, and died of
    SIGBUS. Named files are refused now; an unsealed or /dev/shm descriptor is refused
    before it is mapped; a sealed one cannot be truncated at all. The server answers every
    request with an error and its rows stay as they were."""
    ids_ = np.arange(RACE_IDS, dtype=np.int64)
    ids_[-1] = ROWS  # out of range: refused after the ids were read
    data = ids_.tobytes()
    push = {"parts": [0], "counts": [RACE_IDS]}
    layout = [[4, [RACE_IDS], 0], [1, [RACE_IDS, DIM], len(data)]]
    with ProcessGroup() as group:
        srv = Server(tmp_path, group, shared_memory=True, timeout_s=2.0)
        srv.init_data("keep", ROWS, DIM)
        srv.real.push("keep", np.arange(ROWS), np.full((ROWS, DIM), 3.0, np.float32))
        before = srv.real.pull("keep", np.arange(ROWS)).tobytes()
        counts = {}
        # The old protocol: a file named as a slot of this job, named in the frame.
        path = f"/dev/shm/distemb-p{os.getpid()}-{srv.cfg.job_id}-t1-s0-0123456789ab-0"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, 16 * RACE_IDS)
            os.pwrite(fd, data, 0)
            counts["named file"] = race(
                group, srv, lambda: srv.connect(hello_rank=1), path,
                lambda: Frame(int(Service.IN_SHM), "keep", {
                    "service": int(Service.PUSH), "fields": push, "path": path,
                    "layout": layout}))
        finally:
            os.close(fd)
            os.unlink(path)
        # Descriptors on the local socket: one of /dev/shm, an unsealed and a sealed memfd.
        for kind in ("/dev/shm file", "unsealed memfd", "sealed memfd"):
            fd = sealed(16 * RACE_IDS) if kind == "sealed memfd" else \
                hostile_fd(kind, str(tmp_path))[0]
            if kind != "sealed memfd":
                os.ftruncate(fd, 16 * RACE_IDS)
            os.pwrite(fd, data, 0)
            counts[kind] = race(
                group, srv, lambda: srv.connect(hello_rank=1, local=True),
                f"/proc/{os.getpid()}/fd/{fd}",
                lambda: in_shm(16 * RACE_IDS, layout, [os.dup(fd)], fields=push))
            os.close(fd)
        print(f"truncation race, {RACE_REQUESTS} requests each: (shrinks allowed, refused) "
              f"{counts}")
        assert counts["sealed memfd"][0] == 0 and counts["sealed memfd"][1] > 0, counts
        assert srv.real.pull("keep", np.arange(ROWS)).tobytes() == before
        srv.finish(group)
