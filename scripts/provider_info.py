"""
Generate ``airflow_shared_stream_provider/get_provider_info.py`` from ``provider.yaml``.

``provider.yaml`` is the one source of the provider's metadata, as in Apache Airflow's own
providers (whose ``get_provider_info.py`` is generated from it by breeze): edit the YAML, then run

    .venv/bin/python -m scripts.provider_info            # rewrite get_provider_info.py
    .venv/bin/python -m scripts.provider_info --check    # exit 1 if it differs (scripts/test.sh runs this)

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


def load(provider_yaml: Path = PROVIDER_YAML) -> dict[str, Any]:
    info = yaml.safe_load(provider_yaml.read_text())
    if not isinstance(info, dict):
        raise SystemExit(f"provider_info: {provider_yaml} is not a mapping")
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="exit 1 if the module differs from provider.yaml")
    parser.add_argument("--provider-yaml", type=Path, default=PROVIDER_YAML)
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args(argv)

    expected = render(load(args.provider_yaml), args.output)
    current = args.output.read_text() if args.output.exists() else ""
    if args.check:
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
    if current != expected:
        args.output.write_text(expected)
        print(f"provider_info: wrote {args.output}")
    else:
        print(f"provider_info: {args.output.name} already up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
