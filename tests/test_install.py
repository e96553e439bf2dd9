"""The install: uv gets the same sources and pins as pip here (deployments/pip_to_uv.py), and a
machine without a GPU got the CPU build of torch."""

from __future__ import annotations

import glob
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("pip_to_uv", ROOT / "deployments" / "pip_to_uv.py")
pip_to_uv = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pip_to_uv)

LISTING = """\
:env:.cert='/etc/ssl/certs/ca-certificates.crt'
:env:.find-links='/opt/wheels'
global.constraint='/etc/pip/constraints.txt'
global.extra-index-url='file:///opt/a/simple file:///opt/b/simple'
global.find-links='/somewhere/else'
global.timeout='60'
install.index-url='https://mirror.example/simple'
"""


def test_pip_configuration_becomes_the_same_uv_flags():
    flags = pip_to_uv.uv_flags(pip_to_uv.pip_config(LISTING))
    assert flags == [
        "--find-links",
        "/opt/wheels",  # the PIP_FIND_LINKS variable wins over the config file, as in pip
        "--index-url",
        "https://mirror.example/simple",
        "--extra-index-url",
        "file:///opt/a/simple",
        "--extra-index-url",
        "file:///opt/b/simple",
        "--constraint",
        "/etc/pip/constraints.txt",
        "--native-tls",
    ]


def test_no_pip_configuration_means_no_flags():
    assert pip_to_uv.uv_flags(pip_to_uv.pip_config("")) == []


def test_the_script_reads_pip_config_list_itself():
    done = subprocess.run(
        [sys.executable, str(ROOT / "deployments" / "pip_to_uv.py")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True
    ).stdout
    expected = pip_to_uv.uv_flags(pip_to_uv.pip_config(listing))
    assert done.stdout.split() == expected


@pytest.mark.skipif(bool(glob.glob("/dev/nvidia[0-9]*")), reason="a GPU machine may use CUDA")
def test_a_machine_without_a_gpu_runs_the_cpu_build_of_torch():
    import torch

    assert torch.version.cuda is None, f"torch {torch.__version__} is a CUDA build"
    assert torch.__version__.startswith("2.13.0")
