"""The training job end to end: torchrun on CPU/gloo, parity, reports, resharded resume, bad arguments.

One 2-rank run (30 steps, ``--check-parity``, a checkpoint every 10 steps) is shared by the tests that
read its report or resume its checkpoints (module fixture), so torchrun start-up is paid a few times,
not per assertion.

Tolerances: a resumed run restores weights, AdamW state and step exactly, so its losses differ from the
uninterrupted run's only by the order in which ranks' partial losses and gradients are summed; over the
4 steps compared that is below 1e-6 (measured 5e-7 on 1 and 3 ranks), bounded by the job's own
``PARITY_LOSS_ATOL`` (1e-5). Longer horizons would not do: top-k routing is chaotic and amplifies
rounding (see [Note: parity] in ``launch/train.py``).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

import distwgrad
from distwgrad.checkpoint import CheckpointError, load_checkpoint, resolve_checkpoint
from distwgrad.data import MarkovCorpus
from distwgrad.models import MoEGPT, MoEGPTConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, SAVE_EVERY, RESUME_AT, RESUME_TO = 30, 10, 10, 14
SMALL = ["--global-batch", "12", "--microbatches", "2", "--seq-len", "32", "--d-model", "32", "--d-ff", "64",
         "--no-progress", "--log-every", "10"]  # 12 sequences: divisible by 1, 2 and 3 ranks x 2 microbatches
CONFIG = MoEGPTConfig(seq_len=32, d_model=32, d_ff=64)  # the model SMALL builds

# ``distwgrad.launch`` exists once installed (``pip install -e .``); a bare checkout on PYTHONPATH has no
# such package (setuptools maps it onto ``launch/`` only at install time), so there the same files run
# as ``launch``.
LAUNCH = "distwgrad.launch" if importlib.util.find_spec("distwgrad.launch") else "launch"
MODULE = f"{LAUNCH}.train"


def _launch(name: str):
    if LAUNCH == "launch" and REPO not in sys.path:
        sys.path.insert(0, REPO)
    return importlib.import_module(f"{LAUNCH}.{name}")


LOSS_ATOL = _launch("train").PARITY_LOSS_ATOL  # see the module docstring


def _run(args: list[str], nproc: int | None = 2, env: dict | None = None, timeout: float = 240):
    """``torchrun --standalone --nproc-per-node N -m <job> ARGS`` (or plain ``python -m`` with None)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd = (launcher if nproc else [sys.executable]) + ["-m", MODULE, *args]
    full_env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run(cmd, env=full_env, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def _ok(proc) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"


def _report(out) -> dict:
    with open(os.path.join(out, "report.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("base"))
    proc = _run(["--steps", str(STEPS), "--save-every", str(SAVE_EVERY), "--check-parity", "--out", out, *SMALL])
    _ok(proc)
    return out, proc


# --- the uninterrupted run -----------------------------------------------------------------------------

@pytest.mark.distributed
def test_loss_decreases_and_parity_passes(base_run):
    out, proc = base_run
    r = _report(out)
    assert r["steps"] == list(range(1, STEPS + 1)) and len(r["loss"]) == STEPS
    first, last = sum(r["loss"][:5]) / 5, sum(r["loss"][-5:]) / 5
    assert r["loss"][0] == pytest.approx(r["corpus"]["uniform_loss"], abs=0.05)  # ln(64) at the init
    assert last < first - 0.2, r["loss"]
    parity = r["parity"]
    assert parity["passed"] and parity["weights_compared"], parity
    assert parity["max_abs_diff"] <= parity["tolerance"]["loss_abs"] == LOSS_ATOL
    assert parity["max"]["grad_rel"] <= parity["tolerance"]["grad_rel"]
    assert "parity (lockstep, 30 steps, fp32): max |loss diff|" in proc.stderr and "PASSED" in proc.stderr


@pytest.mark.distributed
@pytest.mark.parametrize("recipe", ["fp8_per_tensor", "fp8_blockwise"])
def test_fp8_recipes_train_with_lockstep_parity(recipe, tmp_path):
    """Under FP8 the reference is the same model with whole weights on rank 0 (plain torch has no FP8):
    sharding must change nothing, so the lockstep tolerances are the fp32 ones."""
    out = str(tmp_path / recipe)
    proc = _run(["--steps", "6", "--recipe", recipe, "--check-parity", "--out", out, *SMALL])
    _ok(proc)
    r = _report(out)
    assert r["config"]["recipe"] == recipe
    assert r["parity"]["passed"], r["parity"]
    assert r["parity"]["max"]["grad_rel"] <= r["parity"]["tolerance"]["grad_rel"]


@pytest.mark.distributed
def test_report_plot_and_counters(base_run):
    out, proc = base_run
    r = _report(out)
    assert r["world_size"] == 2 and r["backend"] == "gloo" and r["device"] == "cpu"
    assert r["config"]["steps"] == STEPS and r["config"]["recipe"] == "none"
    assert len(r["tokens_per_s"]) == STEPS and r["tokens_per_s_mean"] > 0 and r["wall_time_s"] > 0
    assert r["peak_memory"]["source"].startswith("resource.getrusage")
    assert len(r["peak_memory"]["bytes_per_rank"]) == 2 and r["peak_memory"]["max_bytes"] > 0
    # The job coalesces ([Note: coalesced units]). Per microbatch every block weight gathers twice
    # (forward, dgrad); the tied embedding / lm_head weight is the root unit's: one gather serves the
    # embedding and the head in forward, one more the head's dgrad (the embedding's backward needs no
    # weight), except in the run's first microbatch, where the units learn who asks and each use gathers
    # on its own (3 gathers). Each distinct weight reduce-scatters its fp32 buffer once per microbatch.
    # All shards are even on 2 ranks (no padding).
    V, D, E, Fh, L, M = 64, 32, 4, 64, 2, 2  # vocab, width, experts, expert width, layers, microbatches
    per_layer = 3 * D * D + D * D + E * D + 2 * E * Fh * D
    steady = M * 4 * (2 * V * D + 2 * L * per_layer)
    reduced = M * 4 * (V * D + L * per_layer)
    gathered = r["bytes_all_gathered_per_step"]
    assert gathered[0] == steady + 4 * V * D and set(gathered[1:]) == {steady}, gathered[:3]
    assert set(r["bytes_reduce_scattered_per_step"]) == {reduced}
    with open(os.path.join(out, "loss.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert [os.path.basename(p) for p in r["checkpoints"]] == ["step_10", "step_20", "step_30"]


@pytest.mark.distributed
def test_only_rank_zero_logs(base_run):
    _, proc = base_run
    assert proc.stderr.count("step 10/30") == 1  # one log line, not one per rank
    assert "Traceback" not in proc.stderr


# --- checkpoints -----------------------------------------------------------------------------------------

@pytest.mark.distributed
@pytest.mark.parametrize("nproc", [1, 3])
def test_resume_reshards_and_continues_the_same_losses(base_run, nproc, tmp_path):
    out, _ = base_run
    ckpt = os.path.join(out, "checkpoints", f"step_{RESUME_AT}")
    _ok(_run(["--steps", str(RESUME_TO), "--resume", ckpt, "--out", str(tmp_path), *SMALL], nproc=nproc))
    resumed, full = _report(str(tmp_path)), _report(out)
    assert resumed["start_step"] == RESUME_AT and resumed["world_size"] == nproc
    assert resumed["steps"] == list(range(RESUME_AT + 1, RESUME_TO + 1))
    want = full["loss"][RESUME_AT:RESUME_TO]
    diffs = [abs(a - b) for a, b in zip(resumed["loss"], want)]
    assert max(diffs) <= LOSS_ATOL, (resumed["loss"], want)


@pytest.mark.distributed  # uses the 2-rank base run
def test_checkpoint_holds_the_tied_weight_once_and_loads_in_process(base_run):
    """No process group in this process: the 2-rank checkpoint loads resharded to a group of one."""
    out, _ = base_run
    path = os.path.join(out, "checkpoints", "step_30")
    keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    assert "model.embedding.weight" in keys and not any("lm_head" in k for k in keys)
    assert "optim.embedding.weight.exp_avg" in keys and "train.step" in keys
    model = MoEGPT(CONFIG)
    opt = torch.optim.AdamW(model.parameters())
    before = model.embedding.weight.detach().clone()
    with torch.random.fork_rng():
        step = load_checkpoint(path, model, opt, expect={"model_config": dataclasses.asdict(CONFIG)})
    assert step == 30
    assert model.lm_head.weight is model.embedding.weight  # still one object
    assert not torch.equal(model.embedding.weight.detach(), before)
    assert float(opt.state[model.embedding.weight]["step"]) == 30


@pytest.mark.distributed  # uses the 2-rank base run
def test_bad_checkpoints_give_clear_errors(base_run, tmp_path):
    out, _ = base_run
    src = os.path.join(out, "checkpoints", "step_20")
    model = MoEGPT(CONFIG, sharded=False)
    expect = {"model_config": dataclasses.asdict(CONFIG)}
    # Another model: the config fields that differ are named.
    other = dataclasses.replace(CONFIG, d_model=16)
    with pytest.raises(CheckpointError, match=r"another model: model_config: .*'d_model': \(32, 16\)"):
        load_checkpoint(src, MoEGPT(other, sharded=False), expect={"model_config": dataclasses.asdict(other)})
    # Partial: DCP's metadata missing, or a data file truncated.
    for name, damage in ((".metadata", os.remove), ("__1_0.distcp", lambda p: os.truncate(p, 10))):
        broken = str(tmp_path / f"broken{name}")
        shutil.copytree(src, broken)
        damage(os.path.join(broken, name))
        with pytest.raises(CheckpointError, match=r"is incomplete"):
            load_checkpoint(broken, model, expect=expect)
    # An interrupted save leaves step_N.tmp, which resolving a folder of checkpoints skips.
    root = str(tmp_path / "root")
    shutil.copytree(src, os.path.join(root, "step_20"))
    shutil.copytree(src, os.path.join(root, "step_40.tmp"))
    assert resolve_checkpoint(root) == os.path.join(root, "step_20")
    shutil.rmtree(os.path.join(root, "step_20"))
    with pytest.raises(CheckpointError, match=r"no complete checkpoint in .*found \['step_40.tmp'\]"):
        resolve_checkpoint(root)
    with pytest.raises(CheckpointError, match=r"does not exist"):
        resolve_checkpoint(str(tmp_path / "nowhere"))


def test_a_step_leaves_no_autograd_history():
    """In process, a group of one: after a step no gradient carries a graph (deferred wgrads drained in
    grad mode must not record autograd history: WeightGradStore.pop runs them under no_grad)."""
    train = _launch("train")
    model = MoEGPT(CONFIG)
    opt = torch.optim.AdamW(model.parameters())
    corpus = MarkovCorpus(CONFIG.vocab_size, CONFIG.seq_len)
    for step in (1, 2):
        train.forward_backward(model, corpus.global_batch(step, 4), 2)
        assert distwgrad.finalize_model_grads([model]) == len(list(model.parameters()))
        for name, p in model.named_parameters():
            assert p.grad is not None and p.grad.grad_fn is None and not p.grad.requires_grad, name
            assert not p.main_grad.requires_grad, name
        opt.step()
        opt.zero_grad()


def test_every_recipe_has_its_autocast():
    """Each ``--recipe`` opens the FP8 recipe it names; ``fp8_per_tensor_te`` is per-tensor scaling with
    TransformerEngine's accumulation (fprop without the split accumulator, dgrad and wgrad with it)."""
    from distwgrad.fp8 import BlockwiseScaling, PerTensorScaling, current_recipe, split_accumulator
    train, config = _launch("train"), _launch("config")
    assert set(train._RECIPES) == set(config.RECIPES)
    seen = {}
    for name in config.RECIPES:
        with train._RECIPES[name]():
            seen[name] = current_recipe()
    assert seen["none"] is None and isinstance(seen["fp8_blockwise"], BlockwiseScaling)
    assert isinstance(seen["fp8_per_tensor"], PerTensorScaling)
    assert [split_accumulator(seen["fp8_per_tensor_te"], g) for g in ("fprop", "dgrad", "wgrad")] == [False, True, True]
    assert all(split_accumulator(seen["fp8_per_tensor"], g) for g in ("fprop", "dgrad", "wgrad"))


def test_config_validates_and_names_the_values():
    config = _launch("config")
    with pytest.raises(ValueError, match=r"global_batch=10 is not divisible by microbatches=4"):
        config.TrainConfig(global_batch=10, microbatches=4)
    with pytest.raises(ValueError, match=r"recipe='fp8' must be one of \('none', 'fp8_per_tensor', "
                                         r"'fp8_per_tensor_te', 'fp8_blockwise'\)"):
        config.TrainConfig(recipe="fp8")
    with pytest.raises(ValueError, match=r"world size \* microbatches = 3 \* 2 = 6"):
        config.TrainConfig().check_world_size(3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.TrainConfig().steps = 3
    assert config.TrainConfig().model_config() == MoEGPTConfig()


# --- bad arguments ---------------------------------------------------------------------------------------

BAD = [
    (["--recipe", "fp8"], {}, r"argument --recipe: invalid choice: 'fp8'"),
    (["--n-heads", "5"], {}, r"d_model=64 must split into n_heads=5 heads"),
    (["--steps", "0"], {}, r"\{'steps': 0\}"),
    (["--global-batch", "16"], {"WORLD_SIZE": "3"}, r"global_batch=16 must be divisible by world size \* "
                                                    r"microbatches = 3 \* 2 = 6"),
    (["--bogus"], {}, r"unrecognized arguments: --bogus"),
]


def test_bad_arguments_exit_2_with_one_line():
    procs = [subprocess.Popen([sys.executable, "-m", MODULE, *args], cwd=REPO, text=True,
                              env=dict(os.environ, PYTHONPATH=REPO, **env), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE) for args, env, _ in BAD]
    for proc, (args, _, pattern) in zip(procs, BAD):
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 2, (args, stderr)
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("distwgrad.launch.train: error: "), (args, stderr)
        assert re.search(pattern, lines[0]) and "Traceback" not in stderr and not stdout, (args, stderr)


def test_help_documents_every_option():
    config = _launch("config")
    text = config.build_parser().format_help()
    for f in dataclasses.fields(config.TrainConfig):
        assert "--" + f.name.replace("_", "-") in text, f.name
    assert "--steps" in text and "--out" in text and "--check-parity" in text


@pytest.mark.distributed  # uses the 2-rank base run
def test_mismatched_resume_exits_2(base_run, tmp_path):
    out, _ = base_run
    proc = _run(["--resume", os.path.join(out, "checkpoints"), "--out", str(tmp_path), *SMALL,
                 "--d-model", "16"], nproc=None)  # the last --d-model wins
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.strip().splitlines() if "error" in line]  # after the first log line
    assert len(errors) == 1 and errors[0] == proc.stderr.strip().splitlines()[-1], proc.stderr
    assert "written for another model" in errors[0] and "'d_model': (32, 16)" in errors[0]
    assert "Traceback" not in proc.stderr


@pytest.mark.distributed
def test_bad_arguments_under_torchrun():
    """torchrun adds its own failure summary (it always does); the job prints its line once, on rank 0."""
    proc = _run(["--global-batch", "9"], nproc=2, timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.count("distwgrad.launch.train: error: global_batch=9 is not divisible by "
                             "microbatches=2") == 1
    assert "exitcode  : 2" in proc.stderr


# --- presets, precision, data, summary ------------------------------------------------------------------

def test_presets_fill_what_is_not_given():
    config = _launch("config")
    tiny, small, large = (config.TrainConfig(model=m) for m in ("tiny", "small", "large"))
    assert tiny.model_config() == MoEGPTConfig() and tiny.global_batch == 16 and tiny.lr == 1e-2
    assert 1e6 < small.model_config().num_params() < 1e7
    big = large.model_config()
    assert big.num_params() >= 5e8 and big.d_model >= 2048 and big.n_layers >= 8 and big.n_experts >= 16
    assert big.top_k == 2 and big.vocab_size >= 32000 and big.seq_len >= 2048
    # fp32 masters, gradients and two AdamW moments: 16 bytes a parameter, far inside one H200's 141 GB
    assert 16 * big.num_params() < 40e9
    for ranks in (1, 2, 4, 8):
        large.check_world_size(ranks)
    over = config.parse_args(["--model", "small", "--d-model", "64", "--lr", "0.5"])
    assert (over.d_model, over.n_layers, over.lr, over.vocab_size) == (64, 4, 0.5, 256)
    assert "(default: from --model)" in config.build_parser().format_help()


def test_model_counts_and_grouped_mm_experts():
    """``num_params`` counts the tied weight once; the plain build's experts give the same numbers through
    ``torch._grouped_mm`` as through the loop, and with ``param_dtype`` its gradients stay fp32."""
    model = MoEGPT(CONFIG, sharded=False)
    assert sum(p.numel() for p in model.parameters()) == CONFIG.num_params()
    ids = MarkovCorpus(CONFIG.vocab_size, CONFIG.seq_len).global_batch(1, 4)
    for dtype, tol in ((None, 1e-6), (torch.bfloat16, 2e-2)):
        grads = {}
        for experts in ("loop", "grouped_mm"):
            m = MoEGPT(CONFIG, sharded=False, experts=experts, param_dtype=dtype)
            m.loss(ids[:, :-1], ids[:, 1:]).backward()
            grads[experts] = {n: p.grad for n, p in m.named_parameters()}
            assert all(g.dtype == torch.float32 for g in grads[experts].values())
        for name, g in grads["loop"].items():
            assert (g - grads["grouped_mm"][name]).abs().max() <= tol * g.abs().max(), (dtype, name)
    with pytest.raises(ValueError, match=r"experts='grouped_mm' must be one of .* only with sharded=False"):
        MoEGPT(CONFIG, experts="grouped_mm")


@pytest.mark.distributed
def test_summary(base_run):
    out, proc = base_run
    r = _report(out)
    s = r["summary"]
    assert s["final_loss"] == r["loss"][-1] and s["best_loss"] == min(r["loss"])
    assert r["loss"][s["best_step"] - 1] == s["best_loss"]
    assert s["tokens_per_s"] == r["tokens_per_s_mean"] > 0 and s["wall_time_s"] > 0
    assert s["params"] == CONFIG.num_params() and s["flops_per_token"] == CONFIG.flops_per_token()
    assert s["mfu"] is None and s["peak_flops_per_s_per_device"] is None  # CPU: no bf16 peak measured
    assert len(s["peak_memory_bytes_per_rank"]) == 2 and min(s["peak_memory_bytes_per_rank"]) > 0
    assert r["precision"] == "fp32" and r["segments"] == [{"first_step": 1, "last_step": STEPS, "world_size": 2,
                                                           "resumed_from": None, "wall_time_s": r["wall_time_s"]}]
    first = proc.stderr.strip().splitlines()[0]
    assert f"{CONFIG.num_params():,} parameters" in first, first


@pytest.mark.distributed
def test_bf16_trains_with_lockstep_parity(tmp_path):
    proc = _run(["--steps", "20", "--precision", "bf16", "--check-parity", "--out", str(tmp_path), *SMALL])
    _ok(proc)
    r = _report(str(tmp_path))
    assert r["precision"] == "bf16" and r["config"]["precision"] == "bf16"
    assert sum(r["loss"][-5:]) / 5 < sum(r["loss"][:5]) / 5 - 0.2, r["loss"]
    tol = _launch("train").PARITY_BF16
    assert r["parity"]["passed"] and r["parity"]["tolerance"] == tol, r["parity"]


def _token_file(path, n: int = 20_000, vocab: int = 60) -> str:
    """A file in nanoGPT's convention: flat little-endian uint16 tokens."""
    np = pytest.importorskip("numpy")
    np.random.default_rng(0).integers(0, vocab, n).astype("<u2").tofile(path)
    return str(path)


def test_token_file_windows_are_distinct_and_split_by_rank(tmp_path):
    from distwgrad.data import DataError, TokenFile
    data = TokenFile(_token_file(tmp_path / "t.bin"), vocab_size=64, seq_len=32, seed=3)
    for step in (1, 2, 3):
        starts = data._windows(step, 12)
        assert len(set(starts)) == 12 and all((b - a) % 33 == 0 for a, b in zip(starts, starts[1:]))
        whole = data.global_batch(step, 12)
        assert whole.dtype == torch.int64 and whole.shape == (12, 33) and int(whole.max()) < 60
        assert torch.equal(torch.cat([data.local_batch(step, 12, r, 3) for r in range(3)]), whole)
    assert not torch.equal(data.global_batch(1, 12), data.global_batch(2, 12))
    with pytest.raises(DataError, match=r"largest token is 59, outside --vocab-size 50"):
        TokenFile(str(tmp_path / "t.bin"), vocab_size=50, seq_len=32)


@pytest.mark.distributed
def test_trains_on_a_token_file(tmp_path):
    path = _token_file(tmp_path / "train.bin")
    proc = _run(["--steps", "4", "--data", path, "--out", str(tmp_path / "run"), *SMALL])
    _ok(proc)
    r = _report(str(tmp_path / "run"))
    assert r["corpus"]["kind"] == "token_file" and r["corpus"]["tokens"] == 20_000 and len(r["loss"]) == 4
    bad = _run(["--data", path, "--vocab-size", "32", "--out", str(tmp_path / "bad"), *SMALL], nproc=None)
    assert bad.returncode == 2
    assert "largest token is 59, outside --vocab-size 32" in bad.stderr.strip().splitlines()[-1], bad.stderr


# --- resume rules ----------------------------------------------------------------------------------------

@pytest.mark.distributed  # uses the 2-rank base run
def test_resume_at_or_past_steps_exits_2(base_run, tmp_path):
    out, _ = base_run
    proc = _run(["--steps", "20", "--resume", os.path.join(out, "checkpoints"), "--out", str(tmp_path), *SMALL],
                nproc=None)
    assert proc.returncode == 2, proc.stderr
    assert "is at step 30, at or past --steps 20" in proc.stderr.strip().splitlines()[-1], proc.stderr


@pytest.mark.distributed  # uses the 2-rank base run
def test_resume_into_the_same_out_keeps_the_history(base_run, tmp_path):
    out, _ = base_run
    run = str(tmp_path / "run")
    shutil.copytree(out, run)
    ckpt = os.path.join(run, "checkpoints", f"step_{RESUME_AT}")
    _ok(_run(["--steps", str(RESUME_TO), "--resume", ckpt, "--out", run, *SMALL], nproc=None))
    before, after = _report(out), _report(run)
    assert after["steps"] == list(range(1, RESUME_TO + 1))
    assert after["loss"][:RESUME_AT] == before["loss"][:RESUME_AT]
    diffs = [abs(a - b) for a, b in zip(after["loss"][RESUME_AT:], before["loss"][RESUME_AT:RESUME_TO])]
    assert max(diffs) <= LOSS_ATOL
    assert [(s["first_step"], s["last_step"], s["world_size"]) for s in after["segments"]] == [
        (1, RESUME_AT, 2), (RESUME_AT + 1, RESUME_TO, 1)]
    assert after["summary"]["best_loss"] == min(after["loss"])


# --- the documented commands run as written --------------------------------------------------------------

def _help_commands() -> list[str]:
    """The command lines of ``--help`` (the module docstring's ``Commands::`` block)."""
    doc = _launch("train").__doc__.split("Commands::")[1].split("\n\n\n")[0]
    return [line.strip() for line in doc.splitlines() if line.strip().startswith(("torchrun ", "python "))]


def _readme() -> str:
    with open(os.path.join(REPO, "README.md")) as f:
        return f.read()


def _readme_job_command() -> str:
    """The torchrun half of the README's first command (``qa/fresh_install.sh`` runs the pip half too)."""
    first = _readme().split("```bash\n")[1].split("```")[0].strip()
    assert first.startswith("pip install torch==") and " && torchrun " in first, first
    return first.split(" && ", 1)[1]


def _shell(command: str, cwd) -> subprocess.Popen:
    """One documented command, as written but for the interpreter and, in a bare checkout, the module name;
    a ``--steps`` override is appended (argparse takes the last), 4 for a resume and 2 otherwise."""
    argv = command.split()
    if argv[0] == "torchrun":
        argv[:1] = [sys.executable, "-m", "torch.distributed.run"]
    elif argv[0] == "python":
        argv[0] = sys.executable
    argv = [MODULE if a == "distwgrad.launch.train" else a for a in argv]
    if "--help" not in argv:
        argv += ["--steps", "4" if "--resume" in argv else "2", "--no-progress"]
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    return subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait(command: str, proc: subprocess.Popen, timeout: float = 600) -> str:
    stdout, stderr = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"{command}\nexit {proc.returncode}\n{stderr[-6000:]}"
    return stdout


@pytest.mark.distributed
def test_every_documented_command_runs(tmp_path):
    """Each in its own folder, three at a time (start-up dominates), but the resume after its save."""
    commands = _help_commands()
    assert len(commands) >= 8 and _readme_job_command() in commands
    resume = [c for c in commands if "--resume" in c]
    assert len(resume) == 1 and "--nproc-per-node 4" in resume[0]
    save = [c for c in commands if "--out runs/a" in c and c not in resume]
    assert len(save) == 1
    others = [c for c in commands if c not in resume + save]
    _token_file(tmp_path / "train.bin")  # the --data example's file
    _wait(save[0], _shell(save[0], tmp_path))
    batches = [[resume[0]] + others[:2]] + [others[i:i + 3] for i in range(2, len(others), 3)]
    outputs = {}
    for batch in batches:
        running = []
        for i, command in enumerate(batch):
            cwd = tmp_path if command in resume else tmp_path / f"{len(outputs)}_{i}"
            os.makedirs(cwd, exist_ok=True)
            if "--data" in command:
                shutil.copy(tmp_path / "train.bin", cwd)
            running.append((command, _shell(command, cwd)))
        outputs.update({command: _wait(command, proc) for command, proc in running})
    assert "usage: distwgrad.launch.train" in outputs["python -m distwgrad.launch.train --help"]
    resumed = _report(str(tmp_path / "runs" / "a"))  # saved at step 2, resumed to 4 into the same folder
    assert resumed["steps"] == [1, 2, 3, 4] and [s["world_size"] for s in resumed["segments"]] == [2, 4]


@pytest.mark.distributed
def test_readme_usage_example_prints_per_rank(tmp_path):
    snippet = _readme().split("## Use")[1].split("```python\n")[1].split("```")[0]
    (tmp_path / "use.py").write_text(snippet)
    command = "torchrun --standalone --nproc-per-node 2 use.py --help"  # --help: no --steps appended
    stdout = _wait(command, _shell(command, tmp_path))
    # the two ranks share one pipe, so their lines may interleave
    found = re.findall(r"rank (\d): loss \d+\.\d{4}, gradient norm of this rank's rows \d+\.\d{4}", stdout)
    assert sorted(found) == ["0", "1"], stdout


def test_every_import_of_the_job_is_a_declared_dependency():
    """A fresh ``pip install -e .`` must be all the job needs: every third-party module the job's files
    import (at the top or inside a function) is in ``[project] dependencies``."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    declared = {re.split(r"[<>=!~ \[]", d)[0].lower() for d in deps}
    files = [os.path.join(REPO, "launch", n) for n in os.listdir(os.path.join(REPO, "launch")) if n.endswith(".py")]
    files += [os.path.join(REPO, "distwgrad", n) for n in ("data.py", "checkpoint.py")]
    files += [os.path.join(REPO, "distwgrad", "models", "moe_gpt.py")]
    imported = set()
    for path in files:
        with open(path) as f:
            for node in ast.walk(ast.parse(f.read())):
                if isinstance(node, ast.Import):
                    imported |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    imported.add(node.module.split(".")[0])
    third_party = imported - set(sys.stdlib_module_names) - {"distwgrad", "__future__"}
    assert third_party <= declared, (third_party - declared, declared)
    assert {"numpy", "matplotlib"} <= third_party


def test_learning_rate_warm_up_is_a_pure_function_of_the_step():
    """``--warmup-steps N``: step s trains at lr * min(1, s / N); the large preset warms up, the CPU presets
    do not; a negative count is refused naming it."""
    from launch.config import PRESETS, TrainConfig

    config = TrainConfig(lr=1e-3, warmup_steps=4)
    assert [config.lr_at(s) for s in (1, 2, 4, 9)] == [2.5e-4, 5e-4, 1e-3, 1e-3]
    assert TrainConfig(lr=1e-3).lr_at(1) == 1e-3  # tiny: constant
    assert PRESETS["large"]["warmup_steps"] > 0 and PRESETS["tiny"]["warmup_steps"] == 0
    with pytest.raises(ValueError, match="warmup_steps"):
        TrainConfig(warmup_steps=-1)
