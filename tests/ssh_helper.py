"""An sshd on 127.0.0.1 for tests of launchers that start processes through ssh.

Debian's openssh-server listens on a free loopback port with its own host key and one
authorized key made for the test; an ``ssh`` wrapper (put first on PATH) points every
``ssh`` command at that key (and, when asked, at the port).
"""
import os
import shutil
import subprocess

import pytest

from mp_helper import free_port

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


def start_sshd(tmp_path, group, why, addresses=("127.0.0.1",)):
    """Start an sshd in ProcessGroup ``group``, listening on each loopback address of
    ``addresses`` (several stand for several machines); returns (port, path of the
    client key). Skips the test (saying ``why`` it needs one) where sshd is not
    installed."""
    if not os.path.exists(SSHD):
        pytest.skip(f"{SSHD} is missing: {why}; `make system` installs Debian's "
                    "openssh-server (it could not here)")
    d = tmp_path / "ssh"
    d.mkdir()
    for key in ("host_key", "id_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / key)],
                       check=True)
    shutil.copy(d / "id_key.pub", d / "authorized_keys")
    port = free_port(1)
    (d / "sshd_config").write_text(
        f"Port {port}\n" + "".join(f"ListenAddress {a}\n" for a in addresses) +
        f"HostKey {d / 'host_key'}\n"
        f"AuthorizedKeysFile {d / 'authorized_keys'}\nPermitRootLogin prohibit-password\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
        f"StrictModes no\nPidFile {d / 'sshd.pid'}\nAcceptEnv none\n")
    os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory
    group.spawn([SSHD, "-D", "-e", "-f", str(d / "sshd_config")], expect=None)
    group.wait_listening([(a, port) for a in addresses], timeout=30)
    return port, d / "id_key"


def ssh_wrapper(bindir, key, port=None):
    """Write ``bindir/ssh``: /usr/bin/ssh with ``key`` (and ``-p port``); returns bindir."""
    os.makedirs(bindir, exist_ok=True)
    wrapper = os.path.join(bindir, "ssh")
    with open(wrapper, "w", encoding="utf-8") as f:
        f.write(f"#!/bin/sh\nexec /usr/bin/ssh -i {key} {f'-p {port} ' if port else ''}"
                "-o BatchMode=yes -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR "
                "\"$@\"\n")
    os.chmod(wrapper, 0o755)
    return str(bindir)
