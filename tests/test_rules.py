"""Typed hyperparameters: each rule's dataclass, checked where it is decoded.

The server receives hyperparameters as the fields of the rule's dataclass; a missing,
unknown or mistyped field is refused with an error naming the field, before any row is
touched (over the real request path of a KVService).
"""
import numpy as np
import pytest

from distemb.stores.dense import DenseSpec
from distemb.errors import KVStoreError
from distemb.kvstore.server.kvserver import KVServer
from distemb.kvstore.server.service import KVService
from distemb.rules import (RULES, AdagradHyper, AdamHyper, FtrlHyper, RuleName, SGDHyper,
                           rule_of)
from distemb.transport.messages import Create, OptInit, Service, Update


def test_every_rule_has_its_hyper_dataclass_and_round_trips():
    samples = {SGDHyper: SGDHyper(lr=0.1), AdagradHyper: AdagradHyper(clr=0.1, eps=1e-10),
               AdamHyper: AdamHyper(lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8, step=3),
               FtrlHyper: FtrlHyper(lr=0.1, lr_power=-0.5, l1=0.01, l2=0.0, l2_shrinkage=0.0,
                                    beta=0.0)}
    assert set(RULES) == set(RuleName)
    for rule in RULES.values():
        hyper = samples[rule.hyper_type]
        assert rule.hyper_from(hyper.fields()) == hyper
        assert rule.check_hyper(hyper) is hyper


@pytest.mark.parametrize("rule,fields,match", [
    ("adagrad", {"clr": 0.1}, r"hyper\.eps: missing for rule 'adagrad'"),
    ("adagrad", {"clr": 0.1, "eps": 1e-10, "lr": 1.0}, r"hyper\.lr: unknown field for rule"),
    ("sgd", {"lr": "0.1"}, r"hyper\.lr: expected a finite number for rule 'sgd', got '0.1'"),
    ("sgd", {"lr": float("nan")}, r"hyper\.lr: expected a finite number"),
    ("adam", {"lr": 0.1, "beta1": 0.9, "beta2": 0.9, "eps": 1e-8, "step": 1.5},
     r"hyper\.step: expected an int for rule 'adam', got 1\.5"),
    ("sgd", [0.1], r"hyper of rule 'sgd': expected a mapping"),
])
def test_decoded_hyper_names_the_bad_field(rule, fields, match):
    with pytest.raises(KVStoreError, match=match):
        rule_of(rule).hyper_from(fields)


def test_a_value_equal_to_an_accepted_one_is_checked_for_its_own_type():
    """Decoded hyperparameters are kept once checked; a value that compares equal to
    an accepted one but is of another type (True == 1, 1.0 == 1) is still refused."""
    adam = {"lr": 0.1, "beta1": 0.9, "beta2": 0.9, "eps": 1e-8}
    assert rule_of("adam").hyper_from(dict(adam, step=1)).step == 1
    for step in (True, 1.0):
        with pytest.raises(KVStoreError, match=r"hyper\.step: expected an int"):
            rule_of("adam").hyper_from(dict(adam, step=step))
    assert rule_of("sgd").hyper_from({"lr": 1}) == SGDHyper(lr=1.0)
    with pytest.raises(KVStoreError, match=r"hyper\.lr: expected a finite number.*True"):
        rule_of("sgd").hyper_from({"lr": True})
    with pytest.raises(KVStoreError, match=r"hyper\.lr: expected a finite number.*\[1\]"):
        rule_of("sgd").hyper_from({"lr": [1]})  # unhashable: checked the long way


def test_wrong_hyper_type_and_unknown_rule_are_refused():
    with pytest.raises(KVStoreError, match="rule 'adam' takes AdamHyper, got SGDHyper"):
        rule_of("adam").check_hyper(SGDHyper(lr=0.1))
    with pytest.raises(KVStoreError, match=r"rule: expected one of \['sgd', .*got 'lion'"):
        rule_of("lion")


def test_server_refuses_a_bad_hyper_before_touching_rows():
    svc = KVService(KVServer(), server_id=0, num_servers=1, num_trainers=1)
    svc.handle(Create.of_spec("w", DenseSpec((3, 2), "float32")).encode())
    svc.handle(OptInit(name="w", rule="adagrad", options={}, parts=[0]).encode())
    update = Update(name="w", rule="adagrad", hyper={"clr": 1.0}, seq=1, exact=False,
                    parts=[0], counts=[1], ids=np.array([1]), grads=np.ones((1, 2), np.float32))
    reply = svc.handle(update.encode())
    assert reply.service == Service.ERROR
    assert "hyper.eps: missing for rule 'adagrad'" in reply.fields["message"]
    assert svc.server.shard("w", 0).tolist() == [[0, 0]] * 3
    update.hyper = {"clr": 1.0, "eps": 1e-10}
    assert svc.handle(update.encode()).service == Service.REPLY
    assert svc.server.shard("w", 0)[1].tolist() == pytest.approx([-1.0, -1.0])
