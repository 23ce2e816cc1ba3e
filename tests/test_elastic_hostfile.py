"""Host lists as the launcher and the elastic driver read them (bagua_hvd/runner/hosts.py,
runner/elastic/discovery.py): an entry that gives its slot count twice, or has extra colons
without being an IPv6 address, is refused with an error naming it (Horovod's
``HostInfo.from_string`` refuses both, with a bare unpacking error), instead of becoming one
IPv6 "host"; an undecodable hostfile or discovery output is refused naming its source."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bagua_hvd.runner.elastic.discovery import HostDiscoveryScript
from bagua_hvd.runner.hosts import HostError, parse_hostfile, parse_hosts

ROOT = Path(__file__).resolve().parent.parent


def _hostfile(tmp_path: Path, text) -> str:
    path = tmp_path / "hosts"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(path)


def test_hostfile_slot_count_given_twice_is_refused(tmp_path):
    path = _hostfile(tmp_path, "node1 slots=2\nlocalhost:2 slots=3\n")
    with pytest.raises(HostError, match=r"hosts' line 2: 'localhost:2 slots=3' gives the slot "
                                        r"count twice"):  # fmt: skip
        parse_hostfile(path)


def test_hostfile_ipv6_hosts(tmp_path):
    path = _hostfile(tmp_path, "::1 slots=2\nfe80::2\n[::3] slots=4\n")
    assert parse_hostfile(path) == [("::1", 2), ("fe80::2", 1), ("::3", 4)]


def test_host_entry_with_extra_colons_is_refused():
    with pytest.raises(HostError, match=r"'localhost:2:3' has more than one ':' and is not an "
                                        r"IPv6 address"):  # fmt: skip
        parse_hosts("localhost:2:3")
    assert parse_hosts("::1,[::1]:2,h:3") == [("::1", 1), ("::1", 2), ("h", 3)]


def test_non_utf8_hostfile_error_names_the_file(tmp_path):
    path = _hostfile(tmp_path, b"node1 slots=2\nn\xe9ud slots=1\n")
    with pytest.raises(HostError, match=rf"--hostfile '{path}' is not UTF-8 text: byte 0xe9 at "
                                        r"offset 15"):  # fmt: skip
        parse_hostfile(path)


def test_launcher_refuses_the_hostfile_naming_it(tmp_path):
    path = _hostfile(tmp_path, "localhost:2 slots=3\n")
    proc = subprocess.run(
        [sys.executable, "-m", "bagua_hvd.runner.launch", "-np", "2", "--hostfile", path,
         sys.executable, "-c", "pass"],
        capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )  # fmt: skip
    assert proc.returncode != 0
    assert f"--hostfile {path!r} line 1" in proc.stderr, proc.stderr
    assert "gives the slot count twice" in proc.stderr, proc.stderr


def test_discovery_output_that_is_not_utf8_is_refused():
    script = HostDiscoveryScript(r"printf 'h\351:2\n'", None)
    with pytest.raises(RuntimeError, match=r"printed output that is not UTF-8 text: byte 0xe9"):
        script.find_available_hosts_and_slots()
