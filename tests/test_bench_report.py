"""The results file and the page generated from it, on CPU: ``qa/bench/results.py`` refuses malformed
rows, ``qa/bench/report.py`` keeps each line's newest run, lays a training-step bench out as impl columns
with ratios to distwgrad, and ``--check`` fails when ``docs/benchmarks.md`` is stale."""

from __future__ import annotations

import json

import pytest

from qa.bench import report, results


def _row(**kw):
    base = dict(bench="train_step", case="tiny b8", impl="distwgrad", precision="bf16", world=2,
                metric="tokens_per_s", value=1000.0, unit="tokens/s", device="cpu", command="train_step.py")
    base.update(kw)
    return results.row(**base)


def test_row_fills_provenance_and_keeps_extras():
    r = _row(rounds=[1.0, 2.0])
    assert list(r)[: len(results.FIELDS)] == list(results.FIELDS)
    assert r["device"] == "cpu" and r["command"] == "train_step.py" and r["rounds"] == [1.0, 2.0]
    assert r["commit"] and r["date"].endswith("+00:00") and r["torch"]


@pytest.mark.parametrize("bad", [dict(bench=""), dict(case=3), dict(world=0), dict(world=True), dict(world=1.5),
                                 dict(value="fast"), dict(value=True), dict(unit=None)])
def test_row_refuses_malformed_values(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        _row(**bad)


def test_append_refuses_rows_without_provenance_and_writes_on_rank_0_only(tmp_path, monkeypatch):
    path = tmp_path / "r.jsonl"
    with pytest.raises(ValueError, match="lacks"):
        results.append([{"bench": "x"}], path)
    assert results.append([_row()], path) == 1
    monkeypatch.setenv("RANK", "1")
    assert results.append([_row()], path) == 0
    assert len(results.load(path)) == 1


def test_current_keeps_each_cases_newest_run():
    old = _row(value=1.0, date="2026-01-01T00:00:00+00:00", commit="aaaaaaa")
    new = _row(value=2.0, date="2026-02-01T00:00:00+00:00", commit="bbbbbbb")
    other = _row(case="other", value=3.0, date="2025-01-01T00:00:00+00:00", commit="ccccccc")
    assert sorted(r["value"] for r in report.current([old, new, other])) == [2.0, 3.0]


def test_a_line_keeps_its_own_newest_run():
    """A newer commit that measured bf16 only replaces the bf16 line; the FP8 line stays at its newest run."""
    t0, t1 = "2026-02-01T00:00:00+00:00", "2026-02-02T00:00:00+00:00"
    old = [_row(precision=p, value=v, date=t0, commit="aaaaaaa") for p, v in (("bf16", 1.0), ("fp8_blockwise", 2.0))]
    new = [_row(value=3.0, date=t1, commit="bbbbbbb")]
    kept = report.current(old + new)
    assert sorted((r["precision"], r["value"], r["commit"]) for r in kept) == [
        ("bf16", 3.0, "bbbbbbb"), ("fp8_blockwise", 2.0, "aaaaaaa")]


def test_a_line_compares_one_process_only():
    """[Note: one process per line]: at one commit, the full comparison's rows make the line, not a later
    process's that measured fewer builds; a precision only the later process measured still shows."""
    t0, t1 = "2026-02-01T00:00:00+00:00", "2026-02-01T01:00:00+00:00"
    full = [_row(impl=i, value=v, date=t0, command="full") for i, v in (("distwgrad", 1000.0), ("fsdp2", 900.0))]
    alone = [_row(value=500.0, date=t1, command="alone"), _row(precision="fp8_blockwise", value=800.0, date=t1,
                                                              command="alone")]
    kept = report.current(full + alone)
    assert sorted((r["command"], r["precision"], r["value"]) for r in kept) == [
        ("alone", "fp8_blockwise", 800.0), ("full", "bf16", 900.0), ("full", "bf16", 1000.0)]
    assert "| 1,000 | 900 | 0.90x |" in report.render(full + alone)


def test_a_later_run_of_fewer_builds_keeps_the_comparison():
    """[Note: one process per line]: a later commit's run of distwgrad alone does not replace an earlier side by
    side comparison of the same line; a line only that later run measured shows it."""
    t0, t1 = "2026-02-01T00:00:00+00:00", "2026-02-03T00:00:00+00:00"
    full = [_row(impl=i, value=v, date=t0, commit="aaaaaaa", command="full")
            for i, v in (("distwgrad", 1000.0), ("fsdp2", 900.0))]
    later = [_row(value=1100.0, date=t1, commit="bbbbbbb", command="alone"),
             _row(precision="fp8_per_tensor", value=1200.0, date=t1, commit="bbbbbbb", command="alone")]
    kept = report.current(full + later)
    assert sorted((r["commit"], r["precision"], r["value"]) for r in kept) == [
        ("aaaaaaa", "bf16", 900.0), ("aaaaaaa", "bf16", 1000.0), ("bbbbbbb", "fp8_per_tensor", 1200.0)]


def test_a_rotated_run_replaces_a_fixed_order_one_of_more_columns():
    """[Note: rotated runs first]: a later run with its builds' order rotated makes the line, though it measured
    fewer columns than the earlier fixed-order comparison; without the rotation the comparison would stay."""
    t0, t1 = "2026-02-01T00:00:00+00:00", "2026-02-03T00:00:00+00:00"
    fixed = [_row(impl=i, value=v, date=t0, commit="aaaaaaa", command="fixed", timing="median, interleaved")
             for i, v in (("distwgrad", 1000.0), ("fsdp2", 900.0), ("torch", 950.0))]
    rotated = [_row(impl=i, value=v, date=t1, commit="bbbbbbb", command="rotated",
                    timing="median, interleaved, order rotated") for i, v in (("distwgrad", 990.0), ("fsdp2", 910.0))]
    kept = report.current(fixed + rotated)
    assert sorted((r["impl"], r["value"]) for r in kept) == [("distwgrad", 990.0), ("fsdp2", 910.0)]
    unrotated = [dict(r, timing="median, interleaved") for r in rotated]
    assert {r["command"] for r in report.current(fixed + unrotated)} == {"fixed"}


def test_train_step_rows_become_impl_columns_with_ratios():
    rows = [_row(impl=impl, metric=m, value=v, unit=u)
            for impl, scale in (("distwgrad", 1.0), ("fsdp2", 0.5), ("torch", 0.25))
            for m, v, u in (("tokens_per_s", 1000.0 * scale, "tokens/s"), ("peak_gib", 10.0 / scale, "GiB"),
                            ("step_ms", 10.0 / scale, "ms"))]
    page = report.render(rows)
    assert "| case | metric | distwgrad | fsdp2 | torch | fsdp2 / distwgrad | torch / distwgrad |" in page
    assert "| tiny b8 | tokens_per_s (tokens/s) | 1,000 | 500 | 250 | 0.50x | 0.25x |" in page
    assert "| tiny b8 | peak_gib (GiB) | 10.00 | 20.00 | 40.00 | 2.00x | 4.00x |" in page
    assert "step_ms" not in page  # the page shows throughput and memory; every metric stays in the file
    assert "`train_step.py` at" in page and "Device: cpu" in page


def test_rows_of_zeros_are_left_off_the_page():
    rows = [_row(impl=impl, metric=m, value=v, unit=u) for impl in ("distwgrad", "fsdp2")
            for m, v, u in (("tokens_per_s", 1000.0, "tokens/s"), ("collectives_per_step", 0.0, "count"))]
    page = report.render(rows)
    assert "| tiny b8 | tokens_per_s (tokens/s) | 1,000 | 1,000 | 1.00x |" in page
    assert "collectives_per_step" not in page  # one rank: nothing to count, nothing to compare


def test_check_fails_when_the_page_is_stale(tmp_path, capsys):
    res, page = tmp_path / "results.jsonl", tmp_path / "benchmarks.md"
    results.append([_row()], res)
    args = ["--results", str(res), "--page", str(page), "--no-plot"]
    assert report.main([*args, "--check"]) == 1  # no page yet
    assert report.main(args) == 0
    assert report.main([*args, "--check"]) == 0
    results.append([_row(impl="fsdp2", value=500.0)], res)
    assert report.main([*args, "--check"]) == 1
    assert "stale" in capsys.readouterr().err


def test_the_repositorys_page_is_current():
    """docs/benchmarks.md is what qa/bench/report.py makes of docs/benchmarks/results.jsonl, in at most
    150 lines."""
    assert report.main(["--check", "--results", str(results.RESULTS), "--page", str(report.PAGE)]) == 0, (
        "docs/benchmarks.md is stale: run `PYTHONPATH=. python qa/bench/report.py`")
    lines = len(report.PAGE.read_text().splitlines())
    assert lines <= 150, (f"docs/benchmarks.md has {lines} lines: it shows current results only (<= 150); "
                          f"take a table off the page (Layout on_page / off_page) once LOG.md records it")


def test_the_plot_is_drawn_from_the_rows(tmp_path):
    rows = [_row(bench="grouped_gemm", case=f"fprop E={e}", impl=i, metric="tflops", value=float(e), unit="TFLOP/s")
            for e in (8, 64) for i in ("distwgrad", "torch_grouped_mm")]
    assert report.plot_grouped_gemm(rows, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    assert not report.plot_grouped_gemm([_row()], tmp_path / "q.png")


def test_results_file_rows_are_complete():
    for line in results.RESULTS.read_text().splitlines():
        r = json.loads(line)
        assert all(f in r for f in results.FIELDS), r
