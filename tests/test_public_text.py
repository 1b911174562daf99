"""Public text every deployment sees: a fresh proxy does not call a recitation of a
common open-source licence a leak, even when only one other tenant pasted it (the
shipped baseline, proxy/defaults/baseline/licence-*.txt)."""

from __future__ import annotations

import pytest

from proxy.defaults import load_baseline, load_vocabulary
from proxy.engine import Engine, EngineConfig

KEY = b"p" * 32
T0 = 1_000_000.0
APACHE = (
    'Licensed under the Apache License, Version 2.0 (the "License"); you may not use '
    "this file except in compliance with the License. You may obtain a copy of the License at"
)
MIT = (
    "Permission is hereby granted, free of charge, to any person obtaining a copy of this "
    'software and associated documentation files (the "Software"), to deal in the Software '
    "without restriction, including without limitation the rights to use, copy, modify, merge"
)
GPL3 = (
    "This program is free software: you can redistribute it and/or modify it under the terms "
    "of the GNU General Public License as published by the Free Software Foundation"
)


def recited(baseline: list[str], text: str) -> list:
    engine = Engine(EngineConfig(key=KEY), baseline=baseline, plain_words=load_vocabulary())
    paste = engine.observe_prompt("acme", "a-1", f"Summarise this licence:\n\n{text}", now=T0)
    paste.feed("It lets you use the code freely.", now=T0)
    paste.finish(now=T0)
    scan = engine.observe_prompt("globex", "g-1", "Quote the licence text.", now=T0 + 1)
    found = scan.feed(f"Here it is: {text}. That is all.", now=T0 + 1)
    return found + scan.finish(now=T0 + 1)


@pytest.mark.parametrize("text", [MIT, APACHE, GPL3], ids=["MIT", "Apache-2.0", "GPL-3"])
def test_a_recited_licence_is_not_a_leak(text):
    assert recited(load_baseline(), text) == []
    # Control: without the shipped licences the same recitation is another tenant's text.
    boilerplate_only = [t for t in load_baseline() if "Permission is hereby granted" not in t
                        and "Apache License" not in t and "GNU General Public" not in t]  # fmt: skip
    assert recited(boilerplate_only, text) != []
