"""Publishing: the model card's content (YAML front matter parsed for real, values checked), and
`upload` / `convert --upload-repo` against a mocked huggingface_hub.HfApi (no network)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from conftest import assert_one_line_error
from families import EXAMPLE, rewrite
from thinconv.cli import app
from thinconv.convert import convert_source
from thinconv.errors import PublishError
from thinconv.plan import ConvertOptions
from thinconv.publish import card_path, check_repo_id, model_card, upload, write_model_card

runner = CliRunner()
REPO, COMMIT = "example-org/Tiny-Llama", "0123456789abcdef0123456789abcdef01234567"


def _front_matter(text: str) -> tuple[dict, str]:
    assert text.startswith("---\n")
    head, body = text[4:].split("\n---\n", 1)
    return yaml.safe_load(head), body


def _hub_archive(tmp_path: Path, dtype: str = "q8_0") -> Path:
    """The example converted, then given a hub provenance (as if converted from REPO @ COMMIT)."""
    local = convert_source(EXAMPLE, tmp_path / "local.thin", options=ConvertOptions(dtype=dtype)).path

    def edit(m):
        m["validation"]["source"].update(repo_id=REPO, revision="main", commit=COMMIT)

    return rewrite(local, tmp_path / f"tiny-{dtype}.thin", edit)


class FakeApi:
    """Records what HfApi would have been asked to do."""

    instances: list["FakeApi"] = []
    fail_on: str | None = None

    def __init__(self, token=None, **kwargs):
        self.token, self.calls = token, []
        FakeApi.instances.append(self)

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))
        if FakeApi.fail_on == "create_repo":
            raise RuntimeError("401 Client Error: Unauthorized for url: https://huggingface.co/api/repos/create\nmore")
        return f"https://huggingface.co/{repo_id}"

    def upload_file(self, *, path_or_fileobj, path_in_repo, repo_id, **kwargs):
        data = Path(path_or_fileobj).read_bytes() if isinstance(path_or_fileobj, str) else path_or_fileobj
        self.calls.append(("upload_file", path_in_repo, repo_id, data, kwargs))


@pytest.fixture
def fake_hub(monkeypatch):
    import huggingface_hub

    FakeApi.instances, FakeApi.fail_on = [], None
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    return FakeApi


def test_card_front_matter_and_body(tmp_path):
    import thinconv

    thin = _hub_archive(tmp_path)
    check = {"ok": True, "reference": "probe", "dtype_class": "q8_0", "positions": 8, "max_abs_diff": 0.1,
             "max_rel_diff": 0.01, "top1_agreement": 1.0, "mean_kl": 2e-4, "max_kl": 6e-4}
    with thinconv.open(thin) as a:
        text = model_card(a, repo_id="me/tiny-thin", check=check)
        quant = a.manifest["validation"]["quant"]
        sizes = {t["name"]: math.prod(t["shape"]) for t in a.manifest["tensors"]}
        archive_hash = a.header.archive_hash.hex()
    meta, body = _front_matter(text)
    assert meta["base_model"] == REPO and meta["base_model_relation"] == "quantized"
    assert meta["library_name"] == "thinconv" and meta["pipeline_tag"] == "text-generation"
    assert {"thinconv", "llama", "q8_0", "quantized"} <= set(meta["tags"])
    t = meta["thinconv"]
    assert (t["source_repo"], t["source_revision"], t["source_commit"]) == (REPO, "main", COMMIT)
    assert t["dtype"] == "q8_0" and t["file"] == "tiny-q8_0.thin" and t["archive_hash"] == archive_hash
    assert t["recipe"] == "llama" and t["converter"].startswith("thinconv ")
    q = t["quantization"]
    assert q["tensors"] == len(quant) == 15
    want = sum(v["rel_rmse"] * sizes[n] for n, v in quant.items()) / sum(sizes[n] for n in quant)
    assert q["rel_rmse"] == pytest.approx(want, rel=1e-12)
    worst = max(quant, key=lambda n: quant[n]["rel_rmse"])
    assert q["worst"] == worst and q["worst_rel_rmse"] == quant[worst]["rel_rmse"]
    assert t["check"] == check
    # the body: title, provenance, how to run it, every quantized tensor, the check
    assert body.lstrip().startswith("# me/tiny-thin")
    assert COMMIT in body and f"https://huggingface.co/{REPO}" in body
    assert "hf download me/tiny-thin tiny-q8_0.thin" in body and "thinconv run tiny-q8_0.thin" in body
    for name, v in quant.items():
        assert f"| `{name}` | {v['rel_rmse']:.4g} | {v['rmse']:.4g} | {v['max_abs_err']:.4g} |" in body
    assert "**PASS**" in body and "the probe stored at conversion" in body


def test_card_of_a_float_local_archive(tmp_path):
    import thinconv

    thin = convert_source(EXAMPLE, tmp_path / "t.thin").path
    with thinconv.open(thin) as a:
        meta, body = _front_matter(model_card(a))
    assert "base_model" not in meta and "base_model_relation" not in meta  # a local source has no hub id
    assert "quantized" not in meta["tags"] and "bf16" in meta["tags"]
    assert meta["thinconv"]["quantization"] is None and meta["thinconv"]["source_repo"] is None
    assert "check" not in meta["thinconv"]
    assert "No tensor is block-quantized" in body and "Not run for this card" in body
    assert body.lstrip().startswith("# t.thin")


def test_upload_with_a_mocked_hub(tmp_path, fake_hub):
    thin = _hub_archive(tmp_path)
    res = upload(thin, "me/tiny-thin", run_check=True)
    (api,) = fake_hub.instances
    assert api.token == "hf_test_token"  # $HF_TOKEN
    create, up_archive, up_card = api.calls
    assert create[:2] == ("create_repo", "me/tiny-thin") and create[2]["exist_ok"] and create[2]["repo_type"] == "model"
    assert up_archive[1:3] == ("tiny-q8_0.thin", "me/tiny-thin") and up_archive[3] == thin.read_bytes()
    assert up_card[1:3] == ("README.md", "me/tiny-thin")  # the card last: it never describes a missing file
    meta, _ = _front_matter(up_card[3].decode("utf-8"))
    assert meta["thinconv"]["check"]["ok"] is True and meta["thinconv"]["check"]["reference"] == "probe"
    assert res.url == "https://huggingface.co/me/tiny-thin" and res.files == ["tiny-q8_0.thin", "README.md"]
    # an explicit token wins over $HF_TOKEN
    upload(thin, "me/tiny-thin", token="hf_explicit")
    assert fake_hub.instances[-1].token == "hf_explicit"


def test_upload_cli_and_its_refusals(tmp_path, fake_hub, monkeypatch):
    thin = _hub_archive(tmp_path)
    saved = tmp_path / "check.json"
    r = runner.invoke(app, ["check", str(thin), "--json"])
    assert r.exit_code == 0
    saved.write_text(r.stdout)
    r = runner.invoke(app, ["upload", str(thin), "me/tiny-thin", "--check-result", str(saved), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == {"repo_id": "me/tiny-thin", "url": "https://huggingface.co/me/tiny-thin",
                                    "files": ["tiny-q8_0.thin", "README.md"],
                                    "check": {"ok": True, "reference": "probe"}}
    card = fake_hub.instances[-1].calls[-1][3].decode()
    assert _front_matter(card)[0]["thinconv"]["check"]["max_abs_diff"] == json.loads(saved.read_text())["max_abs_diff"]
    n = len(fake_hub.instances)
    for args, code, needles in [
        (["not-a-repo-id"], 2, ("'not-a-repo-id'", "ORG/NAME")),
        (["me/x", "--check", "--check-result", str(saved)], 2, ("--check or --check-result",)),
        (["me/x", "--check-result", str(thin)], 1, ("not JSON",)),
    ]:
        r = runner.invoke(app, ["upload", str(thin), *args])
        assert r.exit_code == code, r.output
        assert_one_line_error(r.stderr, *needles)
    assert len(fake_hub.instances) == n  # nothing reached the hub
    # a hub failure is one line naming the step
    fake_hub.fail_on = "create_repo"
    r = runner.invoke(app, ["upload", str(thin), "me/x"])
    assert r.exit_code == 1
    assert_one_line_error(r.stderr, "me/x: creating the repo failed", "401 Client Error")
    fake_hub.fail_on = None
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = runner.invoke(app, ["upload", str(thin), "me/x"])
    assert_one_line_error(r.stderr, "HF_HUB_OFFLINE is set")


def test_upload_refuses_invalid_archives_and_failed_checks(tmp_path, fake_hub):
    thin = _hub_archive(tmp_path)
    data = bytearray(thin.read_bytes())
    data[-10] ^= 0xFF  # inside the last page: a checksum mismatch
    bad = tmp_path / "bad.thin"
    bad.write_bytes(bytes(data))
    with pytest.raises(PublishError, match="bad.thin is invalid, not uploaded: page .* checksum mismatch"):
        upload(bad, "me/x")

    def lie(m):  # a probe the archive does not reproduce
        for pos in m["validation"]["probe"]["positions"]:
            pos["logits"] = [x + 5.0 for x in pos["logits"]][:1] + pos["logits"][1:]

    liar = rewrite(thin, tmp_path / "liar.thin", lie)
    with pytest.raises(PublishError, match="liar.thin: check against its probe failed .*; not uploaded"):
        upload(liar, "me/x", run_check=True)
    assert all(not api.calls for api in fake_hub.instances)


def test_convert_upload_repo_and_model_card(tmp_path, fake_hub):
    out = tmp_path / "tiny.thin"
    r = runner.invoke(app, ["convert", str(EXAMPLE), str(out), "--dtype", "q8_0", "--model-card", "--upload-repo",
                            "me/tiny-thin"])
    assert r.exit_code == 0, r.output
    card = tmp_path / "tiny.README.md"
    assert card_path(out) == card and card.is_file()
    assert f"wrote model card {card}" in r.stdout and "published https://huggingface.co/me/tiny-thin" in r.stdout
    (api,) = fake_hub.instances
    assert [c[1] for c in api.calls] == ["me/tiny-thin", "tiny.thin", "README.md"]
    assert api.calls[2][3].decode() == card.read_text()  # the card written is the card uploaded
    meta, body = _front_matter(card.read_text())
    assert meta["thinconv"]["dtype"] == "q8_0" and body.lstrip().startswith("# me/tiny-thin")
    # --json: stdout is the conversion's JSON alone, the publishing lines go to stderr
    r = runner.invoke(app, ["convert", str(EXAMPLE), str(out), "--force", "--json", "--upload-repo", "me/tiny-thin"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["path"] == str(out) and "published" in r.stderr
    # a malformed repo id fails before converting
    r = runner.invoke(app, ["convert", str(EXAMPLE), str(tmp_path / "never.thin"), "--upload-repo", "bad id"])
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "--upload-repo", "'bad id'")
    assert not (tmp_path / "never.thin").exists()
    # --model-card alone: no hub at all
    n = len(fake_hub.instances)
    r = runner.invoke(app, ["convert", str(EXAMPLE), str(tmp_path / "other.thin"), "--model-card"])
    assert r.exit_code == 0 and (tmp_path / "other.README.md").is_file() and len(fake_hub.instances) == n
    assert "base_model" not in _front_matter((tmp_path / "other.README.md").read_text())[0]


def test_write_model_card_and_repo_ids(tmp_path):
    thin = _hub_archive(tmp_path, "bf16")
    path = write_model_card(thin)
    assert path == tmp_path / "tiny-bf16.README.md"
    meta, _ = _front_matter(path.read_text())
    assert meta["base_model"] == REPO and "base_model_relation" not in meta
    for good in ("me/x", "Org-1/Model_2.5-GGUF"):
        assert check_repo_id(good) == good
    for bad in ("x", "a/b/c", "/x", "a/", "a b/c", "a/..x", "a/x.git", ""):
        with pytest.raises(PublishError):
            check_repo_id(bad)
