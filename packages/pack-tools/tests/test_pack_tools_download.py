"""download: exactly the pinned repositories, revisions and files, against a fake hub (no network)."""

from __future__ import annotations

import hashlib
import json

import pytest

import pack_tools.download as dl
from pack_tools import PackError, download_inputs
from pack_tools.inputs import INPUT_RECEIPT
from pack_tools.origin import ENGRAM, EXL3


def test_downloads_exactly_the_pinned_files(tmp_path, fake_hub_factory):
    hub = fake_hub_factory()
    got = download_inputs(tmp_path, hub=hub, token="tok", max_workers=3)
    assert got == {"exl3": tmp_path / EXL3.dirname, "engram": tmp_path / ENGRAM.dirname}
    assert [(c["repo_id"], c["revision"]) for c in hub.download_calls] == [
        ("Mia-AiLab/DeepSeek-V4.1-Flash-EXL3-3.0bpw", "c5534b90602b4090980a1c3ded1eb3b4d99a38d5"),
        ("deepseek-ai/DeepSeek-V4.1-Flash", "2cba9e42aa026125f3ed06c6d98c1db82f7ca027"),
    ]
    assert hub.download_calls[1]["allow_patterns"] == [
        "config.json", "model.safetensors.index.json", "inference/engram.py",
        "model-00047-of-00048.safetensors", "model-00048-of-00048.safetensors",
    ]  # fmt: skip
    assert all(c["token"] == "tok" and c["max_workers"] == 3 for c in hub.download_calls)
    assert all(c[2] == "tok" for c in hub.list_calls)
    en = tmp_path / ENGRAM.dirname
    on_disk = sorted(p.relative_to(en).as_posix() for p in en.rglob("*") if p.is_file())
    assert on_disk == sorted([".pack-tools-input.json", "config.json", "inference/engram.py",
                              "model-00047-of-00048.safetensors", "model-00048-of-00048.safetensors",
                              "model.safetensors.index.json"])  # fmt: skip
    ex = tmp_path / EXL3.dirname
    assert not (ex / "README.md").exists() and not (ex / "images").exists()
    assert (ex / "chat_template.jinja").exists() and (ex / "model-00002-of-00002.safetensors").exists()
    receipt = json.loads((en / INPUT_RECEIPT).read_text())
    assert receipt["repo_id"] == ENGRAM.repo_id and receipt["revision"] == ENGRAM.revision
    assert receipt["files"]["model-00048-of-00048.safetensors"] == {
        "size": 40, "sha256": hashlib.sha256(b"z" * 40).hexdigest()
    }  # fmt: skip


def test_only_one_input(tmp_path, fake_hub_factory):
    hub = fake_hub_factory()
    download_inputs(tmp_path, ["engram"], hub=hub)
    assert [c["repo_id"] for c in hub.download_calls] == [ENGRAM.repo_id]
    assert not (tmp_path / EXL3.dirname).exists()


def test_short_file_is_reported(tmp_path, fake_hub_factory):
    with pytest.raises(PackError, match="model-00048-of-00048.safetensors: 39 bytes, the hub lists 40"):
        download_inputs(tmp_path, hub=fake_hub_factory(short="model-00048-of-00048.safetensors"))


def test_revision_missing_a_pinned_file(tmp_path, fake_hub_factory):
    hub = fake_hub_factory()
    del hub.repos[(ENGRAM.repo_id, ENGRAM.revision)]["inference/engram.py"]
    with pytest.raises(PackError, match="inference/engram.py: not in the repository at this revision"):
        download_inputs(tmp_path, hub=hub)
    assert hub.download_calls == []  # checked before any byte is fetched


def test_unknown_input_key(tmp_path, fake_hub_factory):
    with pytest.raises(PackError, match="unknown input 'weights'"):
        download_inputs(tmp_path, ["weights"], hub=fake_hub_factory())


def test_hf_adapter_passes_pinned_arguments(monkeypatch, tmp_path):
    """HfHub forwards to huggingface_hub exactly (functions replaced, so nothing reaches the network)."""
    import huggingface_hub

    seen: dict = {}

    def fake_snapshot(repo_id, **kw):
        seen["snapshot"] = (repo_id, kw)
        return str(kw["local_dir"])

    class Sib:
        def __init__(self, name, size, sha):
            self.rfilename, self.size = name, size
            self.lfs = {"sha256": sha, "size": size} if sha else None

    class FakeApi:
        def model_info(self, repo_id, **kw):
            seen["info"] = (repo_id, kw)
            return type(
                "Info",
                (),
                {"siblings": [Sib("model-00047-of-00048.safetensors", 5, "ab"), Sib("config.json", 2, None)]},
            )()

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot)
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    hub = dl.HfHub()
    files = hub.list_files(ENGRAM.repo_id, ENGRAM.revision, None)
    assert files == [dl.RemoteFile("model-00047-of-00048.safetensors", 5, "ab"), dl.RemoteFile("config.json", 2, None)]
    assert seen["info"] == (ENGRAM.repo_id, {"revision": ENGRAM.revision, "files_metadata": True, "token": None})
    hub.snapshot_download(ENGRAM.repo_id, ENGRAM.revision, list(ENGRAM.allow_patterns), tmp_path, 8, None)
    assert seen["snapshot"] == (ENGRAM.repo_id, {"revision": ENGRAM.revision, "allow_patterns": list(ENGRAM.allow_patterns),  # noqa: E501
                                                 "local_dir": tmp_path, "max_workers": 8, "token": None})  # fmt: skip


def test_download_receipt_feeds_deep_verify(tmp_path, tiny_inputs):
    """A receipt's sha256 (as download writes it) becomes the manifest's link hash; verify --deep uses it."""
    from pack_tools import verify_pack

    receipt_path = tiny_inputs.exl3 / INPUT_RECEIPT
    receipt = json.loads(receipt_path.read_text())
    receipt["files"]["model-00003-of-00003.safetensors"]["sha256"] = "0" * 64  # the hub says otherwise
    receipt_path.write_text(json.dumps(receipt))
    tiny_inputs.build()
    assert verify_pack(tiny_inputs.pack) == []
    assert verify_pack(tiny_inputs.pack, deep=True) == [
        "model-00003-of-00003.safetensors: content sha256 mismatch (flipped or corrupted bytes in the input shard)"
    ]
