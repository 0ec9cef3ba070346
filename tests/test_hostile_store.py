"""A server holding a dynamic table against hostile frames: 300 requests built with the
store message classes and the row requests every table takes (Pull, Push, OptInit,
Update on the dynamic table's keys), some fields and arrays made hostile (absurd dims, keys
another server owns, wrong dtypes and shapes, unknown columns, rules and modes). Each
must get an error (or a reply); afterwards the real trainer's table is intact and
still trains, and the server exits cleanly when the trainers say goodbye."""
import threading

import numpy as np
import pytest

from mp_helper import ProcessGroup
from test_hostile import (BAD_VALUES, NAMES, Server, SpecCreate, _array, ask,
                          closed_after_error)

from distemb.rules import AdagradHyper
from distemb.stores import key_normal
from distemb.stores.spec import HashTableSpec
from distemb.transport.messages import (Export, Get, Info, Load, OptInit, Pull, Push,
                                        Remove, Save, Service, Update)

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


def hostile_store_message(rng, tmp):
    keys = np.array([3, -7, 2 ** 40], np.int64)
    valid = {
        SpecCreate: dict(HashTableSpec(4, init=key_normal(4)).fields()),
        OptInit: dict(rule="adagrad", options={"initial_accumulator_value": 0.0}, parts=[0]),
        Pull: dict(parts=[0], counts=[3], ids=keys),
        Get: dict(mode="get", column="weight", parts=[0], counts=[3], ids=keys),
        Push: dict(parts=[0], counts=[3], ids=keys, values=np.ones((3, 4), np.float32)),
        Remove: dict(parts=[0], counts=[3], ids=keys),
        Update: dict(rule="adagrad", hyper={"clr": 0.1, "eps": 1e-10}, seq=1,
                     exact=False, parts=[0], counts=[3], ids=keys,
                     grads=np.ones((3, 4), np.float32)),
        Info: dict(evict_to=1, policy="lfu"),
        Export: dict(part=0, start=0, count=10, columns=[]),
        Save: dict(directory=str(tmp), save_id="ab12cd34", parts=[0], columns=[]),
        Load: dict(directory=str(tmp), parts=[0], columns=[]),
    }
    cls = list(valid)[rng.integers(len(valid))]
    kw = dict(valid[cls])
    for key in list(kw):
        if key in ("parts", "counts") and cls in (Get, Remove):
            continue  # their routing: fuzzed by tests/test_token_holder.py
        if rng.random() < 0.4:
            kw[key] = _array(rng) if isinstance(kw[key], np.ndarray) else \
                BAD_VALUES[rng.integers(len(BAD_VALUES))]
    if cls is SpecCreate and rng.random() < 0.3:
        kw["dim"] = [0, -1, 1 << 40, 1 << 20, 5][rng.integers(5)]
    if cls is Update and kw.get("exact") is True:
        kw["exact"] = "yes"  # a legitimate exact step would wait for the other trainer
    return cls(name=NAMES[rng.integers(len(NAMES))] if rng.random() < 0.5 else "dyn", **kw)


def test_fuzz_300_hostile_store_frames_then_the_real_table_still_trains(tmp_path):
    rng = np.random.default_rng(20261124)
    with ProcessGroup() as group:
        srv = Server(tmp_path, group, consistency="sync")
        real, other = srv.real, srv.other
        spec = HashTableSpec(4, init=key_normal(4, seed=2))
        for name in ("keep", "dyn"):  # "dyn" is the fuzzer's to mangle
            t = threading.Thread(target=other.create_table, args=(name, spec))
            t.start()
            real.create_table(name, spec)
            t.join(30)
        keys = np.array([1, -(2 ** 50), 77], np.int64)
        real.push("keep", keys, np.full((3, 4), 2.0, np.float32))
        answers = {"error": 0, "reply": 0}
        conn = srv.connect()
        for i in range(300):
            msg = hostile_store_message(rng, tmp_path)
            frame = ask(conn, msg)
            if frame is None or frame.service == Service.ERROR:
                answers["error"] += 1
            else:
                assert frame.service == Service.REPLY
                answers["reply"] += 1
            if frame is None or closed_after_error(frame):
                conn.close()
                conn = srv.connect()
            assert srv.proc.poll() is None, f"server died at frame {i}: {msg.__dict__}"
        conn.close()
        print(f"store fuzz: answers {answers}")
        assert answers["error"] > 100 and answers["reply"] > 20
        np.testing.assert_array_equal(real.get("keep", keys), np.full((3, 4), 2.0))
        assert real.size("keep") == 3
        t = threading.Thread(target=other.init_optimizer, args=("keep", "adagrad", {}))
        t.start()
        real.init_optimizer("keep", "adagrad", {})
        t.join(30)
        real.push_update("keep", keys, np.ones((3, 4), np.float32), "adagrad",
                         AdagradHyper(clr=0.5, eps=1e-10))
        np.testing.assert_allclose(real.get("keep", keys), np.full((3, 4), 1.5), rtol=1e-6)
        srv.finish(group)
