"""benchmarks/gemm_clocks.py (CPU): stored bench_peers GEMM cells in SM cycles, and the cycle ratio that
bench_peers itself records at the power cap."""

import gzip
import json

import pytest


def gemm_row(ours_ms, quack_ms, ours_cap, quack_cap, ours_mhz, quack_mhz):
    """A bench_peers GEMM row as a run with --sustained-s stores it (the fields gemm_clocks reads)."""
    return dict(family="fwd", ours_ms=ours_ms, quack_ms=quack_ms, ours_sustained_ms=ours_cap,
                quack_sustained_ms=quack_cap, ours_sustained_clock_mhz=ours_mhz, quack_sustained_clock_mhz=quack_mhz)


def test_cell_figures_from_a_hand_made_row():
    """Cycles at the cap = ms x MHz / 1e3; the burst's implied clock = those cycles / the burst ms; the three
    ratios are QuACK's over ours. A row without QuACK's clock (or its burst time) has no figures."""
    from benchmarks.gemm_clocks import cell_figures

    # ours 2.0 ms at 1500 MHz (3.0 M cycles), QuACK 2.5 ms at 1400 MHz (3.5 M); bursts 2.4 and 2.0 ms
    c = cell_figures(gemm_row(2.4, 2.0, 2.0, 2.5, 1500.0, 1400.0))
    assert c["ours"]["mcycles"] == pytest.approx(3.0) and c["quack"]["mcycles"] == pytest.approx(3.5)
    assert c["cap"] == pytest.approx(1.25) and c["cycles"] == pytest.approx(3.5 / 3.0)
    assert c["burst"] == pytest.approx(2.0 / 2.4)  # ours slower in the burst although it takes fewer cycles ...
    assert c["ours"]["burst_implied_mhz"] == pytest.approx(1250.0)  # ... because its burst ran at a lower clock
    assert c["quack"]["burst_implied_mhz"] == pytest.approx(1750.0)
    # a run that stored the cycles (session 54 on) is read as stored
    row = dict(gemm_row(2.4, 2.0, 2.0, 2.5, 1500.0, 1400.0), ours_sustained_mcycles=3.3)
    assert cell_figures(row)["cycles"] == pytest.approx(3.5 / 3.3)
    assert cell_figures(dict(gemm_row(2.4, 2.0, 2.0, 2.5, 1500.0, 1400.0), quack_sustained_clock_mhz=None)) is None
    no_burst = gemm_row(2.4, 2.0, 2.0, 2.5, 1500.0, 1400.0)
    del no_burst["quack_ms"]
    assert cell_figures(no_burst) is None


def test_main_reads_plain_and_gzipped_runs_and_keeps_the_asked_cells(tmp_path, capsys):
    """The command line: each run's source fields are kept, only the --cells rows (that have clocks) are kept,
    a run without such a row is named in the table, and the JSON is written where --out says."""
    from benchmarks.gemm_clocks import main

    run = dict(gpu="NVIDIA H100 80GB HBM3", commit="abc1234", date="2026-12-07 19:41 UTC", command="bench_peers.py",
               gemm={"fwd | 16 x 4096": gemm_row(2.4, 2.0, 2.0, 2.5, 1500.0, 1400.0),
                     "wgrad | 48 equal": gemm_row(2.0, 2.0, 2.0, 2.0, 1400.0, 1400.0),
                     "dgrad | 48 equal": dict(family="dgrad", ours_ms=1.0, quack_ms=1.0)})  # burst only
    (tmp_path / "bench_peers_a.json").write_text(json.dumps(run))
    with gzip.open(tmp_path / "bench_peers_b.json.gz", "wt") as f:
        json.dump(dict(run, gemm={"dgrad | 48 equal": run["gemm"]["dgrad | 48 equal"]}), f)
    main([str(tmp_path / "bench_peers_a.json"), str(tmp_path / "bench_peers_b.json.gz"), "--cells",
          "fwd | 16 x 4096; dgrad | 48 equal", "--out", str(tmp_path / "out")])
    d = json.load(open(tmp_path / "out" / "gemm_clocks.json"))
    assert d["cells_asked"] == ["fwd | 16 x 4096", "dgrad | 48 equal"] and "commit" in d
    a, b = d["runs"]
    assert (a["file"], a["name"], a["gpu"], a["commit"]) == ("bench_peers_a.json", "a", run["gpu"], "abc1234")
    assert list(a["cells"]) == ["fwd | 16 x 4096"] and a["cells"]["fwd | 16 x 4096"]["cycles"] == pytest.approx(7 / 6)
    assert b["name"] == "b" and b["cells"] == {}
    out = capsys.readouterr().out
    assert "b no GEMM cell with both" in out and "1.167" in out and "1250  1750" in out


def test_bench_peers_records_the_cycle_ratio_where_the_cap_runs_had_clocks():
    """bench_peers' gemm_ratios: the other's M cycles per call at the cap over ours' where both were sampled
    (None where the other has none), no key where ours was not; the cap table prints it."""
    from benchmarks.bench_peers import gemm_ratios, table

    gemm = {"fwd | a": dict(ours_ms=2.4, quack_ms=2.0, ours_sustained_ms=2.0, quack_sustained_ms=2.5,
                            ours_sustained_mcycles=3.0, quack_sustained_mcycles=3.5, torch_ms=3.0,
                            torch_sustained_ms=3.0),
            "fwd | b": dict(ours_ms=1.0, quack_ms=1.0, ours_sustained_ms=1.0, quack_sustained_ms=1.0)}
    gemm_ratios(gemm)
    assert gemm["fwd | a"]["ours_over_quack_cycles"] == pytest.approx(3.5 / 3.0)
    assert gemm["fwd | a"]["ours_over_torch_cycles"] is None and gemm["fwd | a"]["ours_over_quack_sustained"] == 1.25
    assert "ours_over_quack_cycles" not in gemm["fwd | b"]
    lines = table(dict(gemm=gemm, H=2, F=3, sustained_s=1.0, peers=dict(quack="ok", sonicmoe="ok")))
    cap = [ln for ln in lines if ln.strip().startswith("fwd | a") and "cycles" in ln]
    assert len(cap) == 1 and cap[0].rstrip().endswith("cycles  1.167      -"), cap
