"""The parallelism benchmarks: the pipeline schedules' bubble and expert parallelism.

    torchrun --standalone --nproc-per-node 2 qa/bench/parallelism.py pipeline --no-record
    torchrun --standalone --nproc-per-node 4 qa/bench/parallelism.py experts --no-record              # CPU ranks
    python qa/bench/parallelism.py experts --compute --model large --no-record                        # one GPU

``qa/bench/parallelism.py KIND --help`` lists a kind's options; what each measures and the rows it writes:
``_pipeline_bubble.py`` (``bench`` "pipeline_bubble") and ``_experts.py`` (``bench`` "experts").
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from qa.bench._dispatch import run  # noqa: E402

KINDS = {"pipeline": "qa.bench._pipeline_bubble", "experts": "qa.bench._experts"}

if __name__ == "__main__":
    run("parallelism.py", KINDS)
