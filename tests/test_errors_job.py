"""Errors of the training job's pieces (options, data, model, checkpoints), one case per docs/errors.md ID.

In process and on one rank: the job's own exit-code tests (tests/test_train_job_config.py,
tests/test_train_job_runs.py) run torchrun.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from distwgrad.launch.config import TrainConfig
from torch import nn

from distwgrad.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from distwgrad.data import DataError, MarkovCorpus, TokenFile
from distwgrad.models.moe_gpt import MoEGPT, MoEGPTConfig
from distwgrad.models.moe_gpt_stage import MoEGPTStage

TINY = MoEGPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=1, n_heads=2, n_experts=2, top_k=1, d_ff=16)


def _tokens(tmp_path, values, name="t.bin"):
    path = tmp_path / name
    np.asarray(values, dtype=np.uint16).tofile(path)
    return str(path)


CASES = [
    ("JOB-001", lambda p: MarkovCorpus(vocab_size=2, seq_len=8), ValueError, "vocab_size=2"),
    ("JOB-002", lambda p: MarkovCorpus(vocab_size=32, seq_len=8).global_batch(-1, 4), ValueError, "-1, 4"),
    ("JOB-003", lambda p: MarkovCorpus(vocab_size=32, seq_len=8).local_batch(0, 5, rank=0, world_size=2),
     ValueError, "global batch 5 cannot be split over 2 ranks"),
    ("JOB-004", lambda p: TokenFile(str(p / "none.bin"), 32, 8), DataError, "none.bin"),
    ("JOB-005", lambda p: TokenFile(_odd_file(p), 32, 8), DataError, "3 bytes"),
    ("JOB-006", lambda p: TokenFile(_tokens(p, range(10)), 32, 8), DataError, r"10 tokens .* seq_len \+ 1 = 9"),
    ("JOB-008", lambda p: TokenFile(_tokens(p, [1] * 100), 32, 8).global_batch(0, 0), ValueError, "0, 0"),
    ("JOB-009", lambda p: TokenFile(_tokens(p, [1] * 100), 32, 8).global_batch(0, 64), DataError,
     "global batch of 64"),
    ("JOB-010", lambda p: MoEGPTConfig(d_model=0), ValueError, "'d_model': 0"),
    ("JOB-011", lambda p: MoEGPTConfig(d_model=64, n_heads=5), ValueError, "n_heads=5"),
    ("JOB-012", lambda p: MoEGPTConfig(n_experts=2, top_k=3), ValueError, "top_k=3"),
    ("JOB-013", lambda p: MoEGPTConfig(init_std=0.0), ValueError, "got 0.0"),
    ("JOB-082", lambda p: MoEGPTConfig(aux_loss_coef=-0.01), ValueError, "got -0.01"),
    ("JOB-083", lambda p: MoEGPTStage(MoEGPTConfig(aux_loss_coef=0.01), range(1), first=True, last=False),
     ValueError, "aux_loss_coef=0.01"),
    ("JOB-014", lambda p: MoEGPT({"d_model": 16}, sharded=False), TypeError, "dict"),
    ("JOB-016", lambda p: MoEGPT(TINY, sharded=False, param_dtype=torch.int32), ValueError, "torch.int32"),
    ("JOB-017", lambda p: MoEGPT(TINY, sharded=False)(torch.zeros(1, 9, dtype=torch.long)), ValueError,
     r"seq <= 8\], got \(1, 9\)"),
    ("JOB-018", lambda p: TrainConfig(model="huge"), ValueError, "'huge'"),
    ("JOB-022", lambda p: TrainConfig(lr=0.0), ValueError, "lr=0.0"),
    ("JOB-023", lambda p: TrainConfig(out=""), ValueError, "empty string"),
    ("JOB-033", lambda p: TrainConfig(cuda_graph=True).check_world_size(2), ValueError,
     "on 2 ranks needs --no-coalesce"),
    ("CKP-002", lambda p: load_checkpoint(str(p / "nowhere"), nn.Linear(2, 2)), CheckpointError, "nowhere"),
    ("CKP-004", lambda p: load_checkpoint(_damaged(p, "meta.json", os.remove), _model()), CheckpointError,
     "missing .*meta.json"),
    ("CKP-005", lambda p: load_checkpoint(_damaged(p, ".metadata", _garble), _model()), CheckpointError,
     r"unreadable \.metadata"),
    ("CKP-007", lambda p: load_checkpoint(_damaged(p, "meta.json", _edit(format=99)), _model()), CheckpointError,
     "has format 99"),
    ("CKP-009", lambda p: load_checkpoint(_saved(p), nn.Linear(3, 3)), CheckpointError, "full shapes"),
    ("CKP-010", lambda p: load_checkpoint(_damaged(p, "meta.json", _edit(step=7)), _model()), CheckpointError,
     "says step 7"),
]


def _odd_file(p):
    path = p / "odd.bin"
    path.write_bytes(b"abc")
    return str(path)


def _model():
    torch.manual_seed(0)
    return nn.Linear(4, 4)


def _saved(p):
    return save_checkpoint(str(p / "ckpt"), 3, _model())


def _damaged(p, name, damage):
    path = _saved(p)
    damage(os.path.join(path, name))
    return path


def _garble(path):
    with open(path, "w") as f:
        f.write("{not json")


def _edit(**changes):
    def edit(path):
        with open(path) as f:
            meta = json.load(f)
        meta.update(changes)
        with open(path, "w") as f:
            json.dump(meta, f)
    return edit


@pytest.mark.parametrize("case, call, exc, match", CASES, ids=[c[0] for c in CASES])
def test_raises(case, call, exc, match, tmp_path):
    with pytest.raises(exc, match=match):
        call(tmp_path)
