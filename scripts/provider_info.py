"""
Generate ``airflow_shared_stream_provider/get_provider_info.py`` from ``provider.yaml``.

``provider.yaml`` is the one source of the provider's metadata, as in Apache Airflow's own
providers (whose ``get_provider_info.py`` is generated from it by breeze): edit the YAML, then run

    .venv/bin/python -m scripts.provider_info            # rewrite get_provider_info.py
    .venv/bin/python -m scripts.provider_info --check    # exit 1 if it differs (scripts/test.sh runs this)

Its broker sections (``integrations``, ``triggers``, ``queues``) are not edited by hand: they are
written into ``provider.yaml``, between the two marker comments, from the broker registry
(``airflow_shared_stream_provider/brokers.py``), by the same command; ``--check`` fails when they
differ from it. So a new broker is one registry entry here too.

The generated module is a literal ``dict`` (no YAML parsing at import time: Airflow's
ProvidersManager imports it in every process), formatted with the project's ruff settings so that
``ruff format --check`` accepts it as written.
"""

from __future__ import annotations

import argparse
import difflib
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
PROVIDER_YAML = ROOT / "provider.yaml"
OUTPUT = ROOT / "airflow_shared_stream_provider" / "get_provider_info.py"

HEADER = '''\
"""Provider metadata for Airflow's ProvidersManager (entry point ``apache_airflow_provider``)."""

# NOTE: THIS FILE IS GENERATED FROM provider.yaml AND WILL BE OVERWRITTEN.
# Edit provider.yaml at the repository top level, then run: python -m scripts.provider_info
# (scripts/test.sh runs it with --check, which fails when this file and provider.yaml differ).

from __future__ import annotations

from typing import Any


def get_provider_info() -> dict[str, Any]:
    return '''


def _ruff() -> str:
    """The ruff next to this interpreter (the project's venv), else the one on PATH."""
    beside = Path(sys.executable).with_name("ruff")
    found = str(beside) if beside.exists() else shutil.which("ruff")
    if found is None:
        raise SystemExit("provider_info: ruff formats the generated module; scripts/setup.sh installs it")
    return found


LINE_LENGTH = 120  # pyproject.toml [tool.ruff] line-length


def _string_pieces(text: str, room: int) -> list[str]:
    """
    ``text`` cut into pieces whose literals fit in ``room`` characters: at its line ends first (so
    a YAML block reads line by line), then at spaces. Concatenated, the pieces are ``text``.
    """
    pieces: list[str] = []
    for line in text.splitlines(keepends=True) or [text]:
        rest = line
        while len(repr(rest)) > room and " " in rest[: room - 2]:
            cut = rest.rindex(" ", 0, room - 2) + 1
            pieces.append(rest[:cut])
            rest = rest[cut:]
        pieces.append(rest)
    return pieces


def _literal(value: Any, indent: int, lead: int = 0) -> str:
    """
    Python source for a YAML value whose line starts at column ``indent`` with ``lead`` characters
    before it (a dict key). Dicts keep provider.yaml's order, so the module reads like the YAML; no
    trailing commas, so ruff joins what fits on a line and splits the rest.
    """
    if isinstance(value, dict):
        items = ", ".join(f"{key!r}: {_literal(item, indent + 4, len(repr(key)) + 2)}" for key, item in value.items())
        return "{" + items + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_literal(item, indent + 4) for item in value) + "]"
    if isinstance(value, str):
        if "\n" not in value.rstrip("\n") and indent + lead + len(repr(value)) + 1 <= LINE_LENGTH:
            return repr(value)
        # One piece per line, one level in from the key, inside parentheses ruff keeps.
        pieces = _string_pieces(value, LINE_LENGTH - (indent + 4))
        pad = " " * (indent + 4)
        return "(\n" + "".join(f"{pad}{piece!r}\n" for piece in pieces) + " " * indent + ")"
    if value is None or isinstance(value, bool | int | float):
        return repr(value)
    raise SystemExit(f"provider_info: cannot write {type(value).__name__} {value!r} as a literal")


def render(info: dict[str, Any], output: Path = OUTPUT) -> str:
    """The module's text for ``info``: a literal dict, formatted by ``ruff format``."""
    source = HEADER + _literal(info, 4, len("return ")) + "\n"
    formatted = subprocess.run(
        [_ruff(), "format", "--stdin-filename", str(output), "-"],
        input=source,
        capture_output=True,
        text=True,
        cwd=ROOT,  # the project's [tool.ruff] settings (line length)
        check=False,
    )
    if formatted.returncode != 0:
        raise SystemExit(f"provider_info: ruff format failed:\n{formatted.stderr}")
    return formatted.stdout


BROKERS_BEGIN = "# -- brokers: written from airflow_shared_stream_provider/brokers.py by scripts/provider_info.py --\n"
BROKERS_END = "# -- end of the brokers --\n"


def broker_sections() -> dict[str, Any]:
    """``integrations``, ``triggers`` and ``queues`` as the registry says, one item per broker."""
    from airflow_shared_stream_provider.brokers import BROKERS

    return {
        "integrations": [
            {"integration-name": s.integration_name, "external-doc-url": s.external_doc_url, "tags": list(s.tags)}
            for s in BROKERS
        ],
        "triggers": [{"integration-name": s.integration_name, "python-modules": [s.trigger_module]} for s in BROKERS],
        "queues": [s.queue_provider_path for s in BROKERS],
    }


def broker_block() -> str:
    """The YAML text between the markers (written in provider.yaml's own style, checked by parsing it back)."""
    sections = broker_sections()
    lines = ["integrations:"]
    for item in sections["integrations"]:
        lines += [
            f"  - integration-name: {item['integration-name']}",
            f"    external-doc-url: {item['external-doc-url']}",
            f"    tags: [{', '.join(item['tags'])}]",
        ]
    lines.append("triggers:")
    for item in sections["triggers"]:
        lines += [f"  - integration-name: {item['integration-name']}", "    python-modules:"]
        lines += [f"      - {module}" for module in item["python-modules"]]
    lines.append("queues:")
    lines += [f"  - {path}" for path in sections["queues"]]
    block = "\n".join(lines) + "\n"
    if yaml.safe_load(block) != sections:  # a value YAML would read differently written plain
        raise SystemExit(f"provider_info: the registry's broker sections do not round-trip as YAML:\n{block}")
    return block


def with_broker_block(text: str, provider_yaml: Path) -> str:
    """``provider.yaml``'s text with the block between the markers replaced by :func:`broker_block`."""
    begin, end = text.find(BROKERS_BEGIN), text.find(BROKERS_END)
    if begin < 0 or end < begin:
        raise SystemExit(f"provider_info: {provider_yaml} lacks the broker markers:\n{BROKERS_BEGIN}{BROKERS_END}")
    return text[: begin + len(BROKERS_BEGIN)] + broker_block() + text[end:]


def load(provider_yaml: Path = PROVIDER_YAML, text: str | None = None) -> dict[str, Any]:
    info = yaml.safe_load(provider_yaml.read_text() if text is None else text)
    if not isinstance(info, dict):
        raise SystemExit(f"provider_info: {provider_yaml} is not a mapping")
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="exit 1 if the module differs from provider.yaml")
    parser.add_argument("--provider-yaml", type=Path, default=PROVIDER_YAML)
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args(argv)

    yaml_text = args.provider_yaml.read_text()
    expected_yaml = with_broker_block(yaml_text, args.provider_yaml)
    expected = render(load(args.provider_yaml, expected_yaml), args.output)
    current = args.output.read_text() if args.output.exists() else ""
    if args.check:
        if yaml_text != expected_yaml:
            diff = difflib.unified_diff(
                yaml_text.splitlines(keepends=True),
                expected_yaml.splitlines(keepends=True),
                fromfile=f"{args.provider_yaml} (on disk)",
                tofile=f"{args.provider_yaml} (brokers from airflow_shared_stream_provider/brokers.py)",
            )
            sys.stderr.write("".join(diff))
            sys.stderr.write(
                f"provider_info: {args.provider_yaml.name}'s broker sections differ from the broker registry; "
                "run: .venv/bin/python -m scripts.provider_info\n"
            )
            return 1
        if current == expected:
            print(f"provider_info: {args.output.name} matches {args.provider_yaml.name}")
            return 0
        diff = difflib.unified_diff(
            current.splitlines(keepends=True),
            expected.splitlines(keepends=True),
            fromfile=f"{args.output} (on disk)",
            tofile=f"{args.output} (from {args.provider_yaml.name})",
        )
        sys.stderr.write("".join(diff))
        sys.stderr.write(
            f"provider_info: {args.output.name} is out of date with {args.provider_yaml.name}; "
            "run: .venv/bin/python -m scripts.provider_info\n"
        )
        return 1
    if yaml_text != expected_yaml:
        args.provider_yaml.write_text(expected_yaml)
        print(f"provider_info: wrote the broker sections of {args.provider_yaml}")
    if current != expected:
        args.output.write_text(expected)
        print(f"provider_info: wrote {args.output}")
    else:
        print(f"provider_info: {args.output.name} already up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
