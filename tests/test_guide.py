"""The recipe author's guide (recipes/adding-an-architecture.md): it ships inside the package (the
wheel included), the error for an unknown architecture names where it is installed, and its Gemma 2
walkthrough (§4) and config-key example (§5) run as written — the Python that builds the
checkpoint, the draft and final recipes and every `$ thinconv …` command are taken from the guide
itself, and every fragment of output it shows must appear in the real output. And README's family
table lists every built-in recipe."""

from __future__ import annotations

import importlib.resources
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from conftest import BIN
from thinconv.errors import RecipeError
from thinconv.format.reader import open_archive
from thinconv.recipe import GUIDE_NAME, guide_path, load_registry

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "recipes" / GUIDE_NAME
# Every fenced block, named when an HTML marker precedes it: <!-- guide: NAME --> then ```lang … ```
FENCED = re.compile(r"(?:<!-- guide: (?P<name>[\w-]+) -->\n)?```(?P<lang>\w*)\n(?P<body>.*?)```", re.S)


def _guide_path_in(message: str) -> Path:
    found = re.search(r"\(guide: (.+?)\)$", message)
    assert found, message
    return Path(found.group(1))


def test_the_guide_is_package_data():
    resource = importlib.resources.files("thinconv.builtin_recipes") / GUIDE_NAME
    assert resource.is_file()
    assert resource.read_text(encoding="utf-8") == GUIDE.read_text(encoding="utf-8")
    assert Path(guide_path()) == Path(str(resource))


def test_an_unknown_architecture_names_the_installed_guide():
    with pytest.raises(RecipeError) as e:
        load_registry().for_architecture(["FancyNetForCausalLM"])
    path = _guide_path_in(str(e.value))
    assert path.is_file() and path.name == GUIDE_NAME
    assert path.read_text(encoding="utf-8").startswith("# How to add an architecture")


@pytest.mark.slow
def test_the_wheel_carries_the_guide_and_its_error_names_the_installed_copy(tmp_path):
    """Build the wheel (offline: the venv's setuptools), unpack it as pip would into a site folder,
    and import thinconv from there: the guide is in it, and the error names that copy."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("thinconv", "recipes"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp_path / "dist"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(dist), str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    (wheel,) = dist.glob("thinconv-*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        assert f"thinconv/builtin_recipes/{GUIDE_NAME}" in z.namelist()
        z.extractall(site)
    code = ("import thinconv, thinconv.recipe as r\n"
            "print(thinconv.__file__)\n"
            "try:\n    r.load_registry().for_architecture(['FancyNetForCausalLM'])\n"
            "except r.RecipeError as e:\n    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(site)})
    assert r.returncode == 0, r.stderr
    module_file, message = r.stdout.strip().splitlines()
    assert Path(module_file).is_relative_to(site), module_file  # the unpacked wheel, not the checkout
    path = _guide_path_in(message)
    assert path.is_file() and path.is_relative_to(site), path
    assert path.read_bytes() == GUIDE.read_bytes()


def test_the_walkthrough_recipe_is_the_builtin_gemma2():
    """§4's final recipe says what recipes/gemma2.toml says (only the name and description differ)."""
    blocks = {m["name"]: m["body"] for m in FENCED.finditer(GUIDE.read_text(encoding="utf-8")) if m["name"]}
    mine = tomllib.loads(blocks["recipe"])
    builtin = tomllib.loads((ROOT / "recipes" / "gemma2.toml").read_text(encoding="utf-8"))
    for key in ("extends", "architectures", "tensors", "model", "config"):
        assert mine.get(key) == builtin.get(key), key
    assert set(mine) == set(builtin)


def _run(command: str, cwd: Path) -> subprocess.CompletedProcess:
    argv = shlex.split(command)
    assert argv[0] == "thinconv", command
    env = {**os.environ, "COLUMNS": "200", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    return subprocess.run([str(BIN), *argv[1:]], cwd=cwd, capture_output=True, text=True, env=env, timeout=600)


def _check_block(body: str, cwd: Path) -> list[str]:
    """Run each `$ thinconv …` line of a shown terminal session; every fragment of the output lines
    shown under it (split at the elisions … and […]) must be in the real output, and the exit code
    is 1 exactly when the guide shows a `problem:` or `error:` line."""
    ran = []
    sessions = re.split(r"^\$ ", body, flags=re.M)[1:]
    for session in sessions:
        command, *shown = session.rstrip("\n").split("\n")
        command = command.split("  #")[0].strip()
        r = _run(command, cwd)
        output = r.stdout + r.stderr
        failing = any(line.startswith(("problem:", "error:")) for line in shown)
        assert r.returncode == (1 if failing else 0), f"{command}: exit {r.returncode}\n{output}"
        for line in shown:
            for fragment in re.split(r"\[…\]|…", line):
                assert fragment.strip() in output, f"{command}: {fragment.strip()!r} not in:\n{output}"
        ran.append(command)
    return ran


@pytest.mark.slow
def test_the_gemma2_walkthrough_runs_as_written(tmp_path):
    """§4 step by step, from the guide's own blocks, in a folder laid out like the repo's root."""
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "tiny-llama").symlink_to(ROOT / "examples" / "tiny-llama")
    text = GUIDE.read_text(encoding="utf-8")
    start, end = text.index("## 4. "), text.index("## 6. ")
    ran: list[str] = []
    for m in FENCED.finditer(text[start:end]):
        name = m["name"]
        if name == "build":
            (tmp_path / "build.py").write_text(m["body"], encoding="utf-8")
            r = subprocess.run([sys.executable, "build.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                               env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})
            assert r.returncode == 0, r.stderr
        elif name in ("draft", "recipe"):
            (tmp_path / "my-recipes").mkdir(exist_ok=True)
            (tmp_path / "my-recipes" / "mygemma2.toml").write_text(m["body"], encoding="utf-8")
        elif name == "softcap":  # §5's example: the tiny Llama with a soft-capping key it does not read
            shutil.copytree(ROOT / "examples" / "tiny-llama", tmp_path / "llama-with-softcap")
            config = json.loads((tmp_path / "llama-with-softcap" / "config.json").read_text())
            config["attn_logit_softcapping"] = 50.0
            (tmp_path / "llama-with-softcap" / "config.json").write_text(json.dumps(config, indent=2))
            ran += _check_block(m["body"], tmp_path)
        elif not m["lang"] and "$ thinconv" in m["body"]:
            ran += _check_block(m["body"], tmp_path)
    assert any(c.startswith("thinconv check g2.thin --against") for c in ran), ran
    assert any(c.startswith("thinconv convert llama-with-softcap") for c in ran), ran
    # the archive says what the built-in recipe writes, but for the recipe's name
    built = _run("thinconv gemma2 tiny-gemma2 builtin.thin --no-probe", tmp_path)
    assert built.returncode == 0, built.stderr
    with open_archive(tmp_path / "g2.thin") as mine, open_archive(tmp_path / "builtin.thin") as theirs:
        assert mine.manifest["model"] == {**theirs.manifest["model"], "architecture": "mygemma2"}


def test_the_readme_family_table_lists_every_builtin_recipe():
    """README's "Model families" table: one row per built-in recipe, with the architecture it handles."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## Model families"):text.index("## Python API")]
    rows = dict(re.findall(r"^\| `(\w+)` \| `(\w+)` \|", section, re.M))
    builtin = {name: r.architectures for name, r in load_registry().recipes.items()}
    assert set(rows) == set(builtin)
    for name, arch in rows.items():
        assert builtin[name] == (arch,), name


@pytest.mark.parametrize("norm_topk", [False, True])
def test_the_routing_format_md_gives_is_the_decoders(norm_topk):
    """FORMAT.md §2.3.7's routing (softmax over all experts, the k largest with ties to the lower
    index, optional renormalisation), written out here, picks what thinconv's decoder picks —
    exact ties included."""
    import numpy as np

    from thinconv import nn

    rng = np.random.default_rng(3)
    cases = [rng.standard_normal(8).astype(np.float32) for _ in range(50)]
    cases += [np.array([0.5, 2.0, 2.0, -1.0, 2.0, 0.0], np.float32), np.zeros(5, np.float32)]  # exact ties
    for logits in cases:
        for k in (1, 2, 3):
            z = np.exp(logits - logits.max())
            p = z / z.sum()
            chosen = sorted(range(len(p)), key=lambda e: (-p[e], e))[:k]
            w = p[chosen] / p[chosen].sum() if norm_topk else p[chosen]
            ids, weights = nn.route(logits, k, norm_topk)
            assert list(ids) == chosen, (logits, k)
            np.testing.assert_allclose(weights, w, rtol=1e-6)
