"""`pollen deploy`'s files and flags, without starting processes."""

from __future__ import annotations

import ipaddress
import json
import re
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import load_ssh_private_key

from pollen.cli import main
from pollen.deployment import certificates, cluster
from pollen.deployment.deploy_actions import NodeConfigError, node_extra


def test_certificates_name_every_host_and_chain_to_the_ca(tmp_path: Path) -> None:
    certificates.make_certificates(tmp_path, ["server.example.org", "10.0.0.5"])
    ca = x509.load_pem_x509_certificate((tmp_path / "ca.pem").read_bytes())
    server = x509.load_pem_x509_certificate((tmp_path / "server.pem").read_bytes())
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert names.value.get_values_for_type(x509.DNSName) == ["server.example.org"]
    assert names.value.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("10.0.0.5")
    ]
    assert server.issuer == ca.subject
    server.verify_directly_issued_by(ca)
    for secret in ("ca.key", "server.key"):
        assert stat.S_IMODE((tmp_path / secret).stat().st_mode) == 0o600
    with pytest.raises(ValueError, match="at least one host"):
        certificates.make_certificates(tmp_path / "none", [])


def test_node_key_is_an_openssh_ec_key_flower_can_read(tmp_path: Path) -> None:
    public = certificates.make_node_key(tmp_path / "node-0")
    key = load_ssh_private_key((tmp_path / "node-0").read_bytes(), None)
    assert key.curve.name == "secp384r1"
    assert public.read_text().startswith("ecdsa-sha2-nistp384 ")


def test_node_config_flags_are_checked(tmp_path: Path) -> None:
    own = tmp_path / "own.npz"
    own.write_bytes(b"")
    assert node_extra([f'1:data-file="{own}" state-dir="/s"'], 3) == {
        1: {"data-file": str(own), "state-dir": "/s"}
    }
    home = tmp_path / "home"
    home.mkdir()
    (home / "silo.npz").write_bytes(b"")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HOME", str(home))
        assert node_extra(['0:data-file="~/silo.npz" slowdown=3 state-dir=""'], 3) == {
            0: {"data-file": "~/silo.npz", "slowdown": 3, "state-dir": ""}
        }  # the node expands ~; "" turns its own state folder off
    for bad, message in (
        ("data-file='/a'", "expected K:key=value"),
        ("3:partition-id=1", "node index 0..2"),
        ("x:partition-id=1", "node index"),
        ("0:data-root=not toml", "--node-config"),
        ("0:partiton-id=1", "unknown node-config key 'partiton-id'; allowed: "
         "partition-id, num-partitions, data-root, data-file, state-dir, slowdown"),
        ("0:partition-id=", "'partition-id=' has no value"),
        ("0:partition-id=1 oops", "'oops' is not key=value"),
        ("1:data-file='/nonexistent/silo.npz'", "no such file"),
        ("0:num-partitions=4", r"disagree on num-partitions \(node by node: 4, 3, 3\)"),
    ):  # fmt: skip
        with pytest.raises(NodeConfigError, match=message):
            node_extra([bad], 3)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["1:partition-id=2"],
            r"1:partition-id=2 with num-partitions=2; allowed: 0 to 1",
        ),
        (["0:partition-id=-1"], r"allowed: 0 to 1"),
        (["1:partition-id=0"], r"node 0 serves partition 0 already"),
        (["0:num-partitions=0"], r"num-partitions=0; allowed: an integer >= 1"),
        (["1:partition-id='a'"], r"partition-id='a'"),
    ],
)
def test_node_partitions_that_cannot_exist_are_refused_before_start(
    flags: list[str], message: str, tmp_path: Path, capsys
) -> None:
    """`deploy up` with two nodes: a partition outside num-partitions, or one
    partition served twice, exits 2 in one line and starts nothing."""
    argv = ["deploy", "up", "--dir", str(tmp_path / "d"), "--nodes", "2"]
    for flag in flags:
        argv += ["--node-config", flag]
    assert main(argv) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and re.search(message, error), error
    assert not (tmp_path / "d").exists()
    assert node_extra(["0:partition-id=1", "1:partition-id=0"], 2)  # a swap is fine


def test_node_config_text_quotes_strings() -> None:
    text = cluster.node_config(2, 5, {"data-root": "/d ata", "flag": True})
    assert text == 'partition-id=2 num-partitions=5 data-root="/d ata" flag=true'


def test_commands_on_a_missing_deployment_say_so(tmp_path: Path, capsys) -> None:
    assert main(["deploy", "status", "--dir", str(tmp_path)]) == 1
    assert "no deployment in" in capsys.readouterr().err
    (tmp_path / cluster.STATE_FILE).write_text("{not json")
    assert main(["deploy", "down", "--dir", str(tmp_path)]) == 1
    assert "is not a pollen deployment record" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # argparse: input to fix, exit 2
        main(["deploy", "up", "--nodes", "0", "--dir", str(tmp_path / "x")])
    assert exit_info.value.code == 2
    assert "--nodes: 0 is not in 1..1000" in capsys.readouterr().err
    assert main(["run", ".", "--deployment", str(tmp_path / "y")]) == 2
    assert "no deployment in" in capsys.readouterr().err
    assert main(["deploy", "restart", "node-1", "--dir", str(tmp_path)]) == 1
    assert "expected `superlink` or a node's partition-id" in capsys.readouterr().err
    assert main(["deploy", "restart", "superlink", "--dir", str(tmp_path / "z")]) == 1
    assert "no deployment in" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: exit 2 with the choices
        main(["deploy", "up", "--executor", "lukewarm", "--dir", str(tmp_path)])
    assert "invalid choice: 'lukewarm'" in capsys.readouterr().err


def test_certs_are_never_replaced_without_force(tmp_path: Path, capsys) -> None:
    """Nodes trust the CA in place: a second `certs` must not swap it."""
    assert main(["deploy", "certs", str(tmp_path), "localhost"]) == 0
    ca = (tmp_path / "ca.pem").read_bytes()
    assert main(["deploy", "certs", str(tmp_path), "localhost"]) == 1
    assert (
        "already has ca.pem, ca.key, server.pem, server.key" in capsys.readouterr().err
    )
    assert (tmp_path / "ca.pem").read_bytes() == ca
    assert main(["deploy", "certs", str(tmp_path), "localhost", "--force"]) == 0
    assert (tmp_path / "ca.pem").read_bytes() != ca


def test_register_names_a_missing_key_before_contacting_anyone(
    tmp_path: Path, capsys
) -> None:
    args = ["deploy", "register", "--connection", "nowhere", str(tmp_path / "none.pub")]
    assert main(args) == 1
    assert f"no public key at {tmp_path / 'none.pub'}" in capsys.readouterr().err


def test_a_superlink_with_its_state_in_memory_is_not_restarted(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    """Restarted, an in-memory SuperLink would have forgotten the registered
    SuperNodes (they could not reconnect) and the runs: refused, with what
    to do instead; nothing is stopped."""
    record = cluster.Deployment(str(tmp_path), "127.0.0.1:1", False, superlink_pid=0,
                                superlink_state="memory")  # fmt: skip
    record.save()
    stopped: list[int] = []
    monkeypatch.setattr(cluster, "stop", stopped.append)
    assert main(["deploy", "restart", "superlink", "--dir", str(tmp_path)]) == 1
    assert stopped == []
    err = capsys.readouterr().err
    assert "keeps its state in memory" in err and "--superlink-state file" in err
    with pytest.raises(cluster.DeployError, match="--superlink-state 'disk'"):
        cluster.up(tmp_path / "other", 1, superlink_state="disk")
    assert not (tmp_path / "other").exists()


def test_a_record_from_before_superlink_state_restarts_from_its_file(
    tmp_path: Path,
) -> None:
    """Deployments recorded before the choice existed kept a superlink.db."""
    record = cluster.Deployment(str(tmp_path), "127.0.0.1:1", False)
    record.save()
    path = tmp_path / cluster.STATE_FILE
    raw = json.loads(path.read_text())
    del raw["superlink_state"]
    path.write_text(json.dumps(raw))
    assert cluster.Deployment.load(tmp_path).superlink_state == "file"
