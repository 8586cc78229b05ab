"""The job as users run it: text in, metrics out, the weights out and text back, nothing lost, nothing silent.

One pipeline on 2 gloo ranks (``test_text_to_samples``): a text prepared into tokens, trained with the validation
loss and TensorBoard, resumed, exported and sampled; the exported weights give the trained model's logits. Then
each bad input the job meets (``test_*_exits_2``): one line naming it, exit code 2, and no file of an earlier
run changed. The in-process cases call the CLIs' ``main`` (a group of one), the rest launch ``torchrun``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil

import pytest
import torch
from train_job_cases import SMALL, TEXT, _launch, _ok, _prepared, _report, _run

from distwgrad.checkpoint import load_checkpoint
from distwgrad.models import MoEGPT, MoEGPTConfig

# the tiny preset at SMALL's sizes, on a byte vocabulary (prepare_data's meta.json sets --vocab-size)
BYTE_CONFIG = MoEGPTConfig(vocab_size=256, seq_len=32, d_model=32, d_ff=64)


def _digest(folder) -> dict[str, str]:
    """Every file under ``folder`` by its contents."""
    out = {}
    for root, _, files in os.walk(folder):
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                out[os.path.relpath(os.path.join(root, f), folder)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def _main(name: str, argv: list[str], capsys) -> tuple[int, str]:
    """A CLI's ``main`` in this process: its exit code (argparse's ``SystemExit`` too) and its stderr."""
    try:
        code = _launch(name).main(argv)
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


@pytest.mark.distributed
def test_text_to_samples(tmp_path, capsys):
    """Prepared text, 2 ranks trained 6 steps (validation every 3, TensorBoard, a checkpoint every 3), resumed
    to 8 in the same folder; the report, the scalars, the export, the samples; then what the run's folders
    refuse: a new run over it, a damaged newest checkpoint; and an interrupted save passed over by name."""
    data = _prepared(tmp_path / "data")
    out, tb = tmp_path / "run", tmp_path / "tb"
    common = ["--data", data, "--eval-every", "3", "--eval-batches", "2", "--tensorboard", str(tb), "--out",
              str(out), "--save-every", "3", *SMALL]
    first = _run(["--steps", "6", *common])
    _ok(first)
    need = float(re.search(r"memory: at least ([\d.]+) GiB for 2 rank\(s\)", first.stderr).group(1)) * 2**30
    measured = sum(_report(out)["peak_memory"]["bytes_per_rank"])  # both ranks' resident high-water marks
    assert 0.5 * measured <= need <= measured, (need, measured)  # a lower bound, not a vacuous one
    _ok(_run(["--steps", "8", "--resume", str(out / "checkpoints"), *common]))
    meta = json.loads((tmp_path / "data" / "meta.json").read_text())
    assert meta["tokenizer"] == "byte" and meta["vocab_size"] == 256
    assert meta["train_tokens"] + meta["val_tokens"] == len(TEXT.encode()) and meta["val_tokens"] > 0
    report = _report(out)
    assert report["config"]["vocab_size"] == 256, "the model's vocabulary comes from meta.json"
    assert report["steps"] == list(range(1, 9)) and report["val_steps"] == [3, 6, 8]
    assert all(0 < v < 6 for v in report["val_loss"]) and report["corpus"]["tokenizer"] == "byte"
    assert [e["step"] for e in report["logged"]] == [6, 8]  # --log-every 10: the last step of each run
    assert all(e["grad_norm"] > 0 and e["lr"] > 0 for e in report["logged"])
    assert re.search(r"step 6/6  loss \d+\.\d{4}  val loss \d+\.\d{4}  grad norm", first.stderr), first.stderr
    assert "train:" not in first.stderr, "no progress bar into a pipe"

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    board = EventAccumulator(str(tb)).Reload()
    assert {"train/loss", "val/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s",
            "perf/peak_memory_gib"} <= set(board.Tags()["scalars"])
    assert [e.step for e in board.Scalars("val/loss")] == [6, 8]
    assert abs(board.Scalars("train/loss")[-1].value - report["loss"][-1]) < 1e-6

    # out of the job: exported in one process, reloaded into the plain build, the trained model's logits
    code, err = _main("export", [str(out / "checkpoints"), "--out", str(tmp_path / "export")], capsys)
    assert code == 0, err
    exported = json.loads((tmp_path / "export" / "meta.json").read_text())
    assert exported["step"] == 8 and exported["tokenizer"] == "byte" and exported["files"] == ["model.safetensors"]
    sample = _launch("sample")
    plain, _ = sample.load_model(str(tmp_path / "export"))
    trained = MoEGPT(BYTE_CONFIG)
    with torch.random.fork_rng():
        load_checkpoint(str(out / "checkpoints" / "step_8"), trained,
                        expect={"model_config": BYTE_CONFIG.architecture()})
    ids = torch.tensor([list(b"It was the best of times")])
    with torch.no_grad():
        torch.testing.assert_close(plain(ids), trained(ids), rtol=1e-5, atol=1e-5)
    assert sample.main([str(tmp_path / "export"), "--prompt", "It was", "--max-new-tokens", "12",
                        "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("It was")
    code, err = _main("sample", [str(tmp_path / "export"), "--prompt", "x", "--top-k", "-1"], capsys)
    assert code == 2 and "--top-k" in err
    code, err = _main("export", [str(out / "checkpoints" / "step_6"), "--out", str(tmp_path / "shards"),
                                 "--max-shard-gb", "0.00002"], capsys)  # 20 kB shards
    assert code == 0, err
    index = json.loads((tmp_path / "shards" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    model, _ = sample.load_model(str(tmp_path / "shards"))
    assert model.lm_head.weight is model.embedding.weight  # tied, saved once
    before = _digest(tmp_path / "shards")
    code, err = _main("export", [str(out / "checkpoints"), "--out", str(tmp_path / "shards")], capsys)
    assert code == 2 and "already holds an export" in err and _digest(tmp_path / "shards") == before

    # a new run into the finished one: refused, every file as it was; --overwrite replaces the report
    before = _digest(out)
    code, err = _train(["--steps", "2", "--out", str(out), *SMALL], capsys)
    assert code == 2 and "holds a run finished at step 8" in err and "--overwrite" in err
    assert _digest(out) == before

    # the newest checkpoint damaged: refused by name, the previous one offered; nothing touched
    ckpts = out / "checkpoints"
    (ckpts / "step_8" / "__1_0.distcp").unlink()
    before = _digest(ckpts)
    code, err = _train(["--steps", "12", "--resume", str(ckpts), "--data", data, "--out", str(tmp_path / "r"),
                        *SMALL], capsys)
    assert code == 2 and f"newest checkpoint in '{ckpts}' is damaged" in err and "__1_0.distcp" in err
    assert f"--resume {ckpts / 'step_6'}" in err and _digest(ckpts) == before
    # an interrupted save newer than the newest complete checkpoint: passed over, named
    shutil.rmtree(ckpts / "step_8")
    (ckpts / "step_9.tmp").mkdir()
    code, err = _train(["--steps", "7", "--resume", str(ckpts), "--data", data, "--out", str(tmp_path / "r"),
                        *SMALL], capsys)
    assert code == 0, err
    assert f"skipping {ckpts / 'step_9.tmp'}: an interrupted save" in err and "at step 6" in err
    code, err = _train(["--steps", "2", "--out", str(out), "--overwrite", *SMALL], capsys)
    assert code == 0, err
    assert _report(out)["steps"] == [1, 2]


def test_a_bpe_trained_on_the_text(tmp_path):
    data = _prepared(tmp_path / "bpe", tokenizer="bpe", vocab_size=300)
    meta = json.loads((tmp_path / "bpe" / "meta.json").read_text())
    assert meta["tokenizer"] == "bpe" and meta["vocab_size"] <= 300 and (tmp_path / "bpe" / "tokenizer.json").exists()
    tok = _launch("tokenizer").load(data, meta)
    assert tok.decode(tok.encode("it was the age of wisdom")) == "it was the age of wisdom"
    assert meta["train_tokens"] < len(TEXT.encode()) * 0.9, "merges: fewer tokens than bytes"
    config = _launch("config").TrainConfig(data=data)
    assert config.vocab_size == meta["vocab_size"]


def test_prepare_data_refuses_bad_input_by_name(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    cases = [
        ([str(tmp_path / "missing.txt"), "--out", str(tmp_path / "o")], "missing.txt': no such file"),
        ([str(text), "--out", str(tmp_path / "o"), "--val-fraction", "1.5"], "--val-fraction 1.5"),
        ([str(text), "--out", str(tmp_path / "o"), "--vocab-size", "100"], "byte tokenizer's vocabulary is 256"),
        ([str(text), "--out", str(tmp_path / "o"), "--tokenizer", "bpe", "--vocab-size", "70000"], "70000"),
    ]
    (tmp_path / "empty.txt").write_text("")
    cases.append(([str(tmp_path / "empty.txt"), "--out", str(tmp_path / "o")], "are empty"))
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    cases.append(([str(tmp_path / "latin1.txt"), "--out", str(tmp_path / "o")], "is not UTF-8"))
    for argv, match in cases:
        code, err = _main("prepare_data", argv, capsys)
        assert code == 2 and match in err and len(err.strip().splitlines()) == 1, (argv, err)
    _prepared(tmp_path / "done")
    before = _digest(tmp_path / "done")
    code, err = _main("prepare_data", [str(text), "--out", str(tmp_path / "done")], capsys)
    assert code == 2 and "already holds train.bin" in err and _digest(tmp_path / "done") == before


# --- bad inputs to the job: one line, exit code 2, nothing lost ---------------------------------------------

def _train(argv, capsys):
    return _main("train", [*argv, "--device", "cpu", "--no-progress"], capsys)


def test_bad_data_exits_2(tmp_path, capsys):
    (tmp_path / "empty.bin").write_bytes(b"")
    code, err = _train(["--data", str(tmp_path / "empty.bin"), "--vocab-size", "256", "--out", str(tmp_path / "r")],
                       capsys)
    assert code == 2 and "the file is empty" in err and err.count("error:") == 1
    data = _prepared(tmp_path / "d")
    with open(os.path.join(data, "train.bin"), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(data, "train.bin")) - 64)
    code, err = _train(["--data", data, "--out", str(tmp_path / "r")], capsys)
    assert code == 2 and "but its meta.json says" in err
    data = _prepared(tmp_path / "noval", val_fraction=0.0)
    code, err = _train(["--data", data, "--eval-every", "2", "--out", str(tmp_path / "r")], capsys)
    assert code == 2 and "no val.bin" in err


def test_too_large_a_model_for_this_machine_says_so_before_building(capsys, monkeypatch):
    train = _launch("train")
    monkeypatch.setattr(train, "_available_bytes", lambda: 2**20)
    code, err = _train(["--model", "small", "--out", "unused"], capsys)
    assert code == 2 and re.search(r"--model small \([\d,]+ parameters\) needs at least [\d.]+ GiB", err)
    assert "0.00 GiB are available" in err and not os.path.exists("unused")


def test_help_is_grouped_and_short():
    text = _launch("config").build_parser(prog="train").format_help()
    assert len(text.splitlines()) <= 100, len(text.splitlines())
    for section in _launch("config").GROUPS:
        assert f"\n{section}:\n" in text, section
    assert "(default: None)" not in text
    assert text.count("(default:") >= 10
