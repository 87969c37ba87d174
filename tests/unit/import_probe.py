"""
What a fresh interpreter loads: the one subprocess behind the import-hygiene checks.

``python -m tests.unit.import_probe`` reads a JSON request on stdin and prints one JSON answer. It
runs in a new interpreter because the test run itself has imported every SDK long before. One
process answers every question for every broker (each question used to cost its own interpreter,
about 4 s of Airflow import each, some 80 s of the unit suite per Python version). The order
matters and is kept here:

1. ``quiet``: import the modules that Dag files import (package root, registry, queues, every
   trigger module, every ``_core`` module) and build each broker's trigger from the example
   arguments (construct, ``serialize()``, ``shared_stream_key()``); report every SDK module then
   loaded. Nothing has loaded an SDK yet, so anything found was loaded by those modules.
2. ``blocked``: per broker, every module under its SDK prefixes made unimportable, its producer
   module imported; report the exception's class names and text (the install hint).
3. ``producers``: the blockers removed, each producer imported for real; report which modules
   under its own SDK prefixes it loaded (a prefix the producer never loads would make 1 vacuous).
"""

from __future__ import annotations

import importlib
import json
import sys
from importlib.machinery import ModuleSpec
from typing import Any


class BlockPrefixes:
    """A meta path finder that fails every import under ``prefixes`` as a missing package would."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        self.prefixes = prefixes

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> ModuleSpec | None:
        if name.startswith(self.prefixes):
            raise ModuleNotFoundError(f"blocked by the import probe: {name}", name=name)
        return None


def loaded(prefixes: tuple[str, ...] | list[str]) -> list[str]:
    return sorted(name for name in sys.modules if name.startswith(tuple(prefixes)))


def probe(request: dict[str, Any]) -> dict[str, Any]:
    all_sdk = tuple(request["sdk_prefixes"])
    for module in request["quiet_modules"]:
        importlib.import_module(module)
    for broker in request["brokers"]:
        module_name, _, class_name = broker["trigger"].partition(":")
        trigger = getattr(importlib.import_module(module_name), class_name)(**broker["example"])
        trigger.serialize()
        trigger.shared_stream_key()
    answer: dict[str, Any] = {"quiet": loaded(all_sdk), "blocked": {}, "producers": {}}

    for broker in request["brokers"]:
        blocker = BlockPrefixes(tuple(broker["sdk_modules"]))
        sys.meta_path.insert(0, blocker)
        try:
            importlib.import_module(broker["producer_module"])
            answer["blocked"][broker["name"]] = {"classes": [], "message": "imported without its SDK"}
        except BaseException as exc:  # what is raised is the answer
            classes = [cls.__name__ for cls in type(exc).__mro__]
            answer["blocked"][broker["name"]] = {"classes": classes, "message": str(exc)}
        finally:
            sys.meta_path.remove(blocker)

    # A failed import leaves no half module behind; this also drops what succeeded beside it, so
    # every producer below is imported whole, with its SDK.
    for name in [name for name in sys.modules if name.startswith(request["producers_package"])]:
        del sys.modules[name]
    for broker in request["brokers"]:
        importlib.import_module(broker["producer_module"])
        answer["producers"][broker["name"]] = loaded(broker["sdk_modules"])
    return answer


if __name__ == "__main__":
    print("IMPORT_PROBE=" + json.dumps(probe(json.load(sys.stdin))))
