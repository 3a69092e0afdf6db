"""The GPU check (scripts/gpu-check.sh), in its CPU form: small random-weight models, the
installed llama-cpp-python; and its carry, packed as for a GPU machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the GPU check's models, written and run

ROOT = Path(__file__).resolve().parent.parent
CARRY_LIMIT = 64 << 20  # what a device machine takes in, the working tree included


def test_the_gpu_check_runs_on_a_cpu_and_reports_every_figure(tmp_path, smollm2_path):
    out = tmp_path / "report"
    done = subprocess.run(
        ["scripts/gpu-check.sh", "--cpu", "--no-build", "--small", "--tokenizer", str(smollm2_path), "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env=os.environ | {"EDGESPEC_HOME": str(tmp_path / "home"), "PYTHON": sys.executable},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["machine"]["cpu"] and report["gpu_layers"] == 0
    costs = report["costs"]
    assert costs["verify_steps"]["1"] == 1.0 and {"2", "4", "8", "16", "32", "64"} <= set(costs["verify_steps"])
    assert costs["draft_step_s"] > 0
    # the ceiling is a perfect free draft's best rate, max over k of k / V(k) (in steps; its extremes lie at
    # measured points, V being linear between them)
    rate, size = max((int(k) / v, int(k)) for k, v in costs["verify_steps"].items())
    assert costs["ceiling"] == {"speedup": pytest.approx(rate, abs=0.01), "pass_size": size}
    equality = report["greedy_equality"]
    modes = {row["mode"] for row in equality}
    assert {"model", "copy", "hybrid", "auto", "copy+prediction"} <= modes
    assert all(row["equal"] for row in equality), [row for row in equality if not row["equal"]]
    shares = {(row["sampling"], row["case"]): row for row in report["python_share"]}
    assert set(shares) == {(s, m) for s in ("greedy", "sampled") for m in ("off γ=auto", "auto γ=auto", "model γ=4")}
    for row in shares.values():
        assert row["rounds"] > 0 and 0 <= row["python_share"] < 1 and row["target_passes_ms"] > 0
    assert shares["greedy", "model γ=4"]["draft_passes_ms"] > 0 and shares["greedy", "model γ=4"]["rounds"] < 40
    # llama.cpp's top-k on the backend: the same laws as whole rows for a single-token pass; a verify pass of
    # several outputs on one sequence, refused by 0.3.36, is reported so
    single, verify = report["backend_sampling"]["passes"]
    assert single["works"] and single["exact"] and single["pass_ms"]["backend_top_k"] > 0, single
    assert verify["rows"] == 5 and (verify["works"] and verify["exact"] or "refused" in verify["why"]), verify
    cases = {row["prompt"]: row["modes"] for row in report["known_alpha"]}
    assert cases["prediction = greedy answer (alpha 1)"]["copy"]["acceptance_rate"] > 0.95
    assert cases["draft model = target (alpha 1)"]["model"]["acceptance_rate"] > 0.95
    assert cases["random draft model (alpha ~0)"]["model"]["acceptance_rate"] < 0.2
    # (the rows' ceilings come from curves their runs moved, which the report does not hold: checked above)
    markdown = (out / "report.md").read_text()
    for heading in (
        "## Costs",
        "## Greedy equality",
        "## A round's time",
        "## llama.cpp's backend",
        "## Known acceptance",
    ):
        assert heading in markdown
    assert not (out / "models").exists()  # gigabytes on a GPU machine: not brought back


@pytest.mark.skipif(sys.platform != "linux", reason="packs a Linux build's sources with GNU tools")
def test_the_gpu_carry_fits_what_a_device_machine_takes(tmp_path):
    """gpu-pack.sh fetches and trims llama-cpp-python's sources and the wheels: with the
    working tree, well under the 64 MiB a device machine takes in."""
    done = subprocess.run(["scripts/gpu-pack.sh"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    carry = ROOT / "gpu-carry"
    wheels = {p.name.split("-")[0] for p in (carry / "wheels").iterdir()}
    assert {"gguf", "diskcache", "typing_extensions"} <= wheels
    assert (carry / "qwen-tokenizer.gguf.gz").is_file() and (carry / "llama-cpp-python.tar.gz").is_file()
    tree = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True
    ).stdout.split(b"\0")
    size = sum((ROOT / os.fsdecode(p)).stat().st_size for p in tree if p and (ROOT / os.fsdecode(p)).is_file())
    size += sum(p.stat().st_size for p in carry.rglob("*") if p.is_file())
    assert size < CARRY_LIMIT, f"{size >> 20} MiB"
