"""The committed gRPC code is what ``make proto`` generates from proto/."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GEN = REPO / "router" / "grpc" / "gen" / "kvroute" / "v1"


def test_the_generated_code_matches_the_proto(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools comes with the dev extra")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{REPO / 'proto'}",
            f"--python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            str(REPO / "proto" / "kvroute" / "v1" / "router.proto"),
        ],
        check=True,
        timeout=60,
    )
    for name in ("router_pb2.py", "router_pb2.pyi", "router_pb2_grpc.py"):
        fresh = (tmp_path / "kvroute" / "v1" / name).read_text()
        # make proto's one edit: import the messages from inside the package
        fresh = re.sub(
            r"^from kvroute\.v1 import", "from router.grpc.gen.kvroute.v1 import", fresh, flags=re.M
        )
        assert (GEN / name).read_text() == fresh, f"{name} is stale: run `make proto`"
