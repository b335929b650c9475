"""The benchmark CLI runs end to end on tiny files and reports every case."""

from __future__ import annotations

import json

from engram_mmap.bench import main


def test_bench_cli_tiny(tmp_path, capsys) -> None:
    out = tmp_path / "bench.json"
    argv = ["--dir", str(tmp_path), "--cold-mib", "4", "--cached-mib", "2", "--tokens", "1,100", "--threads", "4",
            "--steps", "3", "--steps-large", "2", "--ceiling-reads", "400", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "ceiling O_DIRECT 4 KiB random reads" in text and "cached gather 100 tok (4800 rows)" in text
    result = json.loads(out.read_text())
    cases = {c["case"]: c for c in result["cases"]}
    gathers = {f"{kind}/{n}tok" for kind in ("cold", "cold-rs", "cached") for n in (1, 100)}
    assert set(cases) == gathers | {"hash/1tok", "hash/100tok"}
    for name in gathers:
        c = cases[name]
        assert c["rows"] == 48 * c["tokens"] and c["rows_per_s"] > 0
        assert c["ratio"] == c["rows_per_s"] / c["ceiling_reads_per_s"]
    assert result["ceilings"]["cold"]["mode"] == "O_DIRECT" and result["ceilings"]["cold"]["reads_per_s"] > 0
    # The files are reused by a second run (nothing rewritten).
    assert main(argv[:-2]) == 0
    assert "writing" not in capsys.readouterr().out
