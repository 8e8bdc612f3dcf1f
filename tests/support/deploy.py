"""The Helm chart rendered per mode, and the plain manifests generated from it.

Rendering uses a ``helm`` binary when one is on the PATH (``helm template``), else Helm's
own Go SDK through the ``helm-python-sdk`` wheel (the test extra installs it on Linux
x86-64), so the templates are checked by Helm itself either way. Run this module to
regenerate ``deploy/manifests`` after changing the chart (``make manifests``).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent.parent
DEPLOY = ROOT / "deploy"
CHART = DEPLOY / "helm" / "kvroute"
MANIFESTS = DEPLOY / "manifests"
MODES = ("service", "sidecar", "endpoint-picker")
RELEASE, NAMESPACE = "kvroute", "kvroute"


class RendererUnavailable(RuntimeError):
    """Neither a helm binary nor Helm's SDK is available here."""


def renderer() -> str:
    """``helm`` (a binary on the PATH) or ``sdk`` (helm-python-sdk); raises if neither."""
    if shutil.which("helm"):
        return "helm"
    try:
        import helm_python  # noqa: F401
    except (ImportError, OSError) as exc:
        raise RendererUnavailable(
            f"no helm binary on the PATH and helm-python-sdk unusable ({exc})"
        ) from None
    return "sdk"


def values_of(mode: str) -> dict[str, Any]:
    return yaml.safe_load((CHART / f"values-{mode}.yaml").read_text())


def render_text(mode: str, overrides: dict[str, Any] | None = None) -> str:
    """The chart's manifests for ``mode`` as one multi-document YAML text."""
    values_file = CHART / f"values-{mode}.yaml"
    if renderer() == "helm":
        extra = CHART.parent / f".test-values-{mode}.yaml"
        args = ["helm", "template", RELEASE, str(CHART), "-n", NAMESPACE, "-f", str(values_file)]
        try:
            if overrides:
                extra.write_text(yaml.safe_dump(overrides))
                args += ["-f", str(extra)]
            done = subprocess.run(args, check=True, capture_output=True, text=True, timeout=60)
            return done.stdout
        finally:
            extra.unlink(missing_ok=True)
    import helm_python

    from router.config import merge

    values = merge(values_of(mode), overrides or {})
    with helm_python.Chart.load(str(CHART)) as chart:
        rendered = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    parts = [
        f"---\n# Source: {path}\n{text.strip()}\n"
        for path, text in sorted(rendered.items())
        if path.endswith((".yaml", ".yml")) and text.strip()
    ]
    return "".join(parts)


def documents(text: str) -> list[dict[str, Any]]:
    """The Kubernetes objects of a multi-document YAML text (empty documents dropped)."""
    return [d for d in yaml.safe_load_all(text) if d]


def manifest_path(mode: str) -> Path:
    return MANIFESTS / mode / "kvroute.yaml"


HEADER = """\
# Generated from deploy/helm/kvroute with values-{mode}.yaml (release "kvroute",
# namespace "kvroute"); regenerate with `make manifests`. Apply with
# `kubectl apply -k deploy/manifests/{mode}` (kustomization.yaml sets the namespace).
"""

KUSTOMIZATION = """\
# kubectl apply -k deploy/manifests/{mode}
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
namespace: kvroute
resources:
  - kvroute.yaml
"""


def write_manifests() -> None:
    for mode in MODES:
        path = manifest_path(mode)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(HEADER.format(mode=mode) + render_text(mode))
        (path.parent / "kustomization.yaml").write_text(KUSTOMIZATION.format(mode=mode))
        print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    write_manifests()
