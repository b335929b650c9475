"""The pack-tools CLI: help, exit codes, error messages, the console script."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pack_tools.cli import main
from pack_tools.origin import ENGRAM, EXL3
from pack_tools.presets.tiny_v41 import TinyV41


def run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        rc = main(list(argv))
    except SystemExit as e:  # argparse: --help / usage errors
        rc = int(e.code or 0)
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("cmd", ["download", "build", "verify", "inspect", "synth"])
def test_subcommand_help(capsys, cmd):
    rc, out, _ = run(capsys, cmd, "--help")
    assert rc == 0 and f"usage: pack-tools {cmd}" in out


def test_top_level_help_and_usage_errors(capsys):
    rc, out, _ = run(capsys, "--help")
    assert rc == 0
    for cmd in ("download", "build", "verify", "inspect", "synth"):
        assert cmd in out
    rc, _, err = run(capsys)
    assert rc == 2 and "required" in err
    rc, _, err = run(capsys, "build", "--exl3", "x")
    assert rc == 2 and "--engram" in err
    rc, _, err = run(capsys, "synth", "--preset", "nope", "--out", "x")
    assert rc == 2 and "invalid choice: 'nope'" in err


def test_console_script_is_installed():
    exe = Path(sys.executable).parent / "pack-tools"
    exe_path = str(exe) if exe.exists() else shutil.which("pack-tools")
    assert exe_path, "the pack-tools console script is not installed"
    r = subprocess.run([exe_path, "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("pack-tools ")


def test_synth_build_verify_inspect_roundtrip(capsys, tmp_path):
    rc, out, _ = run(capsys, "synth", "--preset", "tiny-v41", "--out", str(tmp_path), "--quiet")
    assert rc == 0 and out.strip() == str(tmp_path)
    pack = tmp_path / "pack"
    rc, out, err = run(capsys, "build", "--exl3", str(tmp_path / EXL3.dirname), "--engram",
                       str(tmp_path / ENGRAM.dirname), "--out", str(pack))  # fmt: skip
    assert rc == 0 and out.strip() == str(pack)
    assert "wrote manifest.json" in err and "pack ready" in err
    rc, out, _ = run(capsys, "verify", str(pack))
    assert (rc, out.strip()) == (0, f"OK {pack}")
    rc, out, _ = run(capsys, "inspect", str(pack), "--json")
    info = json.loads(out)
    assert rc == 0 and info["layers"] == TinyV41().layers and info["experts"] == TinyV41().experts
    rc, out, _ = run(capsys, "inspect", str(pack))
    assert rc == 0 and "bytes per tier" in out
    # a damaged pack: exit 1, one line per problem on stdout
    (pack / "woa-layers-0.safetensors").unlink()
    rc, out, err = run(capsys, "verify", str(pack))
    assert rc == 1
    assert out.splitlines() == [
        "woa-layers-0.safetensors: missing (generated file listed in manifest.json); "
        "1 indexed tensors unavailable, e.g. layers.0.attn.wo_a.weight"
    ]
    assert "1 problem(s)" in err
    # rebuilding over an existing pack needs --force
    rc, _, err = run(capsys, "build", "--exl3", str(tmp_path / EXL3.dirname), "--engram",
                     str(tmp_path / ENGRAM.dirname), "--out", str(pack), "--quiet")  # fmt: skip
    assert rc == 2 and "already exists (use --force" in err
    rc, _, _ = run(capsys, "build", "--exl3", str(tmp_path / EXL3.dirname), "--engram",
                   str(tmp_path / ENGRAM.dirname), "--out", str(pack), "--quiet", "--force")  # fmt: skip
    assert rc == 0
    assert run(capsys, "verify", str(pack))[0] == 0


def test_build_error_names_the_input(capsys, tmp_path):
    rc, _, err = run(capsys, "build", "--exl3", str(tmp_path / "missing"), "--engram", str(tmp_path),
                     "--out", str(tmp_path / "p"))  # fmt: skip
    assert rc == 2
    assert err.startswith("pack-tools: error: ") and str(tmp_path / "missing" / "config.json") in err


def test_verify_and_inspect_errors(capsys, tmp_path):
    rc, out, _ = run(capsys, "verify", str(tmp_path / "nope"))
    assert rc == 1 and "does not exist" in out
    rc, _, err = run(capsys, "inspect", str(tmp_path / "nope"))
    assert rc == 2 and "not a directory" in err
    rc, _, err = run(capsys, "verify", str(tmp_path), "--max-lines", "0")
    assert rc == 2 and "--max-lines" in err


def test_synth_options_and_missing_preset(capsys, tmp_path, monkeypatch):
    rc, _, err = run(capsys, "synth", "--preset", "tiny-v41", "--out", str(tmp_path / "t"), "--experts", "4")
    assert rc == 2 and "--experts: only for --preset flash-layer" in err
    rc, _, err = run(capsys, "synth", "--preset", "flash-layer", "--out", str(tmp_path / "f"), "--hidden", "100",
                     "--quiet")  # fmt: skip
    assert rc == 2 and "FlashLayer.hidden" in err
    rc, out, _ = run(capsys, "synth", "--preset", "flash-layer", "--out", str(tmp_path / "f"), "--experts", "2",
                     "--hidden", "128", "--intermediate", "128", "--quiet")  # fmt: skip
    assert rc == 0 and (tmp_path / "f" / "model.safetensors.index.json").exists()
    from pack_tools.presets import PRESETS

    monkeypatch.setitem(PRESETS, "tiny-demo", ("pack_tools.presets.tiny_demo_absent_for_test", "synth_tiny_demo"))
    rc, _, err = run(capsys, "synth", "--preset", "tiny-demo", "--out", str(tmp_path / "d"))
    assert rc == 2 and "preset 'tiny-demo' is not available" in err


def test_download_cli(capsys, tmp_path, fake_hub):
    token = tmp_path / "token"
    token.write_text("secret\n")
    rc, out, _ = run(capsys, "download", "--models-root", str(tmp_path / "m"), "--only", "engram",
                     "--token-file", str(token), "--quiet")  # fmt: skip
    assert rc == 0 and out.strip() == f"engram: {tmp_path / 'm' / ENGRAM.dirname}"
    assert [(c["repo_id"], c["revision"], c["token"]) for c in fake_hub.download_calls] == [
        (ENGRAM.repo_id, ENGRAM.revision, "secret")
    ]
    rc, out, _ = run(capsys, "download", "--models-root", str(tmp_path / "m2"), "--dry-run")
    assert rc == 0 and "model-00048-of-00048.safetensors" in out and "README.md" not in out
    assert len(fake_hub.download_calls) == 1  # dry run fetched nothing
    rc, _, err = run(capsys, "download", "--models-root", str(tmp_path), "--token-file", str(tmp_path / "none"))
    assert rc == 2 and "--token-file" in err
