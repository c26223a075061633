"""The `model` schema (thinconv/format/schema.py) is the one home of the `model` section: the
validator, the writer's canonical form and FORMAT.md all follow it. Each test here is generated
from the schema's rows, so a new key is covered the moment it is added."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest

from factory import make_archive_inputs, tiny_model
from thinconv.format import schema, validate_manifest

FORMAT_MD = Path(__file__).resolve().parent.parent / "FORMAT.md"
BASE = make_archive_inputs(tiny_model())[0]
KEYS = schema.MODEL_KEYS
WRONG_TYPE = {"str": 7, "int": "7", "number": "7", "bool": 1, "object": "x", "layers": "full", "layer_flags": [1],
              "token": "1", "tokens": 1, "scaling": "linear"}


def _set(model: dict, path: str, value) -> None:
    *parents, last = path.split(".")
    node = model
    for p in parents:
        node = node.setdefault(p, {})
    if value is _DEL:
        node.pop(last, None)
    else:
        node[last] = value


_DEL = object()


def _errors(mutate) -> list[tuple[str, str]]:
    m = copy.deepcopy(BASE)
    mutate(m["model"])
    return validate_manifest(m).errors


def test_format_md_carries_the_schema_table():
    text = FORMAT_MD.read_text(encoding="utf-8")
    found = re.search(r"<!-- model-keys: begin -->\n(.*?)<!-- model-keys: end -->", text, re.S)
    assert found, "FORMAT.md lost its model-keys table"
    assert found.group(1) == schema.markdown_table(), "FORMAT.md's model key table differs from the schema"


def test_the_base_model_is_valid():
    assert validate_manifest(BASE).ok


@pytest.mark.parametrize("key", [k for k in KEYS if not k.optional], ids=lambda k: k.path)
def test_a_missing_required_key_is_reported(key):
    errors = _errors(lambda m: _set(m, key.path, _DEL))
    assert (f"model.{key.path}", "missing") in errors, errors


@pytest.mark.parametrize("key", KEYS, ids=lambda k: k.path)
def test_a_value_of_the_wrong_type_is_reported(key):
    errors = _errors(lambda m: _set(m, key.path, WRONG_TYPE[key.type]))
    assert any(p.startswith(f"model.{key.path}") and "expected" in msg for p, msg in errors), errors


@pytest.mark.parametrize("key", [k for k in KEYS if k.choices], ids=lambda k: k.path)
def test_a_value_outside_the_choices_is_reported(key):
    bad = ["something-else"] * BASE["model"]["num_layers"] if key.type == "layers" else "something-else"
    errors = _errors(lambda m: _set(m, key.path, bad))
    want = f"model.{key.path}" + ("[0]" if key.type == "layers" else "")
    assert any(p == want and "expected one of" in msg for p, msg in errors), errors


@pytest.mark.parametrize("parent", sorted({k.parent for k in KEYS if k.type != "object"} | {""}))
def test_an_unknown_key_is_reported(parent):
    path = f"{parent}.not_a_key" if parent else "not_a_key"
    errors = _errors(lambda m: _set(m, path, 1))
    assert (f"model.{path}", "unknown key") in errors, errors


def _explicit_default(key: schema.Key):
    return [True] * BASE["model"]["num_layers"] if key.type == "layer_flags" else copy.deepcopy(key.default)


@pytest.mark.parametrize("key", [k for k in KEYS if k.optional], ids=lambda k: k.path)
def test_an_explicit_default_is_refused_and_the_writer_omits_it(key):
    errors = _errors(lambda m: _set(m, key.path, _explicit_default(key)))
    assert any(p == f"model.{key.path}" and "is the default" in msg for p, msg in errors), errors
    m = copy.deepcopy(BASE["model"])
    _set(m, key.path, _explicit_default(key))
    assert schema.canonical_model(m) == BASE["model"]


def test_value_supplies_defaults_and_requires_required_keys():
    m = BASE["model"]
    assert schema.value(m, "norm.eps") == m["norm"]["eps"]
    for key in (k for k in KEYS if k.optional):
        assert schema.value(m, key.path) == _explicit_default(key)
    with pytest.raises(KeyError):
        schema.value({k: v for k, v in m.items() if k != "norm"}, "norm.eps")
