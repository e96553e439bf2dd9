"""uv's flags for what pip on this machine is configured with (uv reads no pip configuration).

    python deployments/pip_to_uv.py [PIP_CONFIG_LIST_OUTPUT_FILE]

Reads `python -m pip config list` (pip's merged view of its config files and PIP_*
variables, most specific last) and prints the uv flags that mean the same: find-links,
index-url, extra-index-url, constraint, trusted-host, and the certificate as `SSL_CERT_FILE`
for uv's environment. So `make` installs with uv from the same places and under the same pins
as pip would, on any machine, without naming a path of one. Standard library only: it runs
before any venv exists.
"""

from __future__ import annotations

import shlex
import subprocess
import sys

# pip option -> uv flag; each value may hold several, separated by white space
FLAGS = {
    "find-links": "--find-links",
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "constraint": "--constraint",
    "trusted-host": "--allow-insecure-host",
}


# Which wins when an option is set in several places, as `pip install` reads them: a PIP_*
# variable over the config files' [install] section over their [global] one.
PRECEDENCE = {"global": 0, "install": 1, ":env:": 2}


def pip_config(text: str) -> dict[str, list[str]]:
    """{option: values} from `pip config list` lines like `global.find-links='/a /b'` or
    `:env:.constraint='c.txt'` (pip has merged its config files already)."""
    ranked: dict[str, tuple[int, list[str]]] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        section, dot, option = key.strip().rpartition(".")
        if not sep or not dot or section not in PRECEDENCE:
            continue
        rank = PRECEDENCE[section]
        if option not in ranked or rank >= ranked[option][0]:
            ranked[option] = (rank, shlex.split(value.strip().strip("'\"")))
    return {option: values for option, (_, values) in ranked.items()}


def uv_flags(options: dict[str, list[str]]) -> list[str]:
    flags: list[str] = []
    for option, flag in FLAGS.items():
        for value in options.get(option, []):
            flags += [flag, value]
    if options.get("cert"):
        flags += ["--native-tls"]  # uv then trusts the system store pip's cert comes from
    return flags


def main(argv: list[str]) -> int:
    if argv:
        with open(argv[0]) as listing:
            text = listing.read()
    else:
        text = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout
    print(shlex.join(uv_flags(pip_config(text))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
