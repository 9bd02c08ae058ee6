"""Hostile or malformed spec files: each gives one clear `SpecError` (FILE: where: what), never a traceback."""

from __future__ import annotations

import json

import pytest

from pbkv.workloads import SpecError, load_spec

AGENT = {"prompt": 100, "output": 10}


def small(**flow) -> dict:
    """A minimal valid spec (one agent `a`), with `flow` fields replaced."""
    return {"name": "x", "agents": {"a": dict(AGENT)}, "task": {"tokens": 50},
            "flow": {"start": "a", **flow}}


def write(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_json_repeated_key_is_an_error_naming_its_line(tmp_path):
    text = ('{"name": "dup",\n "agents": {"a": {"prompt": 100, "output": 10},\n'
            '            "a": {"prompt": 5000, "output": 10}},\n'
            ' "task": {"tokens": 50}, "flow": {"start": "a", "max_steps": 3}}\n')
    with pytest.raises(SpecError, match=r"/dup.json:3: not valid JSON: duplicate key 'a'$"):
        load_spec(write(tmp_path, "dup.json", text))
    nested = json.dumps(small()).replace('"tokens": 50', '"tokens": 50, "tokens": 60')
    with pytest.raises(SpecError, match=r"/n.json:1: not valid JSON: duplicate key 'tokens'$"):
        load_spec(write(tmp_path, "n.json", nested))
    assert load_spec(write(tmp_path, "ok.json", json.dumps(small()))).agents["a"].prompt == 100
