"""``--cuda-graph`` in the training job and the benchmarks, and the MoE router's sync-free expert counts.

CPU: the router's counts against ``torch.bincount``; what ``--cuda-graph`` refuses, before any process
group (one line, exit code 2); the flag in every ``--help``; and the job's graphed step under a modelled
CUDA graph (capture runs its body once, eagerly; replay does nothing: ``tests/test_graphs.py``), which checks
the wiring (every block graphed, its weights synchronous, the step's accounting consistent, release), never
values. GPU (``gpu``): the graphed job against the eager one, the benches' graphed modes, and that a block's
forward and backward never synchronize with the host.

Tolerance of the graphed job against the eager one ([Note: the graphed step] in ``launch/cuda_graph.py``):
step 1's loss is bit-identical (same weights and data, and a replay runs the kernels eager runs, in the same
order: ``tests/test_cuda_graphs.py`` checks that bit for bit). Step 2's weights come from step 1's gradients,
in which the embedding's scatter (``index_add_``, fp32 atomics over repeated token ids, eager in both runs)
sums in an order that changes from run to run, eager against eager as well; so step 2's loss is held to the
job's fp32 loss tolerance ``PARITY_LOSS_ATOL`` (1e-5, 40 fp32 ulps at a loss of 4), and the gradients
themselves are checked by ``--check-parity`` against the unsharded reference (a lost or doubled block
gradient is a relative error of 1.0 there; AdamW's first update, scale-invariant, would hide a doubling).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn
from train_job_cases import _run_forked

import distwgrad
from distwgrad import graphs
from distwgrad.models import MoEGPT, MoEGPTConfig
from distwgrad.models.moe_gpt import MoE

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
from launch import config as job_config  # noqa: E402
from launch import cuda_graph, step, train  # noqa: E402

CUDA = torch.cuda.is_available()
ENV = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")


def _python(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], env=ENV, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def _forked(*args: str) -> subprocess.CompletedProcess:
    """``_python(*args)`` forked from a process that imported torch ([Note: forked job ranks]): a CPU refusal."""
    target, rest = (args[1], args[2:]) if args[0] == "-m" else (args[0], args[1:])
    return _run_forked(list(rest), None, timeout=300, target=target)


# --- the router's counts ---------------------------------------------------------------------------------

class _Fixed(nn.Module):
    """A router returning given logits; an expert GEMM that records its ``m_splits`` and passes rows on."""

    def __init__(self, logits_TE: torch.Tensor | None = None) -> None:
        super().__init__()
        self.logits_TE, self.seen = logits_TE, []

    def forward(self, x, m_splits_E=None):
        if self.logits_TE is not None:
            return self.logits_TE
        self.seen.append(m_splits_E)
        return x


def _logits(kind: str, T: int, E: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(T * 31 + E)
    logits = torch.randn(T, E, generator=gen)
    if kind == "empty_experts":  # experts 0 and 1 win every token: the others get none
        logits[:, :2] += 100.0
    elif kind == "ties":  # equal logits: topk's tie-break decides, on both sides alike
        logits = torch.zeros(T, E)
    return logits


@pytest.mark.parametrize("kind, T, E, top_k", [("random", 96, 8, 2), ("random", 7, 3, 3), ("empty_experts", 40, 6, 2),
                                               ("ties", 12, 4, 2), ("random", 33, 1, 1), ("random", 0, 4, 2)])
def test_router_counts_equal_bincount(kind, T, E, top_k):
    """The sync-free count (``scatter_add_`` of ones) gives ``torch.bincount``'s counts exactly, in int64."""
    D = 4
    logits_TE = _logits(kind, T, E)
    fc1, fc2 = _Fixed(), _Fixed()
    moe = MoE(MoEGPTConfig(d_model=D, n_heads=2, n_experts=E, top_k=top_k), _Fixed(logits_TE), fc1, fc2)
    moe(torch.randn(T, D))
    expert_A = logits_TE.float().softmax(-1).topk(top_k, dim=-1).indices.reshape(-1)
    want = torch.bincount(expert_A, minlength=E)
    for got in fc1.seen + fc2.seen:
        assert got.dtype == want.dtype == torch.int64 and torch.equal(got, want), (got, want)
    if kind == "empty_experts":
        assert want[2:].sum() == 0 and want[:2].sum() == T * top_k


# --- what --cuda-graph refuses ---------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, world, match", [
    (dict(device="cpu"), 1, r"--cuda-graph needs CUDA devices with NCCL, but device='cpu' runs on the CPU over gloo"),
    *[(dict(recipe=r), 2, rf"--cuda-graph with recipe='{r}' runs on one rank only, got world size 2: .*amax")
      for r in ("fp8_per_tensor", "fp8_per_tensor_te", "fp8_blockwise")],
])
def test_config_refuses_what_cannot_be_graphed(kwargs, world, match):
    with pytest.raises(ValueError, match=match):
        job_config.TrainConfig(cuda_graph=True, **kwargs).check_world_size(world)
    job_config.TrainConfig(cuda_graph=False, **kwargs).check_world_size(world)  # eager: fine


def test_allowed_combinations_and_the_device_check():
    for recipe in job_config.RECIPES:  # every recipe on one rank ([Note: amax under capture])
        job_config.TrainConfig(cuda_graph=True, recipe=recipe).check_world_size(1)
        assert repr(cuda_graph.recipe_for_graphs(recipe)) == repr(job_config.fp8_recipe(recipe))  # the step's own
    job_config.TrainConfig(cuda_graph=True, check_parity=True, save_every=1).check_world_size(1)
    with pytest.raises(ValueError, match=r"this run is on cpu over gloo"):
        cuda_graph.check_device(torch.device("cpu"), "gloo")
    cuda_graph.check_device(torch.device("cuda", 0), "nccl")  # no CUDA call: the check reads the names
    assert cuda_graph.recipe_for_graphs("none") is None
    assert isinstance(cuda_graph.recipe_for_graphs("fp8_blockwise"), distwgrad.fp8.BlockwiseScaling)
    assert cuda_graph.recipe_for_graphs("fp8_per_tensor_te").fp8_gemm_fprop.use_split_accumulator is False
    with pytest.raises(ValueError, match=r"recipe='fp8' must be one of \('none', "):
        job_config.fp8_recipe("fp8")


@pytest.mark.skipif(CUDA, reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("args, message", [
    (["-m", "launch.train", "--cuda-graph"], "distwgrad.launch.train: error: --cuda-graph needs CUDA devices with "
                                             "NCCL, but this run is on cpu over gloo"),
    (["-m", "launch.train", "--cuda-graph", "--recipe", "fp8_per_tensor"], "distwgrad.launch.train: error: "
                                                                           "--cuda-graph needs CUDA devices"),
    (["qa/bench/train_step.py", "--cuda-graph"], "--cuda-graph (modes cuda_graph, compiled_cuda_graph) needs a CUDA"),
    (["qa/bench/train_step.py", "--modes", "cuda_graph"], "(modes cuda_graph, compiled_cuda_graph) needs a CUDA"),
    (["qa/bench/train_step.py", "--modes", "eager,compiled_cuda_graph"], "compiled_cuda_graph) needs a CUDA"),
    (["qa/bench/layer_step.py", "--cuda-graph", "--tiny"], "layer_step.py: error: --cuda-graph needs a CUDA device"),
])
def test_cpu_runs_are_refused_with_one_line(args, message):
    proc = _forked(*args)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    if args[0] == "-m":  # the job: exactly one line
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_help_documents_the_flag():
    assert "--cuda-graph" in job_config.build_parser().format_help()
    assert "--cuda-graph" in train.__doc__
    for bench in ("train_step.py", "layer_step.py"):
        proc = _forked(os.path.join("qa", "bench", bench), "--help")
        assert proc.returncode == 0 and "--cuda-graph" in proc.stdout, proc.stdout


# --- the job's graphed step under a modelled graph -------------------------------------------------------

class _ModelGraph:
    """``tests/test_graphs.py``'s stand-in for ``torch.cuda.CUDAGraph``."""

    def __init__(self):
        self.replays = 0

    def replay(self):
        self.replays += 1

    def reset(self):
        pass


def _model_cuda(monkeypatch) -> None:
    for name, value in (("is_available", lambda: True), ("synchronize", lambda *a: None),
                        ("Stream", lambda *a, **k: None), ("stream", lambda s: contextlib.nullcontext()),
                        ("CUDAGraph", _ModelGraph),
                        ("graph", lambda g, pool=None, stream=None: contextlib.nullcontext()),
                        ("graph_pool_handle", lambda: "pool"), ("get_sync_debug_mode", lambda: 0),
                        ("set_sync_debug_mode", lambda mode: None), ("empty_cache", lambda: None),
                        ("memory_allocated", lambda *a: 0)):
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(graphs, "check_devices", lambda *a: None)


@pytest.fixture
def modelled_cuda(monkeypatch):
    _model_cuda(monkeypatch)


@pytest.mark.skipif(CUDA, reason="models CUDA on a machine without it")
def test_graphed_step_wiring(modelled_cuda):
    cfg = MoEGPTConfig(seq_len=16, d_model=32, d_ff=32)
    model = MoEGPT(cfg)
    info = cuda_graph.graph_blocks(model, rows=2)
    assert info["graphed"] == ["blocks.0", "blocks.1"] and info["sample_shape"] == [2, 16, 32]
    assert info["weights_made_synchronous"] == 10  # qkv, proj, router, fc1, fc2 per block
    assert all(not p.async_reduce for p in model.blocks.parameters())
    assert model.embedding.weight.async_reduce  # eager: keeps overlapping its reduction
    optimizer = torch.optim.AdamW(model.parameters())
    tokens = torch.randint(cfg.vocab_size, (4, cfg.seq_len + 1))
    for _ in range(2):
        train.forward_backward(model, tokens, 2)
        assert not any(len(getattr(m, "wgrad_store", ())) for m in model.modules())
        assert distwgrad.finalize_model_grads([model]) == len(list(model.parameters()))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    cuda_graph.release(model)
    with pytest.raises(RuntimeError, match=r"reset\(\)"):
        model.blocks[0](torch.zeros(2, 16, 32))


@pytest.mark.skipif(CUDA, reason="models CUDA on a machine without it")
def test_graphs_keep_fp8_weights_where_the_step_does(modelled_cuda):
    """With several microbatches the job's graphs keep FP8 weights and its step hands every replay its
    ``is_first_microbatch`` ([Note: fp8 weights kept in CUDA graphs]); a step that keeps none cannot replay them."""
    cfg = MoEGPTConfig(seq_len=16, d_model=32, d_ff=32)
    model = MoEGPT(cfg)
    keep = train.keeps_fp8_weights(True, 2, "fp8_per_tensor")
    assert keep and not train.keeps_fp8_weights(True, 1, "fp8_per_tensor")
    assert not train.keeps_fp8_weights(True, 2, "none") and not train.keeps_fp8_weights(False, 2, "fp8_blockwise")
    info = cuda_graph.graph_blocks(model, rows=2, recipe=cuda_graph.recipe_for_graphs("fp8_per_tensor"),
                                   keep_fp8_weights=keep)
    assert info["fp8_weights_kept"] is True
    tokens = torch.randint(cfg.vocab_size, (4, cfg.seq_len + 1))
    train.forward_backward(model, tokens, 2, "fp8_per_tensor")
    distwgrad.finalize_model_grads([model])
    with pytest.raises(TypeError, match="captured with cache_quantized_params=True"):
        train.forward_backward(model, tokens, 2, "fp8_per_tensor", keep_fp8_weights=False)
    distwgrad.finalize_model_grads([model], discard=True)
    cuda_graph.release(model)


@pytest.mark.skipif(CUDA, reason="models CUDA on a machine without it")
def test_compiled_blocks_are_graphed_then_replayed_without_dynamo(monkeypatch):
    """``--compile --cuda-graph`` (and the bench's compiled_cuda_graph mode): the warm-up and capture run the
    compiled forward; afterwards a block's call is the replay, which never enters the compiled code (a
    compiled ``nn.Module`` would route the call through dynamo, tracing the replay: [Note: compiled blocks
    under CUDA graphs] in launch/cuda_graph.py)."""
    runs = []

    def counting_backend(gm, example_inputs):  # dynamo's graph, run as traced, each run counted
        def run(*args):
            runs.append(1)
            return gm.forward(*args)
        return run

    cfg = MoEGPTConfig(seq_len=16, d_model=32, d_ff=32)
    model = MoEGPT(cfg)
    torch._dynamo.reset()
    train.compile_blocks(model, backend=counting_backend)
    sample = torch.randn(2, cfg.seq_len, cfg.d_model, requires_grad=True)
    for block in model.blocks:  # compiled on the real CPU device (dynamo asks CUDA nothing then)
        block(sample).sum().backward()
        distwgrad.drain_deferred_wgrads(block)
    distwgrad.finalize_model_grads([model.blocks])
    model.zero_grad(set_to_none=True)
    compiled = len(runs)
    assert compiled >= len(model.blocks)
    _model_cuda(monkeypatch)
    cuda_graph.graph_blocks(model, rows=2)
    captured = len(runs)
    assert captured >= compiled + len(model.blocks) * (cuda_graph.NUM_WARMUP_ITERS + 1)  # warm-up and capture
    tokens = torch.randint(cfg.vocab_size, (2, cfg.seq_len + 1))
    for _ in range(2):
        train.forward_backward(model, tokens, 1)
        assert distwgrad.finalize_model_grads([model]) == len(list(model.parameters()))
    assert len(runs) == captured, "a graphed block's call ran the compiled code instead of its replay"
    cuda_graph.release(model)
    torch._dynamo.reset()


def test_graphed_per_tensor_step_syncs_the_eager_weights_only(monkeypatch):
    """Under --cuda-graph the blocks' graphs compute their weights' amaxes in every replay, so the step's
    ``sync_weight_amax`` covers the eager parts only (``eager_modules``: every weight outside the blocks)."""
    model = MoEGPT(MoEGPTConfig(seq_len=16, d_model=32, d_ff=32))
    eager = cuda_graph.eager_modules(model)
    ids = lambda mods: {id(p) for m in mods for p in m.parameters()}  # noqa: E731
    assert ids(eager) | ids([model.blocks]) == ids([model]) and not ids(eager) & ids([model.blocks])
    assert model.embedding in eager
    synced = []
    monkeypatch.setattr(step, "sync_weight_amax", lambda mods: synced.append(mods))
    tokens = torch.randint(model.config.vocab_size, (2, 17))
    train.forward_backward(model, tokens, 1, "fp8_per_tensor", eager)
    train.forward_backward(model, tokens, 1, "fp8_per_tensor")
    train.forward_backward(model, tokens, 1, "none", eager)
    assert synced == [eager, model]
    distwgrad.finalize_model_grads([model])


# --- GPU -------------------------------------------------------------------------------------------------

def _job(tmp_path, name: str, *extra: str) -> dict:
    out = tmp_path / name
    proc = _python("-m", "launch.train", "--model", "tiny", "--steps", "2", "--device", "cuda", "--no-progress",
                   "--out", str(out), *extra)
    assert proc.returncode == 0, proc.stderr[-6000:]
    with open(out / "report.json") as f:
        return json.load(f)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("recipe", ["none", "fp8_per_tensor"])
def test_job_graphed_matches_eager(tmp_path, recipe):
    eager = _job(tmp_path, "eager", "--recipe", recipe)
    graphed = _job(tmp_path, "graphed", "--recipe", recipe, "--cuda-graph", "--check-parity")
    assert eager["cuda_graph"] is None and graphed["config"]["cuda_graph"] is True
    assert graphed["cuda_graph"]["graphed"] == ["blocks.0", "blocks.1"]
    assert graphed["cuda_graph"]["sample_shape"] == [8, 64, 64]  # 16 sequences / 2 microbatches
    assert graphed["loss"][0] == eager["loss"][0], (graphed["loss"], eager["loss"])  # the module docstring
    assert abs(graphed["loss"][1] - eager["loss"][1]) <= train.PARITY_LOSS_ATOL, (graphed["loss"], eager["loss"])
    assert graphed["parity"]["passed"], graphed["parity"]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_block_forward_and_backward_never_sync():
    """The CUDA path of a block (router counts, token sort, grouped GEMMs, combine) and its drain run under
    ``set_sync_debug_mode("error")``: what graphing needs."""
    model = MoEGPT(MoEGPTConfig(), device="cuda", param_dtype=torch.bfloat16)
    x = torch.randn(4, 64, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    block = model.blocks[0]
    for check in (False, True):  # the first pass compiles and loads the kernels
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if check else "default")
        try:
            block(x).float().square().sum().backward()
            distwgrad.drain_deferred_wgrads(block)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        distwgrad.finalize_model_grads([block])


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_train_step_bench_graphed_mode(tmp_path):
    out = tmp_path / "bench.json"
    proc = _python("qa/bench/train_step.py", "--model", "tiny", "--precisions", "bf16,fp8_per_tensor,fp8_blockwise",
                   "--modes", "eager", "--cuda-graph", "--warmup", "1", "--rounds", "1", "--steps", "1",
                   "--no-record", "--json", str(out), timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    graphed = {(r["impl"], r["precision"]) for r in report["rows"] if r["case"] == "tiny b16x64 mb2 cuda_graph"}
    assert graphed == {("distwgrad", "bf16"), ("torch", "bf16"), ("distwgrad", "fp8_per_tensor"),
                       ("distwgrad", "fp8_blockwise")}, graphed
    not_run = {(n["impl"], n["precision"]) for n in report["not_run"] if n["mode"] == "cuda_graph"}
    assert not_run == {("fsdp2", "bf16")}, report["not_run"]
    checks = {c["build"]: c for c in report["loss_checks"]}
    assert checks["distwgrad/bf16/cuda_graph"]["vs_ungraphed_abs_diff"] == 0.0, checks  # replay: eager's kernels
    assert all(c["ok"] for c in checks.values()), checks


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_layer_step_bench_graphed():
    proc = _python("qa/bench/layer_step.py", "--tiny", "--embed", "--cuda-graph", "--reps", "1", "--no-record")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = [line.strip() for line in proc.stdout.splitlines() if "cuda_graph" in line]
    for precision in ("bf16", "fp8_per_tensor", "fp8_blockwise"):
        assert any(f" {precision} " in line and "x eager" in line for line in lines), proc.stdout
