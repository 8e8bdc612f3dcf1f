"""``kvroute config check FILE``: validate a configuration and print its effective values.

The file is read exactly as ``kvroute serve --config FILE`` reads it: defaults, the
file, then ``KVROUTE_*`` environment variables (unless ``--no-env``). A valid
configuration is printed in full, every default filled in, and the command exits 0; an
invalid one exits 2 with every offending key named. Use it in CI before a ConfigMap
change rolls out, or on a pod to see what the router actually runs with.
"""

from __future__ import annotations

import argparse
import json
import sys

import yaml

from router.config import ConfigError, load_config
from router.redaction import redacted

#: What an unset top-level block_size means (the value printed is only the fallback).
ADOPTED_BLOCK_SIZE = (
    "block_size is not set: each model's pool takes the block size its first engine reports "
    "(vllm:cache_config_info, /server_info), 16 until one does"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION")
    check = actions.add_parser(
        "check",
        help="validate a configuration file and print the effective values",
        description="Validate a configuration file and print the effective values "
        "(defaults, the file, then KVROUTE_* environment variables). Exit status 2 if invalid.",
    )
    check.add_argument(
        "file", metavar="FILE", help="YAML configuration file, as given to kvroute serve --config"
    )
    check.add_argument(
        "--format",
        choices=["yaml", "json"],
        default="yaml",
        help="how to print the effective configuration (default yaml)",
    )
    check.add_argument(
        "--no-env",
        action="store_true",
        help="ignore KVROUTE_* environment variables (check the file alone)",
    )
    check.add_argument(
        "--quiet", action="store_true", help="print nothing when valid; only the exit status"
    )


def run(args: argparse.Namespace) -> int:
    if args.action != "check":
        print("kvroute config: say what to do, e.g. kvroute config check FILE", file=sys.stderr)
        return 2
    try:
        config = load_config(args.file, environ={} if args.no_env else None)
    except ConfigError as exc:
        print(f"kvroute config check: {exc}", file=sys.stderr)  # it names each source
        return 2
    for note in config.deprecations:
        print(f"kvroute config check: {args.file}: warning: {note}", file=sys.stderr)
    if not config.engines and not config.discovery.kubernetes.enabled:
        print(
            f"kvroute config check: {args.file}: note: no engines and no discovery; "
            "kvroute serve will need --engine URL",
            file=sys.stderr,
        )
    if args.quiet:
        return 0
    values = config.model_dump(mode="json")  # secrets print as '**********'
    values["index"]["redis"]["url"] = redacted(values["index"]["redis"]["url"])
    # An unset block_size prints as its default, which is not what the router runs with.
    adopted = None if "block_size" in config.model_fields_set else ADOPTED_BLOCK_SIZE
    if args.format == "json":
        if adopted:
            print(f"kvroute config check: {args.file}: note: {adopted}", file=sys.stderr)
        print(json.dumps(values, indent=2))
    else:
        print(f"# {args.file}: valid. Effective configuration:")
        text = yaml.safe_dump(values, sort_keys=False)
        if adopted and text.startswith("block_size: "):  # the first key
            text = f"# {adopted}\n{text}"
        print(text, end="")
    return 0
