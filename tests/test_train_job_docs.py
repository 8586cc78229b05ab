"""The job as documented: every command of ``--help`` and the README's runs as written, the README's usage
example prints per rank, and a fresh ``pip install -e .`` declares every third-party module the job imports.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

import pytest
from train_job_cases import MODULE, REPO, _launch, _prepared, _report, _run_forked


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


def _steps(argv: list[str]) -> list[str]:
    """``argv`` with a ``--steps`` override appended (argparse takes the last): 4 for a resume, 2 otherwise, none
    for ``--help``."""
    return argv if "--help" in argv else [*argv, "--steps", "4" if "--resume" in argv else "2", "--no-progress"]


def _shell(command: str, cwd) -> subprocess.Popen:
    """One documented command as written, torchrun's agent and all, but for the interpreter, the module name in
    a bare checkout, and ``_steps``."""
    argv = command.split()
    if argv[0] == "torchrun":
        argv[:1] = [sys.executable, "-m", "torch.distributed.run"]
    elif argv[0] == "python":
        argv[0] = sys.executable
    argv = _steps([MODULE if a == "distwgrad.launch.train" else a for a in argv])
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    return subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait(command: str, proc: subprocess.Popen, timeout: float = 600) -> str:
    stdout, stderr = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"{command}\nexit {proc.returncode}\n{stderr[-6000:]}"
    return stdout


def _forked(command: str, cwd) -> str:
    """One documented command with its ranks forked ([Note: forked job ranks] in
    ``distwgrad/testing/job_ranks.py``): the job sees what torchrun gives it, ``--nproc-per-node`` ranks; the
    agent itself runs in ``_shell``'s commands. Its stdout."""
    words = command.split()
    nproc = int(words[words.index("--nproc-per-node") + 1]) if words[0] == "torchrun" else None
    proc = _run_forked(_steps(words[words.index("-m") + 2:]), nproc, cwd=str(cwd), timeout=300)
    assert proc.returncode == 0, f"{command}\nexit {proc.returncode}\n{proc.stderr[-6000:]}"
    return proc.stdout


@pytest.mark.distributed
def test_every_documented_command_runs(tmp_path):
    """Each in its own folder but the resume, after its save. The README's job command runs as written, under
    torchrun; the others with their ranks forked, one after another, while it runs (a torchrun start-up costs
    a 2-rank run of 2 steps most of its time: the agent's and each rank's imports)."""
    commands = _help_commands()
    readme = _readme_job_command()
    assert len(commands) >= 8 and readme in commands
    resume = [c for c in commands if "--resume" in c]
    assert len(resume) == 1 and "--nproc-per-node 4" in resume[0]
    save = [c for c in commands if "--out runs/a" in c and c not in resume]
    assert len(save) == 1
    os.makedirs(tmp_path / "readme")
    as_written = _shell(readme, tmp_path / "readme")
    outputs = {}
    try:
        for i, command in enumerate(save + resume + [c for c in commands if c not in resume + save + [readme]]):
            cwd = tmp_path if command in save + resume else tmp_path / str(i)
            os.makedirs(cwd, exist_ok=True)
            if "--data data/corpus" in command:  # the folder its comment prepares from text
                _prepared(cwd / "data" / "corpus")
            outputs[command] = _forked(command, cwd)
    finally:
        if len(outputs) < len(commands) - 1:  # one of them failed: the README's run ends with the test
            as_written.terminate()  # SIGTERM: torchrun's agent stops its ranks (SIGKILL would orphan them)
            as_written.communicate(timeout=120)
    outputs[readme] = _wait(readme, as_written)
    assert "usage: distwgrad.launch.train" in outputs["python -m distwgrad.launch.train --help"]
    resumed = _report(str(tmp_path / "runs" / "a"))  # saved at step 2, resumed to 4 into the same folder
    assert resumed["steps"] == [1, 2, 3, 4] and [s["world_size"] for s in resumed["segments"]] == [2, 4]
    as_run = _report(str(tmp_path / "readme" / "runs" / "moe_gpt"))  # the default --out
    assert as_run["steps"] == [1, 2] and [s["world_size"] for s in as_run["segments"]] == [2], as_run["segments"]


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
    """A fresh ``pip install -e .`` must be all the job needs: every third-party module the job's files import at
    the top is in ``[project] dependencies``; one imported inside a function (an optional feature:
    ``--tensorboard``, a BPE, ``export``) is at least in an optional extra."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]

    def names(deps):
        return {re.split(r"[<>=!~ \[]", d)[0].lower() for d in deps}
    declared = names(project["dependencies"])
    optional = declared | names(d for ds in project["optional-dependencies"].values() for d in ds)
    files = [os.path.join(REPO, "launch", n) for n in os.listdir(os.path.join(REPO, "launch")) if n.endswith(".py")]
    files += [os.path.join(REPO, "distwgrad", n) for n in ("data.py", "checkpoint.py")]
    files += [os.path.join(REPO, "distwgrad", "models", "moe_gpt.py")]
    top, inner = set(), set()
    for path in files:
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            found = ({a.name.split(".")[0] for a in node.names} if isinstance(node, ast.Import) else
                     {node.module.split(".")[0]} if isinstance(node, ast.ImportFrom) and node.level == 0 else set())
            (top if node in tree.body else inner).update(found)
    stdlib = set(sys.stdlib_module_names) | {"distwgrad", "__future__"}
    assert top - stdlib <= declared, (top - stdlib - declared, declared)
    assert inner - stdlib <= optional, (inner - stdlib - optional, optional)


def _documented_commands() -> list[tuple[str, str]]:
    """(page, command) for every line of every ``bash`` block of the README and ``docs/``: the pages a user
    copies commands from. The benchmark record pages (``docs/benchmarks*``) are generated, not copied."""
    pages = ["README.md"] + sorted(os.path.join("docs", n) for n in os.listdir(os.path.join(REPO, "docs"))
                                   if n.endswith(".md"))
    found = []
    for page in pages:
        with open(os.path.join(REPO, page)) as f:
            text = f.read()
        for block in re.findall(r"```bash\n(.*?)```", text, re.S):
            for line in block.replace("\\\n", " ").splitlines():
                command = line.split("  #")[0].strip()
                if command and not command.startswith("#"):
                    found.append((page, command))
    return found


def test_documented_commands_write_nothing_tracked():
    """A command copied from the docs may write its outputs (``--out``, ``--tensorboard``, ``--profile``, a
    prepared data folder) only under an ignored folder, and a benchmark only with ``--no-record`` (without it
    rows go to the tracked ``docs/benchmarks/results.jsonl``)."""
    with open(os.path.join(REPO, ".gitignore")) as f:
        ignored = {line.strip().strip("/") for line in f if line.strip().startswith("/") and line.strip().endswith("/")}
    commands = _documented_commands()
    assert len(commands) >= 20, commands
    checked = 0
    for page, command in commands:
        argv = command.split()
        for flag in ("--out", "--tensorboard", "--profile", "--plot"):
            for i, arg in enumerate(argv[:-1]):
                if arg == flag and not argv[i + 1].startswith("-"):
                    top = argv[i + 1].lstrip("./").split("/")[0]
                    assert top in ignored, f"{page}: `{command}` writes {flag} {argv[i + 1]}, outside {sorted(ignored)}"
                    checked += 1
        if any(a.startswith("qa/bench/") and a.endswith(".py") for a in argv) or "qa.bench." in command:
            assert "--no-record" in argv or "--results" in argv, f"{page}: `{command}` appends to results.jsonl"
            checked += 1
    assert checked >= 10, checked
