"""docs/recipes.md, "Install distemb as a library": its commands, run as printed in a
temporary directory, install distemb into a bare venv beside torch, and the quickstart
runs there on the compiled kernels.

The checkout is copied first (its files, as git lists them): building from it in place
would write build/ and *.egg-info into it. The CUDA build is skipped (DISTEMB_NO_CUDA=1,
as the page says one may), so the test takes the Cython build's minutes only. Slow: a
fresh venv, torch and a wheel build. pip writes no bytecode of what it installs
(``PIP_COMPILE=0``): compiling torch's ~2,000 modules cost ~20 s of CPU of the suite's, and
the recipe's claim (the quickstart runs compiled) holds with or without it; Python
compiles what the quickstart imports as it imports it.
"""
import os
import re
import shutil
import subprocess
import sys

import pytest

from mp_helper import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


def recipe_commands():
    """The bash block of the recipe's section, line by line."""
    with open(os.path.join(ROOT, "docs", "recipes.md"), encoding="utf-8") as f:
        page = f.read()
    section = page.split("## Install distemb as a library", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


def copy_checkout(dest):
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    for rel in files:
        src = os.path.join(ROOT, rel)
        if os.path.isfile(src):
            os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
            shutil.copy2(src, os.path.join(dest, rel))


def test_the_install_recipe_gives_a_venv_where_the_quickstart_runs_compiled(tmp_path):
    commands = recipe_commands()
    assert commands[0] == "python3 -m venv venv" and any("torch==2.13.0" in c
                                                         for c in commands), commands
    copy_checkout(tmp_path / "distemb")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(DISTEMB_NO_CUDA="1", PIP_COMPILE="0", PATH=os.pathsep.join(
        p for p in env["PATH"].split(os.pathsep) if ".venv" not in p))
    outputs = []
    for command in commands:
        command = command.replace("/path/to/distemb", str(tmp_path / "distemb"))
        run = subprocess.run(command, shell=True, cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=1200)
        assert run.returncode == 0, (command, run.stdout[-3000:], run.stderr[-3000:])
        outputs.append(run.stdout)
    assert outputs[-1].strip() == "compiled", outputs[-1]
    quick = subprocess.run([str(tmp_path / "venv" / "bin" / "python"),
                            os.path.join(ROOT, "examples", "quickstart.py")], cwd=tmp_path,
                           env=dict(env, OMP_WAIT_POLICY="passive"), capture_output=True,
                           text=True, timeout=300)
    assert quick.returncode == 0 and "step 300" in quick.stdout, quick.stderr[-3000:]
    # the installed package, not the checkout, ran it
    where = subprocess.run([str(tmp_path / "venv" / "bin" / "python"), "-c",
                            "import distemb; print(distemb.__file__)"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=120).stdout
    assert str(tmp_path / "venv") in where, where
