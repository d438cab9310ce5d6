"""`adloco-bench --quick`: the harness runs every section at toy size and writes both files."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from adloco.bench.suite import KEYS

import netns
from background import BENCH_SECTIONS, bench_quick, collect

ROOT = Path(__file__).resolve().parent.parent


def _bench(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "adloco.bench.suite", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.timeout(900)
def test_quick_run_writes_every_key_of_results_json_and_a_report_of_the_goals(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    # Every section but `system` (the next test), run from the session's start in the background
    # (tests/background.py); run alone, this test waits for it all the same.
    run = collect(request, request.node.nodeid, lambda: tmp_path, bench_quick)
    code, stdout, stderr = run.result(timeout=840)
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    out = run.folder / "out"
    results = json.loads((out / "results.json").read_text())
    meta = results["meta"]
    assert meta["seeds"] == [0] and meta["quick"] is True
    assert len(meta["commit"].removesuffix("+dirty")) == 40 and meta["machine"]["cpus"] >= 1
    ran = BENCH_SECTIONS.split(",")
    for name in ran:
        _check_section(name, results[name])
    assert results["system"]["status"] == "not run"
    assert results["overhead"]["status"] == "measured" and results["scale"]["status"] == "measured"
    assert results["scale"]["sim_peers_max"] >= 2 and results["scale"]["sim_bytes_over_bound_max"] <= 1.01
    tokens_per_s = results["overhead"]["tokens_per_s"]
    assert set(tokens_per_s) == {"bare", "bare_hf_loss", "node", "node_at_cap", "node_batch_test_off"}
    assert all(v > 0 for v in tokens_per_s.values())
    report = (out / "results.md").read_text()
    assert "## Goals (issue 11) against what was measured" in report
    assert "≥ 5,000× fewer bytes per token" in report and "≤ 3 % inner-step overhead" in report
    for name in ran:
        for png in (out / name).glob("*.png"):
            assert f"({name}/{png.name})" in report  # every plot a section drew is shown


@pytest.mark.netns
@pytest.mark.long
@pytest.mark.timeout(300)
def test_quick_system_section_runs_real_nodes_behind_shaped_links(tmp_path: Path) -> None:
    why = netns.available()
    if why is not None:
        pytest.skip(why)
    done = _bench("--quick", "--sections", "system", "--out", str(tmp_path), timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    system = json.loads((tmp_path / "results.json").read_text())["system"]
    _check_section("system", system)
    assert system["status"] == "measured"
    (run,) = system["runs"]
    assert run["rate_mbit"] == 100 and run["utilization"] > 0 and run["bytes_sent_per_round"] > 0
    assert not [ns for ns in netns.namespaces() if ns.startswith(netns.BASE)], "namespaces left behind"


def _check_section(name: str, section: dict[str, object]) -> None:
    assert set(KEYS[name]) <= set(section), name
    assert section["status"] in ("measured", "not measured"), (name, section.get("error"))
    if section["status"] == "measured":
        # Every key the issue names is a measured, finite number, unless the section says why not.
        skipped = section.get("skipped") or {}
        assert isinstance(skipped, dict)
        for key in KEYS[name]:
            value = section[key]
            if value is None and skipped.get(key):
                continue
            assert isinstance(value, int | float) and math.isfinite(value), (name, key, value)
    else:
        assert section["reason"] and all(section[key] is None for key in KEYS[name])


def test_an_unknown_section_is_a_clear_error_and_writes_nothing(tmp_path: Path) -> None:
    done = _bench("--sections", "comm,nope", "--out", str(tmp_path), timeout=120)
    assert done.returncode == 2
    assert "--sections: unknown ['nope']" in done.stderr and "Traceback" not in done.stderr
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("args", [["--quick"], ["--quick", "--sections", "overhead"]])
def test_quick_figures_never_replace_the_documented_ones(args: list[str]) -> None:
    done = _bench(*args, timeout=120)
    assert done.returncode == 2 and "--quick needs --out" in done.stderr


def test_an_adopted_section_is_marked_with_its_file_and_the_others_are_kept(tmp_path: Path) -> None:
    # The result of a module's run() made elsewhere (another machine): taken as it is, never re-run,
    # marked as adopted in both files; sections already in results.json stay.
    elsewhere = tmp_path / "elsewhere" / "scale"
    elsewhere.mkdir(parents=True)
    figures = {"sim_peers_max": 64, "swarm_nodes_max": 8, "table": [{"where": "simulator", "peers": 64}]}
    (elsewhere / "scale.json").write_text(json.dumps(figures))
    (elsewhere / "scale_plot.png").write_bytes(b"\x89PNG")
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_text(json.dumps({"memory": {"bytes_per_param": 33.2, "status": "measured"}}))
    done = _bench("--adopt", f"scale={elsewhere / 'scale.json'}", "--out", str(out), timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["scale"]["sim_peers_max"] == 64 and results["scale"]["status"] == "measured"
    assert results["scale"]["measured"]["adopted_from"].endswith("elsewhere/scale/scale.json")
    assert results["memory"]["bytes_per_param"] == 33.2  # kept
    assert results["comm"]["status"] == "not run"  # nothing ran
    report = (out / "results.md").read_text()
    assert "adopted from" in report and "(scale/scale_plot.png)" in report
    assert (out / "scale" / "scale_plot.png").read_bytes() == b"\x89PNG"


def test_adopting_a_file_that_is_not_a_section_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    done = _bench("--adopt", f"scale={bad}", "--out", str(tmp_path / "out"), timeout=120)
    assert done.returncode == 2 and "cannot read a section" in done.stderr and "Traceback" not in done.stderr
    done = _bench("--adopt", f"nope={bad}", "--out", str(tmp_path / "out"), timeout=120)
    assert done.returncode == 2 and "expected SECTION=FILE" in done.stderr
