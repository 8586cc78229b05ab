"""The training job's options and pieces: config checks, presets, recipes, the model and data in process,
and bad arguments (one ``error:`` line and exit code 2, with ``python -m`` and under torchrun).
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from train_job_cases import CONFIG, MODULE, REPO, _launch, _run, _token_file

import distwgrad
from distwgrad.data import MarkovCorpus
from distwgrad.models import MoEGPT, MoEGPTConfig
from distwgrad.testing.job_ranks import run_job


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
    for args, env, pattern in BAD:  # each a process of its own, forked: [Note: forked job ranks]
        proc = run_job(MODULE, args, None, env=dict(PYTHONPATH=REPO, **env), cwd=REPO, timeout=120)
        stdout, stderr = proc.stdout, proc.stderr
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


@pytest.mark.distributed
def test_bad_arguments_under_torchrun():
    """torchrun adds its own failure summary (it always does); the job prints its line once, on rank 0."""
    proc = _run(["--global-batch", "9"], nproc=2, timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.count("distwgrad.launch.train: error: global_batch=9 is not divisible by "
                             "microbatches=2") == 1
    assert "exitcode  : 2" in proc.stderr


# --- presets, model, data --------------------------------------------------------------------------------

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
    # xl: the FP8-sized preset, d_model 4096, d_ff >= 8192, >= 8 layers and experts; its 16 bytes a parameter
    # leave over 40 GB of one H200's 141 GB for the compute copies and activations
    xl = config.TrainConfig(model="xl")
    wide = xl.model_config()
    assert (wide.d_model, wide.seq_len) == (4096, 2048) and wide.d_ff >= 8192
    assert wide.n_layers >= 8 and wide.n_experts >= 8
    assert 16 * wide.num_params() < 100e9
    for ranks in (1, 2, 4, 8):
        xl.check_world_size(ranks)
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


@pytest.mark.parametrize("every, collected_at", [(2, [2, 4]), (0, [])])
def test_training_collects_garbage_every_n_steps(every, collected_at, tmp_path, monkeypatch):
    """[Note: garbage collection in training]: with ``--gc-every N`` the automatic collector is off while the
    loop trains and a generation-1 collection runs after the optimizer of every N-th step; the collector is
    on again when the job returns. ``--gc-every 0`` leaves it on and collects nothing itself."""
    import gc
    train = _launch("train")
    seen = []
    monkeypatch.setattr(train.gc, "collect", lambda generation=2: seen.append((generation, gc.isenabled())))
    original_step = train.optimizer_step
    enabled = []
    monkeypatch.setattr(train, "optimizer_step", lambda *a: (enabled.append(gc.isenabled()), original_step(*a)))
    assert gc.isenabled()
    code = train.main(["--model", "tiny", "--steps", "5", "--device", "cpu", "--no-progress", "--gc-every",
                       str(every), "--out", str(tmp_path / "run"), "--log-every", "0"])
    assert code == 0 and gc.isenabled()
    assert enabled == [every == 0] * 5
    assert [g for g, _ in seen] == [1] * len(collected_at) and len(seen) == len(collected_at)
    with pytest.raises(ValueError, match="gc_every"):
        _launch("config").TrainConfig(gc_every=-1)
