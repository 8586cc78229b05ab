"""``qa/bench/train_step.py`` end to end on CPU: every promised row, and the builds agree at step 1.

The bench runs at world 1 (``python``) and world 2 (torchrun's ranks, gloo; both forked from a process that
imported torch: [Note: forked job ranks]) on the ``tiny`` preset, one
warm-up step and one round of one step, ``--no-record``. Its ``--json`` output must hold every (impl,
precision, metric) a CPU run promises (no MFU or peak memory on CPU: the module docstring says why), the
FP8 peers must run torchao's FP8 in ``fp8_per_tensor`` where torchao is installed (its experts bf16 on a CPU)
and be listed as not run with a reason otherwise, and the step-1 losses must agree within the bench's own
``LOSS_ATOL`` (same weights, same data; the bench exits 1 otherwise).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from train_job_cases import _run_forked

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "qa", "bench", "train_step.py")
PRECISIONS = ("bf16", "fp8_per_tensor", "fp8_blockwise")
CPU_METRICS = {"step_ms", "tokens_per_s", "collectives_per_step", "comm_bytes_per_step"}
PEER_FP8 = ("fp8_per_tensor",) if importlib.util.find_spec("torchao") else ()  # qa/bench/_torchao_fp8.py


def _bench(tmp_path, nproc: int | None, precisions=PRECISIONS) -> tuple[dict, str]:
    out = tmp_path / "bench.json"
    args = [BENCH, "--model", "tiny", "--precisions", ",".join(precisions), "--modes", "eager", "--warmup", "1",
            "--rounds", "1", "--steps", "1", "--no-record", "--json", str(out)]
    # ranks forked from a process that imported torch ([Note: forked job ranks]): the bench's rows are the test
    proc = _run_forked(args[1:], nproc, timeout=600, target=args[0])
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    with open(out) as f:
        return json.load(f), proc.stdout


def _layer_step(args: list[str]) -> subprocess.CompletedProcess:
    """``python qa/bench/layer_step.py ARGS``, one process forked as ``_bench``'s ranks are."""
    return _run_forked(args, None, timeout=300, target=os.path.join(REPO, "qa", "bench", "layer_step.py"))


def _check(report: dict, stdout: str, world: int, precisions=PRECISIONS) -> None:
    peer_fp8 = tuple(p for p in PEER_FP8 if p in precisions)
    got: dict[tuple[str, str], set[str]] = {}
    for r in report["rows"]:
        assert r["bench"] == "train_step" and r["world"] == world and r["case"] == "tiny b16x64 mb2 eager", r
        got.setdefault((r["impl"], r["precision"]), set()).add(r["metric"])
    want = {("distwgrad", p) for p in precisions} | {(i, p) for i in ("fsdp2", "torch") for p in ("bf16", *peer_fp8)}
    assert set(got) == want, sorted(got)
    expect = CPU_METRICS | ({"comm_hidden"} if world > 1 else set())  # the hidden fraction needs peers
    assert all(metrics == expect for metrics in got.values()), got
    not_run = {(n["impl"], n["precision"]) for n in report["not_run"]}
    assert not_run == {(i, p) for i in ("fsdp2", "torch") for p in precisions[1:] if p not in peer_fp8}, not_run
    peers = [r for r in report["rows"] if r["impl"] != "distwgrad" and r["precision"] != "bf16"]
    assert all(r["recipe"] == "torchao" and r["fp8_experts"] is False for r in peers), peers  # CPU: attention only
    assert all(n["why"] for n in report["not_run"])
    checks = {c["build"]: c for c in report["loss_checks"]}
    assert set(checks) == {f"{i}/{p}/eager" for i, p in want}, sorted(checks)
    assert all(c["ok"] for c in checks.values()), checks
    for build, c in checks.items():  # printed side by side
        assert f"{build} " in stdout and f"{c['loss_step1']:.7f}" in stdout, build
    tokens = {(r["impl"], r["precision"]): r["value"] for r in report["rows"] if r["metric"] == "tokens_per_s"}
    best = {(b["impl"], b["precision"]): b for b in report["best"]}  # one mode here: eager is each one's best
    assert set(best) == want and all(b["mode"] == "eager" for b in best.values()), best
    for peer, p in ((i, p) for i in ("fsdp2", "torch") for p in ("bf16", *peer_fp8)):
        assert best[(peer, p)]["vs_distwgrad"] == tokens[("distwgrad", p)] / tokens[(peer, p)]
    for p in precisions[1:]:
        assert best[("distwgrad", p)]["vs_bf16"] == tokens[("distwgrad", p)] / tokens[("distwgrad", "bf16")]
    assert "best configuration" in stdout and f"distwgrad {best[('fsdp2', 'bf16')]['vs_distwgrad']:.3f}x" in stdout


def _comm(report: dict, impl: str, precision: str) -> dict:
    return next(r["comm"] for r in report["rows"] if r["impl"] == impl and r["precision"] == precision)


def test_world_1(tmp_path):
    """One process, bf16 (the recipes and their peers: test_world_2)."""
    report, stdout = _bench(tmp_path, None, ("bf16",))
    _check(report, stdout, 1, ("bf16",))
    rows = [r for r in report["rows"] if r["impl"] == "torch"]
    assert all(r["torch_mode"] == "single" for r in rows)
    assert {r["python_gc"] for r in report["rows"]} == {"off, gc.collect(1) before each block"}
    assert _comm(report, "distwgrad", "bf16")["bytes"] == 0  # one rank: nothing gathered or reduced


@pytest.mark.distributed
def test_world_2(tmp_path):
    report, stdout = _bench(tmp_path, 2)
    _check(report, stdout, 2)
    assert all(r["torch_mode"] == "ddp" for r in report["rows"] if r["impl"] == "torch")
    ours = _comm(report, "distwgrad", "bf16")
    # the weights' own byte counters and the profiler's c10d operators count the same traffic
    assert ours["bytes"] == ours["bytes_trace"] > 0 and ours["unsized"] == 0, ours
    assert ours["by_kind"]["all_gather"]["count"] > 0 and ours["by_kind"]["reduce_scatter"]["count"] > 0
    fsdp = _comm(report, "fsdp2", "bf16")
    assert fsdp["unsized"] == 0 and fsdp["by_kind"]["reduce_scatter"]["count"] > 0, fsdp
    # coalesced units (one all-gather per block and pass, the root's carrying the first block's; one
    # reduce-scatter per block) move no more collectives than FSDP2's fully_shard units
    assert ours["collectives"] <= fsdp["collectives"], (ours["collectives"], fsdp["collectives"])
    ddp = _comm(report, "torch", "bf16")
    assert ddp["unsized"] == 0 and ddp["by_kind"]["all_reduce"]["bytes"] > 0, ddp


def test_layer_step_tiny(tmp_path):
    """qa/bench/layer_step.py --tiny: a MoE layer and the tied embedding, bf16 and both FP8 recipes, beside the
    plain-torch peer: its bf16 rows, and each FP8 case it cannot run here said with the reason."""
    out = tmp_path / "rows.jsonl"
    proc = _layer_step(["--tiny", "--reps", "1", "--impls", "distwgrad,torch", "--results", str(out)])
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    lines = [line.strip() for line in proc.stdout.splitlines() if " ms " in line or "not run" in line]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    for case in ("moe E=4", "tied_embedding V=256"):
        for p in PRECISIONS:
            assert any(line.startswith(case) and f" {p} " in line and "torch" not in line for line in lines), (
                case, p, proc.stdout)
            peer = [line for line in lines if line.startswith(case) and f" {p} " in line and "torch" in line]
            assert len(peer) == 1, (case, p, proc.stdout)
            # on a CPU the peer runs bf16 only: torchao's FP8 needs an SM90 GPU, and no peer quantizes the
            # tied embedding or runs the blockwise recipe
            assert ("not run (" in peer[0]) == (p != "bf16"), peer
        torch_rows = [r for r in rows if r["impl"] == "torch" and r["case"].startswith(case)]
        assert {(r["precision"], r["metric"]) for r in torch_rows} == {("bf16", "step_ms"), ("bf16", "tflops")}, rows
    # the MoE case's reason: torchao missing (CI), or torchao present and this device not CUDA
    reason = r"moe E=4 .* fp8_per_tensor .*torch: not run \((torchao is not importable|.*need CUDA)"
    assert re.search(reason, proc.stdout), proc.stdout
    assert "keeps the tied embedding and lm_head bf16" in proc.stdout, proc.stdout


def test_layer_step_tunings_tiny(tmp_path):
    """layer_step.py --tunings: each case and precision under each tuning in rotated rounds, rows with impl
    distwgrad@<tuning>, the median against the first tuning's and main_grad's bits (on the CPU the GEMMs are
    torch's whatever the tuning: the same bits)."""
    out = tmp_path / "rows.jsonl"
    proc = _layer_step(["--tiny", "--reps", "1", "--rounds", "2", "--precisions", "bf16,fp8_blockwise", "--tunings",
                        "", "quantize.per_tensor_block = 8192", "--results", str(out)])
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    impls = {"distwgrad@defaults", "distwgrad@quantize.per_tensor_block=8192"}
    step_ms = [r for r in rows if r["metric"] == "step_ms"]
    # 2 cases x 2 precisions x 2 tunings, each with its rounds and the same main_grad bits
    assert len(step_ms) == 8 and {r["impl"] for r in step_ms} == impls, rows
    for r in step_ms:
        assert r["timing"] == "order rotated" and len(r["rounds_ms"]) == 2 and r["main_grad_same_bits"] is True, r
        assert r["value"] == pytest.approx(sorted(r["rounds_ms"])[0] / 2 + sorted(r["rounds_ms"])[1] / 2), r
        if r["impl"] == "distwgrad@defaults":
            assert r["vs_first"] == 1.0, r
    assert proc.stdout.count("main_grad same bits") == 8, proc.stdout


@pytest.mark.parametrize("args, message", [
    (["--tunings", "quantize.per_tensor_block=8192"], "--tunings: give at least two different tunings"),
    (["--tunings", "", ""], "--tunings: give at least two different tunings"),
    (["--tunings", "", "quantize.per_tensor_block=8192", "quantize.per_tensor_block = 8192"],
     "--tunings: quantize.per_tensor_block=8192 given twice"),
    (["--tunings", "", "quantize.nope=1"], "nope"),
    (["--tunings", "", "quantize.per_tensor_block"], "--tunings: 'quantize.per_tensor_block' is not "
                                                     "family.knob=value"),
    (["--tunings", "", "quantize.per_tensor_block=8192", "--profile"], "--tunings times the eager step only"),
    (["--rounds", "0"], "--rounds must be >= 1, got 0"),
    (["--impls", "torch"], "--impls: distwgrad and optionally torch"),
    (["--impls", "distwgrad,fsdp2"], "got 'distwgrad,fsdp2'"),
    (["--impls", "distwgrad,torch", "--tunings", "", "quantize.per_tensor_block=8192"],
     "--tunings times distwgrad's kernels"),
])
def test_layer_step_tunings_refused(monkeypatch, capsys, args, message):
    """In this process (argparse's exit 2 is a SystemExit); the script's own exit path: the test below."""
    monkeypatch.setattr(sys, "path", [os.path.join(REPO, "qa", "bench"), *sys.path])
    import layer_step

    with pytest.raises(SystemExit) as exc:
        layer_step.main(["--tiny", "--no-record", *args])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err and "Traceback" not in err, err


def test_layer_step_refusal_exits_2_with_one_line():
    proc = _layer_step(["--tiny", "--no-record", "--rounds", "0"])
    assert proc.returncode == 2 and "--rounds must be >= 1, got 0" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("python_gc", [False, True])
def test_timed_blocks_run_without_automatic_gc(monkeypatch, python_gc):
    """[Note: garbage collection in the timed steps]: with automatic collection off, every build's timed block
    runs with the collector disabled and after a generation-1 collection; ``--python-gc`` leaves it alone;
    ``main`` gives the process its collector back."""
    import gc
    import types

    # the bench imports its siblings from qa/bench: on sys.path for this test only
    monkeypatch.setattr(sys, "path", [os.path.join(REPO, "qa", "bench"), *sys.path])
    import train_step as ts

    seen, collects = [], []
    builds = [types.SimpleNamespace(name=n, mode="eager") for n in "ab"]
    monkeypatch.setattr(ts, "_warm_up", lambda *a: builds)
    monkeypatch.setattr(ts, "_batches", lambda *a: [None])
    monkeypatch.setattr(ts, "_count_comm", lambda *a: None)
    monkeypatch.setattr(ts, "_timed_block", lambda b, batches, device: seen.append((b.name, gc.isenabled())))
    monkeypatch.setattr(gc, "collect", lambda generation=2: collects.append(generation))

    def fake_main(args, rt):
        ts.run_group([], None, None, rt, args, [])
        return 0
    monkeypatch.setattr(ts, "_main", fake_main)
    monkeypatch.setattr(ts, "_runtime", lambda: {"device": None})
    monkeypatch.setattr(ts.dist, "destroy_process_group", lambda: None)
    assert gc.isenabled()
    flags = ["--rounds", "2", "--no-record"] + (["--python-gc"] if python_gc else [])
    assert ts.main(flags) == 0
    assert gc.isenabled()
    assert seen == [("a", python_gc), ("b", python_gc), ("b", python_gc), ("a", python_gc)]
    assert collects == ([] if python_gc else [1] * 4)


def test_each_build_is_timed_in_each_place_of_a_round(monkeypatch):
    """[Note: each build in each place of a round]: round r starts with build r, so over the default 6 rounds
    each of three builds is timed first, second and third twice."""
    import collections
    import types

    monkeypatch.setattr(sys, "path", [os.path.join(REPO, "qa", "bench"), *sys.path])  # as the test above
    import train_step as ts

    order: list[list[str]] = []
    builds = [types.SimpleNamespace(name=n, mode="eager") for n in "abc"]
    monkeypatch.setattr(ts, "_warm_up", lambda *a: builds)
    monkeypatch.setattr(ts, "_count_comm", lambda *a: None)
    monkeypatch.setattr(ts, "_timed_block", lambda b, batches, device: order[-1].append(b.name))
    args = ts.parse_args(["--no-record"])
    assert args.rounds == 6
    monkeypatch.setattr(ts, "_batches", lambda *a: order.append([]) or [None])
    ts.run_group([], None, None, {"device": None}, args, [])
    order.pop()  # the profiling batch after the rounds
    assert len(order) == 6 and all(sorted(r) == ["a", "b", "c"] for r in order), order
    places = collections.Counter((name, i) for r in order for i, name in enumerate(r))
    assert set(places.values()) == {2} and len(places) == 9, places


def test_best_configurations_compare_each_build_at_its_fastest(monkeypatch):
    """What the issue's targets compare: each (precision, impl) at its fastest mode, distwgrad's best over a
    peer's best, an FP8 recipe's best over distwgrad's bf16 best (the rows of one H200 run, ms -> tokens/s)."""
    monkeypatch.setattr(sys, "path", [os.path.join(REPO, "qa", "bench"), *sys.path])  # as the test above
    import train_step as ts

    ms = {("bf16", "distwgrad", "compiled"): 92.05, ("bf16", "fsdp2", "compiled"): 99.29,
          ("bf16", "torch", "compiled"): 91.30, ("bf16", "distwgrad", "compiled_cuda_graph"): 90.03,
          ("bf16", "torch", "compiled_cuda_graph"): 91.59,
          ("fp8_per_tensor", "distwgrad", "compiled_cuda_graph"): 81.91}
    rows = [{"metric": m, "precision": p, "impl": i, "case": f"large b8x2048 {mode}", "value": v}
            for (p, i, mode), t in ms.items() for m, v in (("tokens_per_s", 16384e3 / t), ("step_ms", t))]
    best = {(b["precision"], b["impl"]): b for b in ts.best_configurations(rows)}
    assert {k: b["mode"] for k, b in best.items()} == {
        ("bf16", "distwgrad"): "compiled_cuda_graph", ("bf16", "fsdp2"): "compiled", ("bf16", "torch"): "compiled",
        ("fp8_per_tensor", "distwgrad"): "compiled_cuda_graph"}
    assert round(best[("bf16", "fsdp2")]["vs_distwgrad"], 3) == 1.103
    assert round(best[("bf16", "torch")]["vs_distwgrad"], 3) == 1.014
    assert round(best[("fp8_per_tensor", "distwgrad")]["vs_bf16"], 3) == 1.099
    assert "vs_distwgrad" not in best[("bf16", "distwgrad")] and "vs_bf16" not in best[("bf16", "distwgrad")]


@pytest.mark.parametrize("together", [False, True])
def test_together_times_every_mode_of_a_precision_in_one_group(monkeypatch, together):
    """``--together``: one group per precision holding every (impl, mode) build, so a best configuration is timed
    in the same rotated rounds as its peers' best; without it, one group per (precision, mode). Each build's
    rows name its own mode in ``case``."""
    import types

    monkeypatch.setattr(sys, "path", [os.path.join(REPO, "qa", "bench"), *sys.path])  # as the tests above
    import train_step as ts

    groups: list[list[tuple[str, str, str]]] = []

    def run_group(specs, cfg, corpus, rt, args, not_run):
        groups.append(list(specs))
        return [types.SimpleNamespace(impl=i, precision=p, mode=m, name=f"{i}/{p}/{m}", allocator={}, loss1=1.0,
                                      model=None) for i, p, m in specs]

    monkeypatch.setattr(ts, "run_group", run_group)
    monkeypatch.setattr(ts, "measurements", lambda b, *a: {"step_ms": (1.0, "ms")})
    monkeypatch.setattr(ts, "_extras", lambda *a: {})
    monkeypatch.setattr(ts, "peak_bf16_tflops", lambda device: None)
    monkeypatch.setattr(ts.results, "provenance", lambda device, command=None: {"command": "x"})
    monkeypatch.setattr(ts.results, "record", lambda rows, args: None)
    rows: list[dict] = []
    monkeypatch.setattr(ts, "_table", lambda r, rt: rows.extend(r))
    args = ts.parse_args(["--model", "tiny", "--precisions", "bf16", "--impls", "distwgrad,torch", "--modes",
                          "eager,compiled", "--no-record"] + (["--together"] if together else []))
    import torch.distributed as dist
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: None)
    assert ts._main(args, {"device": torch.device("cpu"), "rank": 0, "world": 1, "group": None}) == 0
    pairs = [("distwgrad", "bf16", "eager"), ("torch", "bf16", "eager"), ("distwgrad", "bf16", "compiled"),
             ("torch", "bf16", "compiled")]
    assert groups == ([pairs] if together else [pairs[:2], pairs[2:]])
    assert {(r["impl"], r["case"]) for r in rows} == {(i, f"tiny b16x64 mb2 {m}") for i, _, m in pairs}




def test_a_case_says_fp8_weights_at_every_use_and_ends_with_its_mode(monkeypatch):
    """``--no-fp8-weight-cache`` rows are another measurement (docs/fp8.md, "Kept across microbatches"); the table
    reads a row's mode from the case's last word."""
    monkeypatch.setattr(sys, "path", [os.path.join(REPO, "qa", "bench"), *sys.path])  # as the tests above
    import train_step as ts

    assert ts.case_name("large", 8, 2048, 1, "eager") == "large b8x2048 eager"
    every = ts.case_name("large", 8, 2048, 2, "compiled_cuda_graph", every_use=True)
    assert every == "large b8x2048 mb2 (fp8 weights at every use) compiled_cuda_graph"
    assert every.rsplit(" ", 1)[1] == "compiled_cuda_graph"
    assert ts.parse_args(["--no-fp8-weight-cache"]).no_fp8_weight_cache and not ts.parse_args([]).no_fp8_weight_cache
    assert (ts.recipe_name("bf16"), ts.recipe_name("fp8_blockwise")) == ("none", "fp8_blockwise")
