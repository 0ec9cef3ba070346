"""benchmarks/netns.py: the simulated network of the cluster benchmarks is real and leaves
nothing behind.

A shaped link must limit a bulk TCP transfer to its configured rate (the oracle is the
rate given to tc, against an unshaped link on the same machine), and every namespace,
interface and queue the benchmark made must be gone afterwards, also after the process
that made them was SIGKILLed (the next Network removes those).
"""
import os
import signal
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
import netns  # noqa: E402

WHY = netns.available()
pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(WHY is not None, reason=f"simulated network: {WHY}")]


def links_of_this_namespace():
    """The machine's own interfaces (the benchmark must add none)."""
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True,
                         check=True).stdout
    return sorted(line.split(":")[1].strip() for line in out.splitlines())


@pytest.mark.timeout(120)
def test_shaped_link_limits_a_transfer_and_is_removed():
    before = links_of_this_namespace()
    rate = netns.parse_link("100mbit")
    with netns.Network(2, rate) as net:
        names = [net.switch] + net.hosts
        assert set(names) <= set(netns.ours())
        assert all("tbf" in q and "rate 100Mbit" in q for q in net.qdiscs()), net.qdiscs()
        shaped = net.measure(0, 1, nbytes=4 << 20)         # 4 MiB: ~0.35 s at 100 Mbit/s
        back = net.measure(1, 0, nbytes=4 << 20, port=5202)  # the other direction too
        assert links_of_this_namespace() == before  # nothing added to the machine's own
    # TCP/IP headers take ~4% of the bytes tbf counts; the bucket's first burst is free
    for got in (shaped, back):
        assert 0.8 * rate < got < 1.1 * rate, (got, rate)
    with netns.Network(2, None) as net:
        unshaped = net.measure(0, 1, nbytes=16 << 20)
    assert unshaped > 5 * rate, (unshaped, rate)  # the limit is the shaping, not the machine
    left = set(netns.ours())
    assert not left & set(names), left
    assert links_of_this_namespace() == before


@pytest.mark.timeout(120)
def test_namespaces_of_a_killed_run_are_removed_by_the_next():
    script = ("import sys, time; sys.path.insert(0, sys.argv[1]); import netns; "
              "net = netns.Network(2, 1e9); print(' '.join([net.switch] + net.hosts), "
              "flush=True); time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", script, os.path.dirname(netns.__file__)],
                         stdout=subprocess.PIPE, text=True)
    try:
        names = p.stdout.readline().split()
        assert len(names) == 3 and set(names) <= set(netns.ours()), names
    finally:
        p.send_signal(signal.SIGKILL)
        assert p.wait(timeout=30) == -signal.SIGKILL
    assert set(names) <= set(netns.ours())  # SIGKILL: no atexit ran
    with netns.Network(1, None) as net:      # the next run removes them
        assert not set(names) & set(netns.ours())
        mine = [net.switch] + net.hosts
    assert not set(mine) & set(netns.ours())


def test_bad_rates_are_named():
    with pytest.raises(ValueError, match="link: expected 'loopback', 'veth' or a rate like "
                                         "'1gbit'.*got '1gb'"):
        netns.parse_link("1gb")
    assert netns.parse_link("loopback") is None
    assert netns.parse_link("veth") == netns.VETH and netns.link_name(netns.VETH) == "veth"
    assert netns.parse_link("2.5gbit") == 2.5e9
    assert netns.link_name(1e9) == "1gbit" and netns.link_name(None) == "loopback"
    with pytest.raises(ValueError, match="num_hosts: expected 1..250, got 0"):
        netns.Network(0)
