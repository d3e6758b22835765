"""The screening benchmark runs as documented, at a small size, and its RESULTS.md section reads its file."""

import json
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import bench_screening  # noqa: E402
from reporting.screening import screening_section  # noqa: E402


def test_the_benchmark_writes_both_arms_and_the_section_compares_them(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_screening, "ACCEPTANCE", (0.25,))
    bench_screening.main(["--latency", "0.05", "--batches", "2", "--out", str(tmp_path)])
    document = json.loads((tmp_path / "screening.json").read_text())
    assert [row["arm"] for row in document["rows"]] == ["ahead", "one per slot"]
    assert all(row["rounds_later"] >= 1.0 and row["pilots_per_batch"] >= bench_screening.B for row in document["rows"])
    text = "\n".join(screening_section(document, 8))
    assert "## 8. Screening by pilots" in text and "| 25% | ahead |" in text and document["command"] in text
