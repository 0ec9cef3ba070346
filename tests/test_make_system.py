"""``make system`` installs the Debian packages without starting a service.

openssh-server (for the test of DGL's launcher, which runs its own sshd on 127.0.0.1)
would start a system sshd on port 22 when installed on a machine with systemd. The
Makefile forbids service starts during its one ``apt-get install`` with a temporary
policy-rc.d (Debian's invoke-rc.d and deb-systemd-invoke ask it; 101 = forbidden) and,
under systemd, disables the ssh units a fresh install enabled.

Here ``dpkg``, ``apt-get``, ``systemctl`` and ``sudo`` are stand-ins on PATH that record
what they saw, and the policy file and systemd's run directory are paths in tmp_path, so
the machine is not touched. The apt-get stand-in runs the policy file as Debian's
maintainer scripts would and records its exit code.
"""
import os
import shutil
import subprocess

import pytest

from mp_helper import ROOT

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")

STUBS = {
    # every package is missing unless $INSTALLED is set
    "dpkg": '[ -n "$INSTALLED" ] && exit 0; exit 1\n',
    "apt-get": ('echo "apt-get $*" >> "$LOG"\n'
                'if [ "$1" = install ] || [ "$2" = install ]; then\n'
                '  if [ -x "$POLICY" ]; then "$POLICY" ssh start; '
                'echo "policy-rc.d answered $?" >> "$LOG";\n'
                '  else echo "no policy-rc.d" >> "$LOG"; fi\n'
                'fi\n'),
    "systemctl": 'echo "systemctl $*" >> "$LOG"\n',
    "sudo": 'exec "$@"\n',
}


def make_system(tmp_path, packages, systemd=False, installed=False):
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    for name, body in STUBS.items():
        (bindir / name).write_text("#!/bin/sh\n" + body)
        (bindir / name).chmod(0o755)
    policy, rundir, log = tmp_path / "policy-rc.d", tmp_path / "systemd", tmp_path / "log"
    if systemd:
        rundir.mkdir(exist_ok=True)
    env = dict(os.environ, PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}", LOG=str(log),
               POLICY=str(policy), INSTALLED="1" if installed else "")
    run = subprocess.run(["make", "-s", "-C", ROOT, "system", f"APT={packages}",
                          f"POLICY_RC={policy}", f"SYSTEMD_DIR={rundir}"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    return log.read_text().splitlines() if log.exists() else [], policy


def test_install_runs_while_services_are_forbidden_and_leaves_no_policy(tmp_path):
    log, policy = make_system(tmp_path, "openmpi-bin openssh-server")
    assert "apt-get install -y -qq openmpi-bin openssh-server" in log, log
    assert "policy-rc.d answered 101" in log, log  # no service may start meanwhile
    assert not policy.exists()  # ours is gone afterwards
    assert not any(line.startswith("systemctl") for line in log), log  # no systemd here


def test_under_systemd_a_fresh_sshd_is_disabled_again(tmp_path):
    log, _ = make_system(tmp_path, "openssh-server", systemd=True)
    assert "systemctl disable --quiet ssh.service ssh.socket" in log, log


def test_under_systemd_other_packages_leave_units_alone(tmp_path):
    log, _ = make_system(tmp_path, "wordnet-base", systemd=True)
    assert "policy-rc.d answered 101" in log, log
    assert not any(line.startswith("systemctl") for line in log), log


def test_a_policy_already_there_is_kept_as_it_is(tmp_path):
    policy = tmp_path / "policy-rc.d"
    policy.write_text("#!/bin/sh\n# the administrator's\nexit 0\n")
    policy.chmod(0o755)
    log, _ = make_system(tmp_path, "openssh-server")
    assert "policy-rc.d answered 0" in log, log  # theirs was asked, not replaced
    assert policy.read_text() == "#!/bin/sh\n# the administrator's\nexit 0\n"


def test_nothing_missing_installs_nothing(tmp_path):
    log, policy = make_system(tmp_path, "openssh-server", systemd=True, installed=True)
    assert log == [] and not policy.exists()
